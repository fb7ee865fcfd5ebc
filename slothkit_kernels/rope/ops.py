"""RoPE: rotary position embedding of queries and keys, in place, in one launch.

Hugging Face layout and convention (rotate_half: the first half of the head
dimension pairs with the second half, not interleaved pairs)::

    q: (B, Hq, T, D)    k: (B, Hk, T, D)    Hk may be smaller than Hq (grouped-query)
    out = x * cos + rotate_half(x) * sin,   rotate_half(x) = cat(-x2, x1)

so with x = (x1, x2), cos = (c1, c2), sin = (s1, s2) split into halves of D/2:

    out1 = x1 * c1 - x2 * s1
    out2 = x2 * c2 + x1 * s2

cos/sin come either already gathered per token, as LlamaRotaryEmbedding returns
them, with shape (B, T, D), (1, T, D) or (T, D); or as a table (max_positions, D)
plus ``position_ids`` (B, T) (or (1, T)) naming each token's row, which is what
packed sequences need (positions restart inside a row).

Backward.  Per pair (i, i + D/2) the forward map is linear in x,
    [out1]   [ c1  -s1 ] [x1]
    [out2] = [ s2   c2 ] [x2],
so dL/dx is the transpose applied to g = dL/dout:
    dx1 = g1 * c1 + g2 * s2
    dx2 = g2 * c2 - g1 * s1
which for HF's tables (c1 = c2, s1 = s2) is the inverse rotation, the forward
with sin negated.  The same kernel computes both (INVERSE selects the
coefficients) and rounds the same way autograd does (each product, then the sum).
The incoming gradients are read and the results written to new buffers: autograd
may hand the same gradient tensor to several consumers, so overwriting it is not
safe in general.  cos and sin receive no gradient.

The kernel and its rounding are in ``kernel``; what q, k and the tables may be
(checked before anything is written) in ``checks``.
"""

from __future__ import annotations

import torch

