"""A gated DeltaNet layer (Qwen3.5's linear attention) in a decode step: a recurrent state
and a convolution's last inputs per row, in place of keys and values.

The layer (transformers' Qwen3_5GatedDeltaNet) reads x (B, T, hidden), zeroed at padded
positions, as

    qkv = conv(in_proj_qkv(x)), SiLU          causal depthwise convolution of width K
    q, k = l2norm(q) / sqrt(dk), l2norm(k)    per key head; each serves HV / HK value heads
    beta = sigmoid(in_proj_b(x)),  g = -exp(A_log) softplus(in_proj_a(x) + dt_bias)
    S_t = exp(g_t) S_{t-1};  S_t += beta_t k_t (v_t - S_t^T k_t)^T;  o_t = S_t^T q_t
    y = out_proj(norm(o, z = in_proj_z(x)))   RMSNorm of o gated by SiLU(z)

so everything a later token needs of the earlier ones is S (B, HV, dk, dv, fp32 as
transformers keeps it) and the convolution's last K - 1 inputs (B, conv_dim, K - 1, the
model's dtype): a few MB per row and layer whatever the length, held in ``DeltaNetStates``
beside the KV cache (which keeps the attention layers only).  A prefill runs the chunked
delta rule over the prompt (slothkit_kernels.delta_rule: its kernel where Triton runs, its
per-token reference otherwise) from a zero state and leaves the final state and the
prompt's last K - 1 convolution inputs; a one-token step updates both in place, so a
captured CUDA graph replays it.  Left padding enters as zeros, as in Hugging Face's
forward: with no bias in the projections and the convolution, a padded position's k and v
are zero and the state it leaves is the zero state it found.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from slothkit.inference.decode_projections import SharedInputProjections
from slothkit_kernels.delta_rule import gated_delta_rule
from slothkit_kernels.delta_rule.reference import l2norm


def linear_attention_of(layer: nn.Module) -> nn.Module | None:
    """The decoder layer's gated DeltaNet module, or None for an attention layer."""
    return getattr(layer, "linear_attn", None)


class DeltaNetStates:
    """Each gated DeltaNet layer's recurrent state and convolution inputs for ``batch``
    rows, at fixed addresses (sized by the rows only: a growing KV cache hands them over).

    Args:
        modules: the model's gated DeltaNet modules, in layer order.
        batch: rows.
        dtype: the convolution inputs' dtype (the model's compute dtype).
        device: where the model runs.
    """

    def __init__(self, modules: list[nn.Module], batch: int, dtype, device):
        self.recurrent = [
            torch.zeros(batch, m.num_v_heads, m.head_k_dim, m.head_v_dim, dtype=torch.float32, device=device)
            for m in modules
        ]
        self.conv = [
            torch.zeros(batch, m.conv_dim, m.conv_kernel_size - 1, dtype=dtype, device=device)
            for m in modules
        ]
        self.batch = batch

    def tensors(self) -> list[torch.Tensor]:
        return [*self.recurrent, *self.conv]

    @property
    def nbytes(self) -> int:
        return sum(tensor.numel() * tensor.element_size() for tensor in self.tensors())


def recurrent_step(state, query, key, value, g, beta) -> torch.Tensor:
    """One token of the gated delta rule, ``state`` (B, HV, dk, dv) fp32 updated in place;
    query and key (B, HK, dk) prepared (l2-normalised, query scaled), value (B, HV, dv),
    g and beta (B, HV).  Returns o (B, HV, dv) in fp32.  The products with the state are
    batched matmuls and the update one in-place ``baddbmm_``: no temporary of the state's
    size (Qwen3.5-9B: 2 MB a row and layer)."""
    batch, heads, k_dim, v_dim = state.shape
    group = heads // key.shape[1]
    query = query.repeat_interleave(group, dim=1).reshape(batch * heads, 1, k_dim)
    key = key.repeat_interleave(group, dim=1).reshape(batch * heads, 1, k_dim)
    flat = state.view(batch * heads, k_dim, v_dim)
    flat.mul_(g.exp().reshape(-1, 1, 1))
    predicted = torch.bmm(key, flat)  # k^T S: (B HV, 1, dv)
    delta = (value.reshape(-1, 1, v_dim) - predicted) * beta.reshape(-1, 1, 1)
    flat.baddbmm_(key.transpose(1, 2), delta)  # S += k delta^T
    return torch.bmm(query, flat).view(batch, heads, v_dim)


