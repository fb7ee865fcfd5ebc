"""Decoder glue shared by Llama, Mistral, Gemma, Qwen2, Qwen3, Gemma 2, Gemma 3, Phi-3 and the
generic path's families (gpt-oss among them): route a loaded model's modules through
slothkit_kernels by patching the *instance*.

Only the given model's modules get new ``forward`` methods (bound with
``types.MethodType``); transformers' classes are never touched, so a plain and a
fused model can live in one process and importing slothkit changes nothing.
The original forward of each patched module is kept in its ``PatchedModule`` record
(slothkit.core.model_state) and is what runs whenever the fused path cannot (an unsupported LoRA setting, a trainable lm_head, evaluation with
logits requested).
"""

from __future__ import annotations

import inspect
import sys
import types

import torch
import torch.nn.functional as F
from torch import nn

from slothkit.core.inspection import attention_window, causal_lm_of, language_model_of
from slothkit.core.model_state import (
    PatchedModule,
    attach_patched_module,
    attach_state,
    detach_patched_module,
    patched_module,
    state_of,
)
from slothkit.core.notices import FallbackWarning, say_once
from slothkit.engine.checkpointing.recomputation import recomputing
from slothkit.engine.decoder_layer import checkpoints_in_forward, decoder_layer_forward
from slothkit.engine.lora_projection import projections_or_none, row_projections_or_none
from slothkit.memory.sizes import mlp_token_chunk
from slothkit.models.architecture import Architecture
from slothkit_kernels.attention import attention as tiled_attention
from slothkit_kernels.cross_entropy import check_labels_in_range
from slothkit_kernels.fused_linear_cross_entropy import fused_linear_cross_entropy
from slothkit_kernels.lora import lora_mlp, lora_o, lora_qkv, lora_qkv_rope
from slothkit_kernels.rms_norm import rms_norm
from slothkit_kernels.rope import rope
from slothkit_kernels.utils import use_triton


def bind_forward(module: nn.Module, forward, **record) -> None:
    """Replace ``module``'s forward (on this instance) with ``forward``, keeping its own
    and ``record``'s fields in its PatchedModule record."""
    attach_patched_module(module, PatchedModule(original_forward=module.forward, **record))
    module.forward = types.MethodType(forward, module)


def _original(module: nn.Module):
    return patched_module(module).original_forward


# --- RMSNorm -----------------------------------------------------------------


def _rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    record = patched_module(self)
    return rms_norm(hidden_states, self.weight, record.eps, gemma=record.adds_one)


def patch_rms_norm(norm: nn.Module, adds_one: bool) -> None:
    eps = getattr(norm, "variance_epsilon", None)
    if eps is None:
        eps = norm.eps
    bind_forward(norm, _rms_norm_forward, eps=float(eps), adds_one=adds_one)


# --- MLP ---------------------------------------------------------------------


