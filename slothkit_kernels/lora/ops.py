"""LoRA-adapted projections with hand-derived backward passes: the public functions and
their plain-torch references.

Each takes its projections as ``LoRAProjection`` records (``projection``: the
record, the precision rules and the input checks).  Where the rest lives:

* ``gemms``: one projection's GEMMs, forward and backward, and the derivation;
* ``attention``: the autograd Functions of ``lora_linear``, ``lora_o``,
  ``lora_qkv``, ``lora_qkv_rope`` and ``lora_o_residual``;
* ``gated_mlp``: those of ``lora_mlp``, whole or over token chunks.

The functions here are torch matmuls and run on any device; the Triton kernels
they call (the fused activations, NF4 dequantisation) dispatch by themselves.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from slothkit_kernels.geglu import geglu_reference
from slothkit_kernels.lora.attention import _KnownLoRASumFunction, _LoRAProjectionsFunction
from slothkit_kernels.lora.gated_mlp import (
    ACTIVATIONS,
    _chunked_mlp_forward,
    _ChunkedLoRAMLPRecompute,
    _LoRAMLPFunction,
)
from slothkit_kernels.lora.projection import LoRAProjection, _base_weight, _check_projection, _prepare
from slothkit_kernels.swiglu import swiglu_reference

# ----------------------------------------------------------------------------
# References (plain torch, differentiated by autograd)
# ----------------------------------------------------------------------------


def lora_linear_reference(x: torch.Tensor, proj: LoRAProjection) -> torch.Tensor:
    """Same math as ``lora_linear`` through autograd (W of an NF4 weight dequantised)."""
    dtype = x.dtype
    y = F.linear(x, _base_weight(proj.weight, dtype), None if proj.bias is None else proj.bias.to(dtype))
    if proj.lora_a is not None:
        xa = F.linear(x, proj.lora_a.to(dtype))
        y = y + proj.scaling * F.linear(xa, proj.lora_b.to(dtype))
    return y


def lora_qkv_reference(x, q_proj, k_proj, v_proj):
    return tuple(lora_linear_reference(x, p) for p in (q_proj, k_proj, v_proj))


def lora_mlp_reference(x, gate_proj, up_proj, down_proj, activation="swiglu"):
    e = lora_linear_reference(x, gate_proj)
    g = lora_linear_reference(x, up_proj)
    if activation == "swiglu":
        h = swiglu_reference(e, g)
    else:
        h = geglu_reference(e, g, "tanh" if activation == "geglu_tanh" else "none")
    return lora_linear_reference(h, down_proj)


# ----------------------------------------------------------------------------
# Public functions
# ----------------------------------------------------------------------------


def _project(x: torch.Tensor, named: list, rotary=None) -> tuple:
    """Checked projections of one input x through _LoRAProjectionsFunction.

    named: (name, LoRAProjection) pairs; rotary as for the Function."""
    x = _prepare(x, [(name, proj, None) for name, proj in named])
    fields = [f for _, proj in named for f in proj.fields_in(x.dtype)]
    return _LoRAProjectionsFunction.apply(x, rotary, *fields)


def lora_linear(x: torch.Tensor, proj: LoRAProjection) -> torch.Tensor:
    """y = x W^T + s (x A^T) B^T (+ bias) for x of shape (..., in); y: (..., out)."""
    return _project(x, [("proj", proj)])[0]


def lora_o(x: torch.Tensor, o_proj: LoRAProjection) -> torch.Tensor:
    """The attention output projection: ``lora_linear`` under its usual name."""
    return _project(x, [("o_proj", o_proj)])[0]


def lora_o_residual(
    x: torch.Tensor,
    o_proj: LoRAProjection,
    residual: torch.Tensor,
    known_sum: torch.Tensor | None = None,
) -> torch.Tensor:
    """residual + lora_o(x, o_proj): the residual stream after attention.

    known_sum: that sum, computed before from the same x, residual and weights (the
    forward of gradient checkpointing can keep it for the recomputation).  It is then
    returned as it is and no GEMM runs; backward is the sum's all the same (gradients
    for residual, x, A and B), so a recompute that needs the sum only to go on with the
    layer spends nothing on the output projection.
    """
    if known_sum is None:
        return residual + lora_o(x, o_proj)
    x = _prepare(x, [("o_proj", o_proj, None)])
    if known_sum.shape != residual.shape or known_sum.shape[:-1] != x.shape[:-1]:
        raise ValueError(
            f"lora_o_residual: known_sum has shape {tuple(known_sum.shape)}, residual "
            f"{tuple(residual.shape)} and x {tuple(x.shape)}; the sum is shaped like the "
            f"residual, with x's leading dimensions"
        )
    return _KnownLoRASumFunction.apply(known_sum.detach(), residual, x, *o_proj.fields_in(x.dtype))


def lora_qkv(
    x: torch.Tensor, q_proj: LoRAProjection, k_proj: LoRAProjection, v_proj: LoRAProjection
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, k, v) projections of one input x (..., hidden); x is saved once."""
    return _project(x, [("q_proj", q_proj), ("k_proj", k_proj), ("v_proj", v_proj)])