class DecodeDeltaNet:
    """One gated DeltaNet layer as a decode step runs it (module docstring).

    Args:
        module: transformers' gated DeltaNet module (LoRA-wrapped projections or not).
        dtype: the dtype the step computes in.
        index: its place among the model's gated DeltaNet layers (in DeltaNetStates).
    """

    def __init__(self, module: nn.Module, dtype: torch.dtype, index: int):
        self.module, self.index = module, index
        self.inputs = SharedInputProjections(
            [module.in_proj_qkv, module.in_proj_z, module.in_proj_b, module.in_proj_a], dtype
        )
        self.out = SharedInputProjections([module.out_proj], dtype)
        self.activation = ACT2FN[module.activation]
        self.split = (module.key_dim, module.key_dim, module.value_dim)

    def refresh(self) -> None:
        self.inputs.refresh()
        self.out.refresh()

    def _convolve(self, mixed: torch.Tensor, conv_state: torch.Tensor) -> torch.Tensor:
        """The causal depthwise convolution of ``mixed`` (B, C, T) continuing from
        ``conv_state`` (B, C, K - 1), which then holds the last K - 1 inputs; (B, C, T)."""
        conv = self.module.conv1d
        weight, width = conv.weight, conv_state.shape[-1]  # (C, 1, K)
        tokens = mixed.shape[-1]
        if tokens == 1:  # the state's K - 1 inputs and this one: one output
            window = torch.cat((conv_state, mixed.to(conv_state.dtype)), dim=-1)
            conv_state.copy_(window[:, :, 1:])
            out = F.conv1d(window.to(weight.dtype), weight, conv.bias, groups=weight.shape[0])
        else:  # a prefill from no state: zeros before the first input
            kept = F.pad(mixed, (max(0, width - tokens), 0))[:, :, -width:] if width else mixed[:, :, :0]
            conv_state.copy_(kept)
            out = F.conv1d(mixed.to(weight.dtype), weight, conv.bias, padding=width, groups=weight.shape[0])
            out = out[:, :, :tokens]
        return self.activation(out).to(mixed.dtype)

    def __call__(self, x: torch.Tensor, states: DeltaNetStates, real: torch.Tensor | None) -> torch.Tensor:
        """The layer's output for ``x`` (B, T, hidden), its states carried on; ``real``
        (B, T) marks the positions that are not padding (None: all are)."""
        module = self.module
        if real is not None:
            x = (x * real[:, :, None]).to(x.dtype)
        batch, tokens, _ = x.shape
        mixed, z, b, a = self.inputs(x)
        mixed = self._convolve(mixed.transpose(1, 2), states.conv[self.index]).transpose(1, 2)
        query, key, value = torch.split(mixed, self.split, dim=-1)
        query = query.reshape(batch, tokens, -1, module.head_k_dim)  # (B, T, HK, dk)
        key = key.reshape(batch, tokens, -1, module.head_k_dim)
        value = value.reshape(batch, tokens, -1, module.head_v_dim)  # (B, T, HV, dv)
        beta = b.sigmoid()  # (B, T, HV)
        g = -module.A_log.float().exp() * F.softplus(a.float() + module.dt_bias)
        state = states.recurrent[self.index]
        if tokens == 1:
            query, key = l2norm(query[:, 0].float()), l2norm(key[:, 0].float())
            query = query / query.shape[-1] ** 0.5  # as transformers' step divides
            out = recurrent_step(state, query, key, value[:, 0].float(), g[:, 0], beta[:, 0].float())
            out = out[:, None].to(x.dtype)  # (B, 1, HV, dv)
        else:
            out, final = gated_delta_rule(
                query, key, value, g, beta, output_final_state=True, use_qk_l2norm_in_kernel=True
            )
            state.copy_(final)
        out = module.norm(out.reshape(-1, module.head_v_dim), z.reshape(-1, module.head_v_dim))
        return self.out(out.reshape(batch, tokens, -1))[0]
