"""Qwen3.5's gated DeltaNet layers (linear attention) through slothkit's chunked delta
rule kernel (slothkit_kernels.delta_rule) in training.

A gated DeltaNet layer projects the hidden states to q, k, v (through a causal
depthwise convolution and SiLU), z, and the per-head b and a; with beta = sigmoid(b) and
g = -exp(A_log) softplus(a + dt_bias) it runs the gated delta rule over q, k, v (q and k
l2-normalised), gates its output with z through the layer's RMSNorm, and projects it
back.  transformers computes the delta rule with flash-linear-attention where that runs
and with a pure-torch chunked loop elsewhere; here each layer instance gets a forward
that computes the same steps with the layer's own modules (LoRA-wrapped or not) and the
Triton kernel for the delta rule.  With a cache (generation) or packed sequences
(cu_seq_lens_q) the layer's own forward runs.

transformers re-applies Hugging Face's hub kernels to the classes it decorates at every
switch between training and evaluation, restoring each instance's class forward; FastModel
loads with them off (slothkit.loading.load_model), so the patches hold.

As for the fused decoder layers (slothkit.engine.generic_layers), the model decides: each
patched layer's output on a random batch (over a chunk long), and the gradient of its
input, are compared with its own forward's, in eval mode, and every patch is undone if
one differs beyond the rounding of the model's dtype, or if the kernels fail to compile
or run on this GPU (said once, with the error).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from slothkit.core.model_state import detach_patched_module, patched_module
from slothkit.engine.decoder import bind_forward
from slothkit.engine.generic_layers import largest_difference, relative_tolerance, worst_difference
from slothkit_kernels.delta_rule import gated_delta_rule

# What a gated DeltaNet layer holds (transformers' Qwen3_5GatedDeltaNet and its MoE twin).
PARTS = (
    "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv1d", "norm", "out_proj",
    "A_log", "dt_bias", "head_k_dim", "head_v_dim", "key_dim", "value_dim", "activation",
)  # fmt: skip
CONV_ACTIVATIONS = ("silu", "swish")
# One chunk of the kernel (64 positions) and a part of a second.
CHECK_TOKENS = 80


def deltanet_layers(causal_lm: nn.Module) -> list[nn.Module]:
    """The gated DeltaNet modules of ``causal_lm``'s decoder layers (``layer.linear_attn``)."""
    layers = getattr(getattr(causal_lm, "model", None), "layers", None) or []
    found = [getattr(layer, "linear_attn", None) for layer in layers]
    return [module for module in found if module is not None and all(hasattr(module, p) for p in PARTS)]


def _own_forward_needed(args: tuple, kwargs: dict) -> bool:
    """Whether the call asks for what the kernel path does not do: a cache (under either of
    transformers' names), packed sequences, or a mask other than (batch, seq_len)."""
    cache = kwargs.get("cache", kwargs.get("cache_params"))
    mask = kwargs.get("attention_mask")
    return (
        bool(args)
        or cache is not None
        or kwargs.get("cu_seq_lens_q") is not None
        or (mask is not None and mask.dim() != 2)
    )


def _deltanet_forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    if _own_forward_needed(args, kwargs):
        return patched_module(self).original_forward(hidden_states, *args, **kwargs)
    mask = kwargs.get("attention_mask")
    if mask is not None:  # padding positions enter the convolution and the state as zeros
        hidden_states = (hidden_states * mask[:, :, None]).to(hidden_states.dtype)
    batch, seq_len, _ = hidden_states.shape
    mixed = self.in_proj_qkv(hidden_states).transpose(1, 2)  # (B, 2 key_dim + value_dim, T)
    # conv1d pads kernel_size - 1 on both sides; its first T outputs are the causal ones.
    mixed = F.silu(self.conv1d(mixed)[:, :, :seq_len]).transpose(1, 2)
    query, key, value = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
    query = query.reshape(batch, seq_len, -1, self.head_k_dim)  # (B, T, HK, dk)
    key = key.reshape(batch, seq_len, -1, self.head_k_dim)
    value = value.reshape(batch, seq_len, -1, self.head_v_dim)  # (B, T, HV, dv)
    z = self.in_proj_z(hidden_states)
    beta = self.in_proj_b(hidden_states).sigmoid()  # (B, T, HV)
    g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(hidden_states).float() + self.dt_bias)
    output, _ = gated_delta_rule(query, key, value, g, beta, use_qk_l2norm_in_kernel=True)
    output = self.norm(output.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
    return self.out_proj(output.reshape(batch, seq_len, -1))


def patch_deltanet(module: nn.Module) -> None:
    """Give this gated DeltaNet instance the kernel path's forward (its own kept)."""
    bind_forward(module, _deltanet_forward)


def _unpatch(modules: list[nn.Module]) -> None:
    for module in modules:
        if detach_patched_module(module) is not None:
            module.__dict__.pop("forward", None)


def _output_and_input_gradient(module: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """The layer's output on ``x`` and the gradient of its sum with respect to ``x``: the
    backward is compiled and run here, on this GPU, before any training step needs it
    (torch.autograd.grad leaves the parameters' .grad alone)."""
    with torch.enable_grad():
        x = x.detach().requires_grad_(True)
        output = module(x)
        (gradient,) = torch.autograd.grad(output.float().sum(), [x])
    return [output.detach().float(), gradient.float()]


def fuse_deltanet_layers(causal_lm: nn.Module) -> tuple[int, str | None]:
    """Route ``causal_lm``'s gated DeltaNet layers through the delta rule kernel where they
    compute what their own forward does (module docstring).

    Returns:
        How many layers run the kernel, and why none does (None when some do or there are none).
    """
    modules = deltanet_layers(causal_lm)
    if not modules:
        return 0, None
    if all(patched_module(m) is not None for m in modules):
        return len(modules), None
    activations = {m.activation for m in modules}
    if not activations <= set(CONV_ACTIVATIONS):
        return 0, f"its convolution's activation {sorted(activations)} is not SiLU"
    weight = modules[0].out_proj.weight
    generator = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(1, CHECK_TOKENS, modules[0].hidden_size, generator=generator).to(
        weight.device, weight.dtype
    )
    was_training = causal_lm.training
    causal_lm.eval()
    patched, differences = [], []
    try:
        for module in modules:
            own = _output_and_input_gradient(module, x)
            patch_deltanet(module)
            patched.append(module)
            fused = _output_and_input_gradient(module, x)
            differences.append(largest_difference(fused, own))
    except Exception as error:  # noqa: BLE001  (a Triton compile or launch error on this GPU included)
        _unpatch(patched)
        return 0, f"its gated DeltaNet layers could not be checked ({type(error).__name__}: {error})"
    finally:
        causal_lm.train(was_training)
    worst = worst_difference(differences)
    if not worst <= relative_tolerance(weight.dtype):  # a NaN fails too
        _unpatch(patched)
        return 0, (
            f"its gated DeltaNet layers compute something else than the kernel path (outputs differ by "
            f"{worst:.2g}, relative, on a random batch)"
        )
    return len(modules), None