from slothkit_kernels.rope.checks import _check_rotatable, _checked_tables
from slothkit_kernels.rope.kernel import _launch
from slothkit_kernels.utils import use_triton, warn_reference_once


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same rotation in plain torch, as new tensors (``rope`` writes the same
    values into q and k).  Differentiable with respect to q and k."""
    if position_ids is not None:
        cos, sin = cos[position_ids], sin[position_ids]  # (B or 1, T, D)
    cos = cos.to(q.dtype)
    sin = sin.to(q.dtype)
    if cos.dim() == 2:  # (T, D)
        cos, sin = cos[None], sin[None]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (B or 1, 1, T, D)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


class _RoPEFunction(torch.autograd.Function):
    """Autograd's record of one tensor rotated in place by ``rope``.

    ``rope`` applies this to q and to k *before* its kernel rotates both in one
    launch.  Recording first means autograd's own checks on in-place writes (a
    leaf that requires grad, a view of a multi-output op such as split) fail
    before any data has changed.  One Function per tensor, because autograd
    refuses a Function that modifies a view in place and returns two tensors,
    and q, k are views in every Hugging Face attention layer.
    """

    @staticmethod
    def forward(ctx, x, cos, sin, position_ids):
        ctx.mark_dirty(x)
        if position_ids is None:
            ctx.save_for_backward(cos, sin)
        else:
            ctx.save_for_backward(cos, sin, position_ids)
        return x

    @staticmethod
    def backward(ctx, grad):
        cos, sin, *position_ids = ctx.saved_tensors
        position_ids = position_ids[0] if position_ids else None
        if grad.stride(-1) != 1:
            grad = grad.contiguous()
        grad_x = torch.empty_like(grad)  # grad's layout when dense, else contiguous
        _launch(grad, grad_x, None, None, cos, sin, position_ids, inverse=True)
        return grad_x, None, None, None


def _record_rotation(name, x, cos, sin, position_ids):
    try:
        return _RoPEFunction.apply(x, cos, sin, position_ids)
    except RuntimeError as error:  # raised by autograd before anything is written
        raise ValueError(
            f"rope: autograd does not allow {name} to be modified in place, and rope rotates "
            f"in place; pass a tensor that may be (for example {name}.clone()).  A view "
            f"returned by a function with several outputs cannot be: return the projections "
            f"as fresh tensors, not views.  Autograd said: {error}"
        ) from error


def rope(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    *,
    check_positions: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q (B, Hq, T, D) and k (B, Hk, T, D) in place; returns (q, k).

    cos/sin: (B, T, D), (1, T, D) or (T, D) already gathered per token (position_ids
    must then be None), or a (max_positions, D) table with position_ids (B, T) or
    (1, T).  q and k may be strided views (e.g. ``view(B, T, H, D).transpose(1, 2)``)
    with a contiguous last dimension.  Differentiable with respect to q and k, which
    autograd must allow to be modified in place: not leaves that require grad, not
    outputs of split/chunk/unbind (autograd refuses those before anything is written;
    clone them first).

    check_positions: verify that position_ids index the table, which reads them back
    to the host (a device sync); callers that have checked them already may pass False.
    """
    _check_rotatable("q", q)
    _check_rotatable("k", k)
    cos, sin, position_ids = _checked_tables(q, k, cos, sin, position_ids, check_positions)

    if not use_triton(q):
        warn_reference_once("rope", q.device.type)
        q_rot, k_rot = rope_reference(q, k, cos, sin, position_ids)
        return q.copy_(q_rot), k.copy_(k_rot)

    if torch.is_grad_enabled():
        # Record first (see _RoPEFunction), then rotate both in one launch.
        if q.requires_grad:
            q = _record_rotation("q", q, cos, sin, position_ids)
        if k.requires_grad:
            try:
                k = _record_rotation("k", k, cos, sin, position_ids)
            except ValueError:
                if q.requires_grad:  # q's rotation is recorded: make its data match
                    _launch(q, q, None, None, cos, sin, position_ids, inverse=False)
                raise
    _launch(q, q, k, k, cos, sin, position_ids, inverse=False)
    for x in (q, k):
        if not (torch.is_grad_enabled() and x.requires_grad):
            torch.autograd.graph.increment_version(x)  # as any in-place torch op would
    return q, k


def rotate(
    q_in: torch.Tensor,
    k_in: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    *,
    inverse: bool = False,
    q_out: torch.Tensor | None = None,
    k_out: torch.Tensor | None = None,
    check_positions: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotation (or, with ``inverse``, its transpose: what backward applies to the
    gradients) of q_in and k_in into q_out and k_out, outside autograd, in one launch.

    For functions that fuse RoPE into their own forward and backward (such as
    ``lora_qkv_rope``); everyone else wants ``rope``, which autograd records.  Layouts
    and tables as ``rope``; the outputs default to the inputs (in place) and may be
    strided views with a contiguous last dimension. check_positions as for ``rope`` (a
    device sync; a backward whose forward checked them passes False).
    """
    q_out = q_in if q_out is None else q_out
    k_out = k_in if k_out is None else k_out
    for name, x in (("q_in", q_in), ("k_in", k_in), ("q_out", q_out), ("k_out", k_out)):
        _check_rotatable(name, x)
    if q_out.shape != q_in.shape or k_out.shape != k_in.shape:
        raise ValueError("rotate: each output must have its input's shape")
    cos, sin, position_ids = _checked_tables(q_in, k_in, cos, sin, position_ids, check_positions)
    if not use_triton(q_in):
        warn_reference_once("rope", q_in.device.type)
        if inverse:  # the transpose: dx1 = g1 c1 + g2 s2, dx2 = g2 c2 - g1 s1
            s1, s2 = sin.chunk(2, dim=-1)
            sin = -torch.cat((s2, s1), dim=-1)
        q_rot, k_rot = rope_reference(q_in, k_in, cos, sin, position_ids)
        return q_out.copy_(q_rot), k_out.copy_(k_rot)
    _launch(q_in, q_out, k_in, k_out, cos, sin, position_ids, inverse=inverse)
    return q_out, k_out
