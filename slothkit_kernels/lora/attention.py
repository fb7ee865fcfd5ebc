"""The autograd Functions of LoRA projections of one shared input: the attention block's.

``_LoRAProjectionsFunction`` runs k projections of one input (k = 1 for ``lora_linear``
and ``lora_o``, 3 for ``lora_qkv``, with RoPE on q and k for ``lora_qkv_rope``);
``_KnownLoRASumFunction`` is ``lora_o_residual`` given its sum.  Their forward and
backward GEMMs are ``gemms``'.

* ``lora_qkv``: q, k, v projections of one input.  X is saved once and
  dX = sum over the three projections of the dX of each.
* ``lora_o_residual``: Y = R + X Wo'^T, the residual sum after attention.  Given
  that sum already (a checkpointed forward kept it), it returns it as it is and
  runs no GEMM; backward is still the sum's: dR = dY, dX, dA, dB as for one
  projection, with X A^T recomputed there (N x r, cheap) for dB.
"""

from __future__ import annotations

import torch

from slothkit_kernels.lora.gemms import (
    _adapter_backward,
    _adapter_needs,
    _input_gradient,
    _load_projections,
    _projection_forward,
    _save_projections,
)
from slothkit_kernels.lora.projection import _N_FIELDS, LoRAProjection
from slothkit_kernels.rope.ops import rotate


def _heads(y: torch.Tensor, head_dim: int) -> torch.Tensor:
    """(B, T, heads * D) -> the (B, heads, T, D) view RoPE rotates."""
    return y.view(*y.shape[:-1], -1, head_dim).transpose(1, 2)


class _LoRAProjectionsFunction(torch.autograd.Function):
    """k projections of one shared input (k = 1 for lora_linear, 3 for lora_qkv).

    apply(x, rotary, *fields of projection 1, ..., *fields of projection k).
    rotary: None, or (cos, sin, position_ids, head_dim) to rotate the first two outputs
    (q and k) in place before returning them; backward applies the transpose rotation to
    their gradients first. Doing it here rather than through ``rope`` on views of the
    outputs spares autograd's bookkeeping for a view modified in place (a clone, a zero
    fill and a copy of each gradient) and rotates both gradients in one launch.
    """

    @staticmethod
    def forward(ctx, x, rotary, *flat):
        projs = [LoRAProjection(*flat[i : i + _N_FIELDS]) for i in range(0, len(flat), _N_FIELDS)]
        x2d = x.reshape(-1, x.shape[-1])  # (N, in)
        outs, products = [], []
        with torch.autocast(x.device.type, enabled=False):
            for p in projs:
                y, xa = _projection_forward(x2d, p, lead_shape=x.shape[:-1])
                outs.append(y)
                products.append(xa)
            if rotary is not None:
                cos, sin, position_ids, head_dim = rotary
                rotate(_heads(outs[0], head_dim), _heads(outs[1], head_dim), cos, sin, position_ids)
        _save_projections(ctx, x, projs, products)
        ctx.rotary = rotary  # cos/sin are inputs that get no gradient: safe to keep on ctx
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        x, *saved = ctx.saved_tensors
        need_x = ctx.needs_input_grad[0]
        x2d = x.reshape(-1, x.shape[-1])
        dx = None
        adapter_grads, terms, adapter_terms = [], [], []
        with torch.autocast(x.device.type, enabled=False):
            if ctx.rotary is not None:
                grads = _unrotate_gradients(grads, ctx.rotary, x.dtype)
            for i, ((proj, xa), dy) in enumerate(zip(_load_projections(ctx, saved), grads)):
                need_a, need_b = _adapter_needs(ctx, 2, i)  # fields start after x, rotary
                dy = dy.reshape(-1, dy.shape[-1]).to(x.dtype)  # (N, out_i)
                dyb_s, d_a, d_b = _adapter_backward(dy, xa, x2d, proj, need_x, need_a, need_b)
                adapter_grads += [None, d_a, d_b, None, None]
                terms.append((dy, proj))
                if dyb_s is not None and need_x:
                    adapter_terms.append((dyb_s, proj.lora_a))
            if need_x:
                dx = _input_gradient(terms, adapter_terms)
        if dx is not None:
            dx = dx.view(x.shape)
        return (dx, None, *adapter_grads)


def _unrotate_gradients(grads, rotary, dtype):
    """dL/d(q, k before RoPE) = R^T dL/d(q, k after), written to new buffers (autograd may
    share an incoming gradient with other consumers); v's gradient passes through.
    Autograd hands unused outputs' gradients over as zeros (materialised), never None."""
    cos, sin, position_ids, head_dim = rotary
    dq, dk = (g.to(dtype) if g.stride(-1) == 1 else g.to(dtype).contiguous() for g in grads[:2])
    dq_pre, dk_pre = (
        torch.empty_like(dq, memory_format=torch.contiguous_format),
        torch.empty_like(dk, memory_format=torch.contiguous_format),
    )
    rotate(
        _heads(dq, head_dim),
        _heads(dk, head_dim),
        cos,
        sin,
        position_ids,
        inverse=True,
        q_out=_heads(dq_pre, head_dim),
        k_out=_heads(dk_pre, head_dim),
        check_positions=False,
    )
    return (dq_pre, dk_pre, *grads[2:])


class _KnownLoRASumFunction(torch.autograd.Function):
    """apply(known, residual, x, *projection fields): returns ``known``, which must equal
    residual + x W'^T; backward is that sum's."""

    @staticmethod
    def forward(ctx, known, residual, x, *fields):
        _save_projections(ctx, x, [LoRAProjection(*fields)], [None])
        return known.view_as(known)

    @staticmethod
    def backward(ctx, dy):
        x, *saved = ctx.saved_tensors
        ((proj, _),) = _load_projections(ctx, saved)
        need_residual, need_x = ctx.needs_input_grad[1:3]
        need_a, need_b = _adapter_needs(ctx, 3, 0)  # fields start after known, residual, x
        x2d = x.reshape(-1, x.shape[-1])
        dx = d_a = d_b = None
        with torch.autocast(x.device.type, enabled=False):
            dy2d = dy.reshape(-1, dy.shape[-1]).to(x.dtype)  # (N, out)
            xa = None
            if proj.lora_a is not None and need_b:
                xa = x2d @ proj.lora_a.t()  # (N, r): not saved, since no forward GEMM ran
            dyb_s, d_a, d_b = _adapter_backward(dy2d, xa, x2d, proj, need_x, need_a, need_b)
            if need_x:
                adapter_terms = [(dyb_s, proj.lora_a)] if dyb_s is not None else []
                dx = _input_gradient([(dy2d, proj)], adapter_terms).view(x.shape)
        return (None, dy if need_residual else None, dx, None, d_a, d_b, None, None)
