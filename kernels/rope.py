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

Rounding mirrors transformers' eager code: cos and sin are rounded to q's dtype
(LlamaRotaryEmbedding returns them in the activations' dtype), and each product
is rounded to q's dtype before the sum, which is rounded again; all arithmetic
is fp32.  With the same cos/sin this should reproduce apply_rotary_pos_emb bit for
bit on the GPU in fp16/bf16 (a CUDA test checks it); in fp32 the compiler may fuse
a product and the sum into one FMA (a difference of about one ulp).  The Triton
interpreter truncates fp32 -> bf16 instead of rounding, so on the CPU bf16
results may differ from transformers' by an ulp or two.

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
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slothkit_kernels.utils import (
    check_float_dtype,
    check_not_empty,
    check_same_device,
    use_triton,
    warn_reference_once,
)

# Most elements of one half-head tile (heads x D/2) a program holds at a time:
# 1024 fp32 values per operand = 8 per thread at 4 warps.
MAX_TILE = 1024
NUM_WARPS = 4


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


@triton.jit
def _rotate_heads(
    X_IN,  # pointer to this token's head 0 in the tensor read
    X_OUT,  # pointer to this token's head 0 in the tensor written (may equal X_IN)
    in_stride_h,  # elements between heads of X_IN
    out_stride_h,  # elements between heads of X_OUT
    n_heads,  # heads of this token to rotate (0: none)
    cos1,  # (BLOCK_HALF,) fp32, multiplies x1 in out1
    cos2,  # (BLOCK_HALF,) fp32, multiplies x2 in out2
    sin_a,  # (BLOCK_HALF,) fp32, multiplies x2 in out1
    sin_b,  # (BLOCK_HALF,) fp32, multiplies x1 in out2
    HALF_DIM: tl.constexpr,  # D / 2
    BLOCK_H: tl.constexpr,  # heads per tile, a power of two
    BLOCK_HALF: tl.constexpr,  # power of two >= D / 2
):
    dtype = X_OUT.dtype.element_ty
    offs_d = tl.arange(0, BLOCK_HALF)
    d_mask = offs_d < HALF_DIM
    for h0 in range(0, n_heads, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        mask = (offs_h < n_heads)[:, None] & d_mask[None, :]
        heads = offs_h.to(tl.int64)[:, None]
        src = X_IN + heads * in_stride_h + offs_d[None, :]
        dst = X_OUT + heads * out_stride_h + offs_d[None, :]
        x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF_DIM, mask=mask, other=0.0).to(tl.float32)
        # Each product is rounded to the storage dtype, as in the eager torch code.
        out1 = (x1 * cos1[None, :]).to(dtype).to(tl.float32) + (x2 * sin_a[None, :]).to(dtype).to(tl.float32)
        out2 = (x2 * cos2[None, :]).to(dtype).to(tl.float32) + (x1 * sin_b[None, :]).to(dtype).to(tl.float32)
        tl.store(dst, out1.to(dtype), mask=mask)
        tl.store(dst + HALF_DIM, out2.to(dtype), mask=mask)


@triton.jit
def _rope_kernel(
    Q_IN,  # pointer to q (or dL/dq) read, (B, Hq, T, D), last dim contiguous
    Q_OUT,  # pointer to the rotated q written (Q_IN for the in-place forward)
    K_IN,  # pointer to k (or dL/dk) read, (B, Hk, T, D), last dim contiguous
    K_OUT,  # pointer to the rotated k written (K_IN for the in-place forward)
    COS,  # pointer to cos, (Bc, T, D) gathered, or a (max_positions, D) table; contiguous
    SIN,  # pointer to sin, same shape and strides as COS
    POS,  # pointer to position_ids (B or 1, T) ints (unused unless HAS_POSITIONS)
    q_in_stride_b,
    q_in_stride_h,
    q_in_stride_t,  # strides of Q_IN (elements)
    q_out_stride_b,
    q_out_stride_h,
    q_out_stride_t,  # strides of Q_OUT
    k_in_stride_b,
    k_in_stride_h,
    k_in_stride_t,  # strides of K_IN
    k_out_stride_b,
    k_out_stride_h,
    k_out_stride_t,  # strides of K_OUT
    cos_stride_b,  # elements between batch rows of COS (0 when shared; unused with positions)
    cos_stride_t,  # elements between token rows of COS (table rows with positions)
    pos_stride_b,  # elements between batch rows of POS (0 when shared)
    pos_stride_t,  # elements between tokens of POS
    seq_len,  # T
    n_q_heads,  # Hq
    n_k_heads,  # Hk (0: no second tensor)
    HALF_DIM: tl.constexpr,  # D / 2
    HAS_POSITIONS: tl.constexpr,  # COS/SIN are a table indexed by POS
    INVERSE: tl.constexpr,  # apply the transpose (backward) instead of the rotation
    BLOCK_H: tl.constexpr,  # heads per tile, a power of two
    BLOCK_HALF: tl.constexpr,  # power of two >= D / 2
):
    # One program per token (b, t): its cos/sin row is loaded once for all heads.
    pid = tl.program_id(0).to(tl.int64)
    b = pid // seq_len
    t = pid % seq_len
    if HAS_POSITIONS:
        cs_row = tl.load(POS + b * pos_stride_b + t * pos_stride_t).to(tl.int64) * cos_stride_t
    else:
        cs_row = b * cos_stride_b + t * cos_stride_t

    dtype = Q_OUT.dtype.element_ty
    offs_d = tl.arange(0, BLOCK_HALF)
    d_mask = offs_d < HALF_DIM
    # cos and sin are rounded to q's dtype first, as transformers hands them over.
    cos1 = tl.load(COS + cs_row + offs_d, mask=d_mask, other=0.0).to(dtype).to(tl.float32)
    cos2 = tl.load(COS + cs_row + HALF_DIM + offs_d, mask=d_mask, other=0.0).to(dtype).to(tl.float32)
    sin1 = tl.load(SIN + cs_row + offs_d, mask=d_mask, other=0.0).to(dtype).to(tl.float32)
    sin2 = tl.load(SIN + cs_row + HALF_DIM + offs_d, mask=d_mask, other=0.0).to(dtype).to(tl.float32)
    if INVERSE:  # dx1 = g1 c1 + g2 s2,  dx2 = g2 c2 - g1 s1
        sin_a = sin2
        sin_b = -sin1
    else:  # out1 = x1 c1 - x2 s1,  out2 = x2 c2 + x1 s2
        sin_a = -sin1
        sin_b = sin2

    _rotate_heads(
        Q_IN + b * q_in_stride_b + t * q_in_stride_t,
        Q_OUT + b * q_out_stride_b + t * q_out_stride_t,
        q_in_stride_h,
        q_out_stride_h,
        n_q_heads,
        cos1,
        cos2,
        sin_a,
        sin_b,
        HALF_DIM,
        BLOCK_H,
        BLOCK_HALF,
    )
    _rotate_heads(
        K_IN + b * k_in_stride_b + t * k_in_stride_t,
        K_OUT + b * k_out_stride_b + t * k_out_stride_t,
        k_in_stride_h,
        k_out_stride_h,
        n_k_heads,
        cos1,
        cos2,
        sin_a,
        sin_b,
        HALF_DIM,
        BLOCK_H,
        BLOCK_HALF,
    )


def _launch(q_in, q_out, k_in, k_out, cos, sin, position_ids, inverse: bool) -> None:
    """Rotate q_in into q_out and k_in into k_out (k_in=None: q only) in one launch."""
    batch, n_q_heads, seq_len, head_dim = q_in.shape
    if k_in is None:
        k_in, k_out, n_k_heads = q_in, q_out, 0
    else:
        n_k_heads = k_in.shape[1]
    block_half = triton.next_power_of_2(head_dim // 2)
    block_h = min(triton.next_power_of_2(max(n_q_heads, n_k_heads)), max(1, MAX_TILE // block_half))
    if position_ids is None:  # cos: (Bc, T, D), contiguous
        cos_stride_b = 0 if cos.shape[0] == 1 else cos.stride(0)
        cos_stride_t = cos.stride(1)
        pos, pos_stride_b, pos_stride_t = cos, 0, 0  # placeholder, never read
    else:  # cos: (max_positions, D) table, contiguous
        cos_stride_b, cos_stride_t = 0, cos.stride(0)
        pos = position_ids
        pos_stride_b = 0 if pos.shape[0] == 1 else pos.stride(0)
        pos_stride_t = pos.stride(1)
    _rope_kernel[(batch * seq_len,)](
        q_in,
        q_out,
        k_in,
        k_out,
        cos,
        sin,
        pos,
        q_in.stride(0),
        q_in.stride(1),
        q_in.stride(2),
        q_out.stride(0),
        q_out.stride(1),
        q_out.stride(2),
        k_in.stride(0),
        k_in.stride(1),
        k_in.stride(2),
        k_out.stride(0),
        k_out.stride(1),
        k_out.stride(2),
        cos_stride_b,
        cos_stride_t,
        pos_stride_b,
        pos_stride_t,
        seq_len,
        n_q_heads,
        n_k_heads,
        HALF_DIM=head_dim // 2,
        HAS_POSITIONS=position_ids is not None,
        INVERSE=inverse,
        BLOCK_H=block_h,
        BLOCK_HALF=block_half,
        num_warps=NUM_WARPS,
    )


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


def _check_rotatable(name: str, x: torch.Tensor) -> None:
    if x.dim() != 4:
        raise ValueError(f"rope: {name} has shape {tuple(x.shape)}; expected (B, heads, T, D)")
    check_float_dtype(f"rope: {name}", x)
    check_not_empty(f"rope: {name}", x)
    if x.stride(-1) != 1:
        raise ValueError(
            f"rope: {name} has stride {x.stride(-1)} along its last dimension (head_dim); "
            f"rope writes in place and needs it contiguous (stride 1); call .contiguous() first"
        )
    if any(stride == 0 and size > 1 for size, stride in zip(x.shape, x.stride())):
        raise ValueError(
            f"rope: {name} has a stride of 0 (shape {tuple(x.shape)}, strides {x.stride()}), "
            f"so its elements share memory and cannot be rotated in place; pass a copy"
        )
    if torch.is_grad_enabled() and x.requires_grad and x.is_leaf:
        raise ValueError(
            f"rope: {name} is a leaf tensor that requires grad; rope rotates in place, which "
            f"autograd forbids on leaves; pass a non-leaf such as {name}.clone()"
        )


def _normalise_tables(q, k, cos, sin, position_ids):
    """Check shapes and return (cos, sin, position_ids) in the kernel's layout:
    gathered (Bc, T, D) or a (max_positions, D) table, contiguous."""
    batch, _, seq_len, head_dim = q.shape
    for name, t in (("cos", cos), ("sin", sin)):
        check_float_dtype(f"rope: {name}", t)
        if t.requires_grad:
            raise ValueError(
                f"rope: {name} requires grad, but rope does not differentiate with respect to "
                f"cos/sin; pass {name}.detach()"
            )
    if cos.shape != sin.shape:
        raise ValueError(
            f"rope: cos has shape {tuple(cos.shape)} but sin has {tuple(sin.shape)}; they must match"
        )
    if cos.shape[-1] != head_dim:
        raise ValueError(
            f"rope: cos/sin have last dimension {cos.shape[-1]} but q and k have head_dim "
            f"{head_dim}; they must match"
        )

    if position_ids is None:
        if cos.dim() == 2:  # (T, D)
            cos, sin = cos[None], sin[None]
        if cos.dim() != 3:
            raise ValueError(
                f"rope: cos/sin have shape {tuple(cos.shape)}; without position_ids expected "
                f"(B, T, D), (1, T, D) or (T, D) with B={batch}, T={seq_len}, D={head_dim}"
            )
        if cos.shape[1] != seq_len:
            raise ValueError(f"rope: cos/sin cover {cos.shape[1]} tokens but q and k have T={seq_len}")
        if cos.shape[0] not in (1, batch):
            raise ValueError(
                f"rope: cos/sin have batch size {cos.shape[0]} but q and k have B={batch}; "
                f"expected {batch} or 1"
            )
        if cos.shape[0] > 1 and cos.stride(0) == 0 and sin.stride(0) == 0:
            cos, sin = cos[:1], sin[:1]  # an expanded (1, T, D): read it once per batch row
        return cos.contiguous(), sin.contiguous(), None

    if cos.dim() != 2:
        raise ValueError(
            f"rope: with position_ids, cos/sin must be a (max_positions, D) table; "
            f"got shape {tuple(cos.shape)}"
        )
    if (
        position_ids.dtype.is_floating_point
        or position_ids.dtype.is_complex
        or (position_ids.dtype == torch.bool)
    ):
        raise TypeError(f"rope: position_ids has dtype {position_ids.dtype}; expected an integer dtype")
    if (
        position_ids.dim() != 2
        or position_ids.shape[1] != seq_len
        or (position_ids.shape[0] not in (1, batch))
    ):
        raise ValueError(
            f"rope: position_ids has shape {tuple(position_ids.shape)}; expected "
            f"({batch}, {seq_len}) or (1, {seq_len})"
        )
    return cos.contiguous(), sin.contiguous(), position_ids


def _check_positions_in_table(position_ids: torch.Tensor, n_positions: int) -> None:
    low, high = torch.stack(torch.aminmax(position_ids)).tolist()  # one device sync
    if low < 0 or high >= n_positions:
        raise ValueError(
            f"rope: position_ids range over [{low}, {high}] but the cos/sin table has "
            f"{n_positions} rows (valid positions 0..{n_positions - 1})"
        )


def _checked_tables(q, k, cos, sin, position_ids, check_positions: bool):
    """Check that q and k can be rotated together with these tables, and return the
    tables in the kernel's layout (shared by ``rope`` and ``rotate``)."""
    check_same_device(q=q, k=k, cos=cos, sin=sin, position_ids=position_ids)
    if k.dtype != q.dtype:
        raise TypeError(f"rope: k has dtype {k.dtype} but q has {q.dtype}; they must match")
    if k.shape[0] != q.shape[0] or k.shape[2:] != q.shape[2:]:
        raise ValueError(
            f"rope: q has shape {tuple(q.shape)} and k {tuple(k.shape)}; batch, tokens and "
            f"head_dim must match (B, heads, T, D)"
        )
    if q.shape[-1] % 2:
        raise ValueError(f"rope: head_dim {q.shape[-1]} is odd; rotate_half needs an even head_dim")
    if q.data_ptr() == k.data_ptr():
        raise ValueError("rope: q and k are the same memory; it would be rotated twice")
    cos, sin, position_ids = _normalise_tables(q, k, cos, sin, position_ids)
    if position_ids is not None and check_positions:
        _check_positions_in_table(position_ids, cos.shape[0])
    return cos, sin, position_ids


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