def lora_qkv_rope(
    x: torch.Tensor,
    q_proj: LoRAProjection,
    k_proj: LoRAProjection,
    v_proj: LoRAProjection,
    cos: torch.Tensor,
    sin: torch.Tensor,
    head_dim: int,
    position_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``lora_qkv`` of x (B, T, hidden), then RoPE on q and k, in one autograd Function.

    Returns (q, k, v) of shapes (B, T, heads * head_dim), q and k rotated as ``rope``
    rotates their (B, heads, T, head_dim) views; cos/sin/position_ids as for ``rope``.
    Same values as ``lora_qkv`` followed by ``rope``, with less work in backward.
    """
    named = [("q_proj", q_proj), ("k_proj", k_proj), ("v_proj", v_proj)]
    if isinstance(x, torch.Tensor) and x.dim() != 3:
        raise ValueError(f"lora_qkv_rope: x must be (B, T, hidden), got shape {tuple(x.shape)}")
    for name, proj in named[:2]:
        if isinstance(proj, LoRAProjection) and proj.out_features % head_dim:
            raise ValueError(
                f"lora_qkv_rope: {name} has out_features={proj.out_features}, not a multiple "
                f"of head_dim={head_dim}"
            )
    rotary = (cos.detach(), sin.detach(), position_ids, head_dim)
    return _project(x, named, rotary)


def lora_mlp(
    x: torch.Tensor,
    gate_proj: LoRAProjection,
    up_proj: LoRAProjection,
    down_proj: LoRAProjection,
    activation: str = "swiglu",
    backward_only: bool = False,
    token_chunk: int | None = None,
) -> torch.Tensor:
    """down(act(gate(x)) * up(x)) with LoRA on each projection; x: (..., hidden).

    activation: "swiglu" (silu, Llama), "geglu_tanh" (tanh GELU, Gemma) or
    "geglu" (exact erf GELU).

    backward_only=True is for the recomputation of gradient checkpointing, where the
    forward runs again only to rebuild what backward needs and its output is thrown
    away: the activation and the down projection are skipped, the returned y is zeros
    (a broadcast view of one element, not a filled buffer), and backward gives the same
    gradients as after a full forward.

    token_chunk: with more tokens than this, run without autograd or as a recompute
    (backward_only) over chunks of this many tokens, so that the (tokens, intermediate)
    tensors exist one chunk at a time (module docstring); the same values.  None
    (default): never chunked.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if token_chunk is not None and (
        isinstance(token_chunk, bool) or not isinstance(token_chunk, int) or token_chunk <= 0
    ):
        raise ValueError(f"token_chunk={token_chunk!r}; expected a positive number of tokens or None")
    x = _prepare(x, [("gate_proj", gate_proj, None), ("up_proj", up_proj, None)])
    if up_proj.out_features != gate_proj.out_features:
        raise ValueError(
            f"up_proj has out_features={up_proj.out_features} but gate_proj has "
            f"{gate_proj.out_features}; they must match"
        )
    _check_projection("down_proj", down_proj, gate_proj.out_features, x, x.dtype)
    flat = (*gate_proj.fields_in(x.dtype), *up_proj.fields_in(x.dtype), *down_proj.fields_in(x.dtype))
    if token_chunk is not None and x.numel() // x.shape[-1] > token_chunk:
        if not torch.is_grad_enabled():
            return _chunked_mlp_forward(x, activation, token_chunk, flat)
        if backward_only:
            return _ChunkedLoRAMLPRecompute.apply(x, activation, token_chunk, *flat)
    return _LoRAMLPFunction.apply(x, activation, bool(backward_only), *flat)
