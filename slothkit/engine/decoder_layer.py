"""The decoder layer of Llama, Mistral, Gemma, Qwen2, Qwen3 and Gemma 3, patched on the
instance so that the re-run of offloaded checkpointing does less.

transformers' layer forward is two residual sums:

    h = x + o_proj(attention(norm1(x)))        after attention
    y = h + mlp(norm2(h))                      the layer output

This forward computes the same, through the patched modules, with two differences in
the marked re-run of a checkpointed layer (``slothkit.engine.checkpointing.offload_checkpoint``), whose
output nobody reads:

- h is the one the checkpointed forward kept (``keep``/``kept``), so the output
  projection's GEMM does not run again: ``lora_o_residual`` returns the kept h, and
  its backward is still the sum's (dx, dA, dB of o_proj and the residual's gradient).
- y is ``unread_sum(h, mlp(...))``: backward sends the gradient to both, and no add
  runs (the fused MLP also skips its down projection there).

Everything else (the norms, q/k/v, attention, gate and up) is recomputed as before,
since those activations are what backward needs.  Where the attention has hooks, its
module was not patched, or o_proj cannot take the fused path, h is computed by calling
the attention module as transformers does.

Gemma 3's and Gemma 2's layer (``sandwich_norms`` in its PatchedModule) normalises both
terms it adds:

    h = x + post_attention_layernorm(attention(input_layernorm(x)))
    y = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))

The backward of an RMSNorm needs its input, here o_proj's and the MLP's outputs, so the
re-run computes both (the MLP is patched not to skip its down projection) and h is not
kept: with nothing to skip there is nothing to gain from it.  The last sum is still
``unread_sum`` in the re-run.

Checkpointing: transformers (5.2x and later) checkpoints the class's ``forward`` through
a wrapper, which this instance method replaces; so where the class is wrapped that way
this forward checkpoints itself as the wrapper would.  Older versions checkpoint in
``__call__``, around this forward.  Either way each layer reads its own
``gradient_checkpointing`` flag at every call, so checkpointing is chosen per layer:
use_gradient_checkpointing="auto" (slothkit.engine.checkpointing.recompute_policy) clears it on the
layers whose activations fit the memory budget.
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch import nn

from slothkit.core.model_state import patched_module
from slothkit.engine.checkpointing.recomputation import keep, kept, recomputing, unread_sum
from slothkit.engine.lora_projection import projections_or_none
from slothkit_kernels.lora import lora_o_residual

ATTENTION_SUM = "attention_sum"  # the name h is kept under


def checkpoints_in_forward(layer: nn.Module) -> bool:
    """Whether transformers checkpoints this layer by wrapping its class's forward (which
    an instance forward bypasses) rather than in ``__call__``.  Settled once, when the
    layer is patched: ``decoder_layer_forward`` reads it from the layer's PatchedModule."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # no such base class: the model's loop does the checkpointing
        return False
    return isinstance(layer, GradientCheckpointingLayer) and "__call__" not in vars(
        GradientCheckpointingLayer
    )


@functools.cache
def _warn_cache_dropped(layer_name: str) -> None:
    warnings.warn(
        f"slothkit: a KV cache cannot be used with gradient checkpointing in {layer_name}; "
        f"the layers run without one while training",
        stacklevel=4,
    )


def _without_cache(layer: nn.Module, kwargs: dict) -> dict:
    """The call's keyword arguments with caching off, as transformers' checkpointing
    wrapper sets them: the re-run would otherwise update the cache a second time."""
    kwargs = dict(kwargs)
    dropped = bool(kwargs.get("use_cache"))
    if dropped:
        kwargs["use_cache"] = False
    if not getattr(layer, "_can_checkpoint_with_cache", False):
        for name in ("cache", "past_key_values", "layer_past"):
            if kwargs.get(name) is not None:
                kwargs[name] = None
                dropped = True
    if dropped:
        _warn_cache_dropped(type(layer).__name__)
    return kwargs


def decoder_layer_forward(self, *args, **kwargs):
    record = patched_module(self)
    layer_body = _sandwich_layer_body if record.sandwich_norms else _layer_body
    if (
        record.checkpoints_in_forward
        and self.gradient_checkpointing
        and self.training
        and torch.is_grad_enabled()
    ):
        body = functools.partial(layer_body, self, **_without_cache(self, kwargs))
        return self._gradient_checkpointing_func(body, *args)
    return layer_body(self, *args, **kwargs)


def _fused_attention_sum(self, hidden_states, normed, attention_mask, position_ids, kwargs):
    """h through the patched attention and ``lora_o_residual``, or None where that path
    does not apply (the caller then calls the attention module)."""
    attention = self.self_attn
    record = patched_module(attention)
    values = record.attention_values if record is not None else None
    if values is None or attention._forward_hooks or attention._forward_pre_hooks:
        return None
    o_proj = projections_or_none("attention o_proj", attention.o_proj)
    if o_proj is None:
        return None
    attn, _ = values(normed, attention_mask=attention_mask, position_ids=position_ids, **kwargs)
    hidden = lora_o_residual(attn, o_proj[0], hidden_states, known_sum=kept(ATTENTION_SUM))
    keep(ATTENTION_SUM, hidden)
    return hidden


def _layer_body(self, hidden_states, attention_mask=None, position_ids=None, **kwargs):
    normed = self.input_layernorm(hidden_states)
    hidden = _fused_attention_sum(self, hidden_states, normed, attention_mask, position_ids, kwargs)
    if hidden is None:
        attn, _ = self.self_attn(
            hidden_states=normed, attention_mask=attention_mask, position_ids=position_ids, **kwargs
        )
        hidden = hidden_states + attn
    mlp_out = self.mlp(self.post_attention_layernorm(hidden))
    if isinstance(
        mlp_out, tuple
    ):  # a mixture-of-experts block that also returns its router's scores (gpt-oss)
        mlp_out = mlp_out[0]
    if recomputing():  # the re-run's output is never read
        return unread_sum(hidden, mlp_out)
    return hidden + mlp_out


def _sandwich_layer_body(self, hidden_states, attention_mask=None, position_ids=None, **kwargs):
    """Gemma 3's layer (module docstring): the patched attention applies o_proj itself."""
    attn, _ = self.self_attn(
        hidden_states=self.input_layernorm(hidden_states),
        attention_mask=attention_mask,
        position_ids=position_ids,
        **kwargs,
    )
    hidden = hidden_states + self.post_attention_layernorm(attn)
    mlp_out = self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden)))
    if recomputing():  # the re-run's output is never read
        return unread_sum(hidden, mlp_out)
    return hidden + mlp_out