def _mlp_projections(mlp: nn.Module) -> list | None:
    """gate, up and down as LoRAProjections; Phi-3's gate_up_proj read as its two halves of
    rows, gate then up (transformers' Phi3MLP chunks its output in that order)."""
    if not hasattr(mlp, "gate_up_proj"):
        return projections_or_none("the MLP", mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    width = mlp.gate_up_proj.out_features // 2
    gate_up = row_projections_or_none("the MLP's gate_up_proj", mlp.gate_up_proj, (0, width, 2 * width))
    down = projections_or_none("the MLP", mlp.down_proj)
    return None if gate_up is None or down is None else [*gate_up, *down]


def _mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    projections = _mlp_projections(self)
    if projections is None:
        return _original(self)(x)
    # In the backward re-run of an offload-checkpointed layer the MLP output only feeds
    # the layer output, which nobody reads: skip the down projection (a hook on the MLP
    # might read it, so not then). Where a norm reads the output (Gemma 3's
    # post_feedforward_layernorm), that norm's backward needs it: never skip there.
    record = patched_module(self)
    backward_only = (
        record.output_unread_in_recompute
        and recomputing()
        and not (self._forward_hooks or self._forward_pre_hooks)
    )
    return lora_mlp(
        x,
        *projections,
        activation=record.activation,
        backward_only=backward_only,
        token_chunk=mlp_token_chunk(x.numel() // x.shape[-1]),
    )


def patch_mlp(mlp: nn.Module, activation: str, output_unread_in_recompute: bool = True) -> None:
    """output_unread_in_recompute: the MLP's output goes straight into the residual sum
    that is the layer's output (Llama, Mistral, Gemma, Qwen), so a checkpoint's re-run may
    skip the down projection; False where something reads it first (Gemma 3's
    post_feedforward_layernorm)."""
    bind_forward(
        mlp, _mlp_forward, activation=activation, output_unread_in_recompute=output_unread_in_recompute
    )


# --- attention ---------------------------------------------------------------


def _sinks(attention: nn.Module) -> torch.Tensor | None:
    """The module's per-head sink logits (gpt-oss's ``sinks``: one more logit in each row's
    softmax, with no value), or None."""
    sinks = getattr(attention, "sinks", None)
    return sinks if isinstance(sinks, torch.Tensor) else None


def _attention_function(attention: nn.Module):
    """transformers' attention function for this module: the registered one of its config's
    implementation, or under eager attention its own modeling file's (Gemma 2's soft-caps the
    scores, gpt-oss's adds its sinks; Llama's, the fallback, does neither). A module that
    soft-caps its scores or has sinks runs its eager function under SDPA too, said once:
    SDPA would drop them."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    implementation = getattr(attention.config, "_attn_implementation", None) or "sdpa"
    if getattr(attention, "attn_logit_softcapping", None) is not None:
        what = "soft-caps its attention scores"
    elif _sinks(attention) is not None:
        what = "adds sink logits to its attention's softmax"
    else:
        what = None
    if implementation == "sdpa" and what is not None:
        say_once(
            f"slothkit: {type(attention).__name__} {what}, which SDPA cannot do; slothkit's "
            f"fused attention runs eager attention for it instead of the SDPA that was asked for",
            FallbackWarning,
        )
        implementation = "eager"
    if implementation == "eager":
        from transformers.models.llama.modeling_llama import eager_attention_forward

        own = getattr(sys.modules.get(type(attention).__module__), "eager_attention_forward", None)
        return own or eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[implementation]


def _tiled_attention_applies(attention: nn.Module, q, k, dropout: float, kwargs) -> bool:
    """Whether slothkit's tiled attention computes this soft-capped or sink-holding
    attention: SDPA can do neither, and eager writes every (T, S) score matrix several
    times over (Gemma-2-9B at 2 x 2048 trains at about 0.7x the speed it does with the
    scores uncapped under SDPA). Not under flash or flex attention (they cap and sink
    themselves), with attention dropout, when the weights are asked for, or when keys were
    cached before these queries (a static cache's rows need not end at the queries)."""
    implementation = getattr(attention.config, "_attn_implementation", None) or "sdpa"
    return (
        implementation in ("eager", "sdpa")
        and use_triton(q)
        and dropout == 0.0
        and q.shape[2] == k.shape[2]
        and not kwargs.get("output_attentions", False)
    )


def _update_cache(cache, key, value, layer_idx, kwargs):
    # transformers >= 5.2x passes the call's kwargs to Cache.update; older ones do not.
    if "kwargs" in inspect.signature(cache.update).parameters:
        return cache.update(key, value, layer_idx, kwargs=kwargs)
    return cache.update(key, value, layer_idx)


def _qkv_rows(attention: nn.Module) -> tuple[int, int, int, int]:
    """Where q, k and v start and end in the rows of a fused qkv_proj (Phi-3): q's heads,
    then k's, then v's, as transformers' Phi3Attention splits its output."""
    q = attention.config.num_attention_heads * attention.head_dim
    kv = attention.config.num_key_value_heads * attention.head_dim
    return (0, q, q + kv, q + 2 * kv)


def _qkv_projections(attention: nn.Module) -> list | None:
    """q, k and v as LoRAProjections (a fused qkv_proj read as three row ranges), or None
    where they cannot take the fused path."""
    if hasattr(attention, "qkv_proj"):
        return row_projections_or_none("attention qkv_proj", attention.qkv_proj, _qkv_rows(attention))
    return projections_or_none("attention q/k/v", attention.q_proj, attention.k_proj, attention.v_proj)


def _qkv_unfused(attention: nn.Module, hidden_states: torch.Tensor) -> tuple:
    """q, k and v through the modules' own forwards."""
    if hasattr(attention, "qkv_proj"):
        _, q_end, k_end, _ = _qkv_rows(attention)
        qkv = attention.qkv_proj(hidden_states)
        return qkv[..., :q_end], qkv[..., q_end:k_end], qkv[..., k_end:]
    return attention.q_proj(hidden_states), attention.k_proj(hidden_states), attention.v_proj(hidden_states)


def attention_values(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
    """The patched attention's output before its output projection: (B, T, heads * D),
    and the attention weights (None from SDPA and flash)."""
    # transformers renamed `past_key_values` to `cache`; accept both.
    cache = kwargs.pop("cache", None)
    if cache is None:
        cache = kwargs.pop("past_key_values", None)
    else:
        kwargs.pop("past_key_values", None)

    batch, seq = hidden_states.shape[:-1]
    cos, sin = position_embeddings
    if cos.shape[-1] * 2 == self.head_dim:
        # Tables that give each frequency once (gpt-oss's), for a RoPE that rotates the two
        # halves of each head as rotate_half does: the same tables repeated. (A RoPE over
        # part of each head has tables this wide too; the generic path's check at loading
        # refuses it, as every family with a record rotates whole heads.)
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
    projections = _qkv_projections(self)
    qk_norm = patched_module(self).qk_norm
    if projections is None:
        q, k, v = _qkv_unfused(self, hidden_states)
    elif qk_norm:  # the norms come between the projections and RoPE
        q, k, v = lora_qkv(hidden_states, *projections)
    else:  # RoPE inside the projections' autograd Function: less work in backward
        q, k, v = lora_qkv_rope(hidden_states, *projections, cos, sin, self.head_dim)
    # (B, T, heads * D) -> (B, T, heads, D)
    q = q.view(batch, seq, -1, self.head_dim)
    k = k.view(batch, seq, -1, self.head_dim)
    if qk_norm:  # Qwen3, Gemma 3: RMSNorm over each head's D values (patched: slothkit's kernel)
        q, k = self.q_norm(q), self.k_norm(k)
    # (B, T, heads, D) -> (B, heads, T, D)
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    v = v.view(batch, seq, -1, self.head_dim).transpose(1, 2)
    if projections is None or qk_norm:
        q, k = rope(q, k, cos, sin)

    if cache is not None:
        k, v = _update_cache(cache, k, v, self.layer_idx, kwargs)

    extra = {}
    window = attention_window(self)
    if window is not None:
        extra["sliding_window"] = window
    softcap = getattr(self, "attn_logit_softcapping", None)  # Gemma 2: c * tanh(scores / c)
    if softcap is not None:
        extra["softcap"] = softcap
    sinks = _sinks(self)
    if sinks is not None:  # the name transformers' flash and flex functions read them by
        extra["s_aux"] = sinks
    dropout = 0.0 if not self.training else self.attention_dropout
    tiled = softcap is not None or sinks is not None
    if tiled and _tiled_attention_applies(self, q, k, dropout, kwargs):
        attn_output = tiled_attention(q, k, v, self.scaling, attention_mask, softcap, window, sinks)
        return attn_output.reshape(batch, seq, -1), None
    attn_output, attn_weights = _attention_function(self)(
        self,
        q,
        k,
        v,
        attention_mask,
        dropout=dropout,
        scaling=self.scaling,
        **extra,
        **kwargs,
    )
    return attn_output.reshape(batch, seq, -1), attn_weights  # (B, T, heads * D)


def _attention_forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
    attn_output, attn_weights = attention_values(
        self, hidden_states, position_embeddings, attention_mask, **kwargs
    )
    out_projection = projections_or_none("attention o_proj", self.o_proj)
    if out_projection is None:
        return self.o_proj(attn_output), attn_weights
    return lora_o(attn_output, out_projection[0]), attn_weights


def patch_attention(attention: nn.Module, qk_norm: bool = False) -> None:
    """qk_norm: the module normalises each head's q and k (its q_norm and k_norm, patched
    by the caller) before RoPE (Qwen3)."""
    # The decoder layer's forward calls attention_values to apply o_proj with the residual
    # sum itself.
    bind_forward(
        attention,
        _attention_forward,
        attention_values=types.MethodType(attention_values, attention),
        qk_norm=qk_norm,
    )


# --- the decoder layer -----------------------------------------------------------


def patch_decoder_layer(layer: nn.Module, sandwich_norms: bool = False) -> None:
    """Only for layers whose forward is the two residual sums ``decoder_layer_forward``
    computes (Llama, Mistral, Gemma, Qwen; with ``sandwich_norms`` Gemma 3's, a norm on
    each sum's second term), with their submodules patched."""
    bind_forward(
        layer,
        decoder_layer_forward,
        checkpoints_in_forward=checkpoints_in_forward(layer),
        sandwich_norms=sandwich_norms,
    )


# --- the language-model head and loss ------------------------------------------

IGNORE_INDEX = -100  # Hugging Face's label for "no loss here"


def next_token_labels(labels: torch.Tensor) -> torch.Tensor:
    """Position t predicts token t+1; the last position predicts nothing."""
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]


def _causal_lm_forward(self, input_ids=None, attention_mask=None, position_ids=None, labels=None, **kwargs):
    """With labels in training mode, return the loss from the fused linear
    cross-entropy and no logits; otherwise run the model's own forward."""
    head = self.get_output_embeddings()
    fusable_head = type(head) is nn.Linear and head.bias is None
    if labels is None or not self.training or not fusable_head:
        return _original(self)(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            labels=labels,
            **kwargs,
        )
    from transformers.modeling_outputs import CausalLMOutputWithPast

    num_items_in_batch = kwargs.pop("num_items_in_batch", None)
    shift_labels = kwargs.pop("shift_labels", None)
    kwargs.pop("logits_to_keep", None)
    kwargs.pop("return_dict", None)
    if shift_labels is None:
        shift_labels = next_token_labels(labels)
    # Both reads to the host happen before the layers run, not at the loss: a bad label
    # is reported before the expensive work, and each read waits only for what is queued
    # at the start of the step, where after the forward it would wait for all of it and
    # leave the GPU idle while the loss and the first layer's backward are issued.
    check_labels_in_range(shift_labels, head.weight.shape[0], IGNORE_INDEX)
    if isinstance(num_items_in_batch, torch.Tensor):
        num_items_in_batch = int(num_items_in_batch.item())
    if "labels" in inspect.signature(self.model.forward).parameters:
        # An image-text model's own forward hands them to its base model (Gemma 3's), so
        # the base model sees the call it sees without slothkit.
        kwargs["labels"] = labels
    outputs = self.model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs
    )
    hidden = outputs.last_hidden_state  # (B, T, H)
    loss = fused_linear_cross_entropy(
        hidden.reshape(-1, hidden.shape[-1]),
        head.weight,
        shift_labels.reshape(-1).to(hidden.device),
        ignore_index=IGNORE_INDEX,
        softcap=getattr(self.config, "final_logit_softcapping", None),
        num_items_in_batch=num_items_in_batch,
        check_labels=False,  # checked above
    )
    return CausalLMOutputWithPast(
        loss=loss, logits=None, hidden_states=outputs.hidden_states, attentions=outputs.attentions
    )


def _with_own_signature(function, model: nn.Module):
    """A copy of `function` that inspect reads as `model`'s class forward: generate() passes
    on only the keywords that forward names (an image-text model's pixel_values), and the
    Trainer keeps only the dataset columns it names."""
    copy = types.FunctionType(
        function.__code__,
        function.__globals__,
        function.__name__,
        function.__defaults__,
        function.__closure__,
    )
    copy.__signature__ = inspect.signature(type(model).forward)
    return copy


def patch_causal_lm(model: nn.Module) -> None:
    if patched_module(model) is None:  # idempotent
        bind_forward(model, _with_own_signature(_causal_lm_forward, model))


# --- the whole model ---------------------------------------------------------------


# Where transformers' decoders keep their layers: `.layers` (Llama and most), `.h` (GPT-2,
# Falcon, Bloom, GPT-J), `.blocks`.
LAYER_LISTS = ("layers", "h", "blocks")


def decoder_layers(model: nn.Module):
    """(the *ForCausalLM, *ForSequenceClassification or image-text *ForConditionalGeneration
    model, optionally inside a PeftModel, and its (language model's) decoder layers).

    Raises:
        ValueError: the model keeps no list of layers where transformers' decoders do.
    """
    causal_lm = causal_lm_of(model)
    decoder = language_model_of(causal_lm)
    for name in LAYER_LISTS:
        layers = getattr(decoder, name, None)
        if isinstance(layers, nn.ModuleList) and len(layers) > 0:
            return causal_lm, layers
    raise ValueError(
        f"slothkit finds no decoder layers in {type(causal_lm).__name__}: it looks for a list of "
        f"layers at its base model's {', '.join('.' + n for n in LAYER_LISTS)}"
    )


def patch_decoder(model: nn.Module, arch: Architecture, fused_head: bool = True) -> nn.Module:
    """Route every norm, attention, MLP and the training loss of ``model`` through
    the fused kernels.  A sequence classifier (a reward model) keeps its score head and
    loss: only its decoder is patched; so does a model patched with ``fused_head=False``
    (an image-text model whose loss is not checked to be the plain one).  An image-text
    model's language model is the decoder patched (``language_model_of``).  Idempotent;
    returns the model."""
    causal_lm, layers = decoder_layers(model)
    state = state_of(causal_lm)
    if state is not None and state.architecture == arch.name:
        return model
    language_model = language_model_of(causal_lm)
    activation = arch.activation(language_model.config)
    norms = ["input_layernorm", "post_attention_layernorm"]
    if arch.sandwich_norms:
        norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    for layer in layers:
        for name in norms:
            patch_rms_norm(getattr(layer, name), arch.norm_adds_one)
        if arch.qk_norm:
            patch_rms_norm(layer.self_attn.q_norm, arch.norm_adds_one)
            patch_rms_norm(layer.self_attn.k_norm, arch.norm_adds_one)
        patch_attention(layer.self_attn, qk_norm=arch.qk_norm)
        patch_mlp(layer.mlp, activation, output_unread_in_recompute=not arch.sandwich_norms)
        patch_decoder_layer(layer, sandwich_norms=arch.sandwich_norms)
    patch_rms_norm(language_model.norm, arch.norm_adds_one)
    if fused_head and causal_lm.get_output_embeddings() is not None:  # an LM head: the fused loss applies
        patch_causal_lm(causal_lm)
    attach_state(causal_lm).architecture = arch.name
    return model


def unpatch_decoder(model: nn.Module) -> nn.Module:
    """Restore every patched module's own forward."""
    causal_lm, _ = decoder_layers(model)
    for module in causal_lm.modules():
        if detach_patched_module(module) is not None:
            module.__dict__.pop("forward", None)
    state = state_of(causal_lm)
    if state is not None:
        state.architecture = None
    return model
