"""RoPE's Triton kernel and its launch: one program per token rotates all of that
token's q and k heads, by the rotation or, with INVERSE, by its transpose (what
``rope``'s backward applies; ops.py derives both).

Rounding mirrors transformers' eager code: cos and sin are rounded to q's dtype
(LlamaRotaryEmbedding returns them in the activations' dtype), and each product
is rounded to q's dtype before the sum, which is rounded again; all arithmetic
is fp32.  With the same cos/sin this should reproduce apply_rotary_pos_emb bit for
bit on the GPU in fp16/bf16 (a CUDA test checks it); in fp32 the compiler may fuse
a product and the sum into one FMA (a difference of about one ulp).  The Triton
interpreter truncates fp32 -> bf16 instead of rounding, so on the CPU bf16
results may differ from transformers' by an ulp or two.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Most elements of one half-head tile (heads x D/2) a program holds at a time:
# 1024 fp32 values per operand = 8 per thread at 4 warps.
MAX_TILE = 1024
NUM_WARPS = 4


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
def _rotation_coefficients(
    COS_ROW,  # pointer to this token's cos row (D values)
    SIN_ROW,  # pointer to this token's sin row
    dtype: tl.constexpr,  # the rotated tensor's dtype: cos and sin are rounded to it first
    HALF_DIM: tl.constexpr,  # D / 2
    INVERSE: tl.constexpr,  # the transpose's coefficients (backward) instead of the rotation's
    BLOCK_HALF: tl.constexpr,  # power of two >= D / 2
):
    """(cos1, cos2, sin_a, sin_b) of _rotate_heads, fp32, (BLOCK_HALF,) each."""
    offs_d = tl.arange(0, BLOCK_HALF)
    d_mask = offs_d < HALF_DIM
    # cos and sin are rounded to q's dtype first, as transformers hands them over.
    cos1 = tl.load(COS_ROW + offs_d, mask=d_mask, other=0.0).to(dtype).to(tl.float32)
    cos2 = tl.load(COS_ROW + HALF_DIM + offs_d, mask=d_mask, other=0.0).to(dtype).to(tl.float32)
    sin1 = tl.load(SIN_ROW + offs_d, mask=d_mask, other=0.0).to(dtype).to(tl.float32)
    sin2 = tl.load(SIN_ROW + HALF_DIM + offs_d, mask=d_mask, other=0.0).to(dtype).to(tl.float32)
    if INVERSE:  # dx1 = g1 c1 + g2 s2,  dx2 = g2 c2 - g1 s1
        sin_a = sin2
        sin_b = -sin1
    else:  # out1 = x1 c1 - x2 s1,  out2 = x2 c2 + x1 s2
        sin_a = -sin1
        sin_b = sin2
    return cos1, cos2, sin_a, sin_b


@triton.jit
def _rotate_token(
    Q_IN,  # pointer to the token's head 0 of q read
    Q_OUT,  # pointer to the token's head 0 of q written (may equal Q_IN)
    q_in_stride_h,
    q_out_stride_h,
    n_q_heads,
    K_IN,  # the same for k (n_k_heads 0: none)
    K_OUT,
    k_in_stride_h,
    k_out_stride_h,
    n_k_heads,
    COS_ROW,  # pointer to the token's cos row
    SIN_ROW,  # pointer to the token's sin row
    HALF_DIM: tl.constexpr,
    INVERSE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """One token's q and k heads rotated (or, with INVERSE, by the transpose) by its row
    of cos and sin, rounded as the module's docstring says."""
    cos1, cos2, sin_a, sin_b = _rotation_coefficients(
        COS_ROW, SIN_ROW, Q_OUT.dtype.element_ty, HALF_DIM, INVERSE, BLOCK_HALF
    )
    _rotate_heads(
        Q_IN,
        Q_OUT,
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
        K_IN,
        K_OUT,
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

    _rotate_token(
        Q_IN + b * q_in_stride_b + t * q_in_stride_t,
        Q_OUT + b * q_out_stride_b + t * q_out_stride_t,
        q_in_stride_h,
        q_out_stride_h,
        n_q_heads,
        K_IN + b * k_in_stride_b + t * k_in_stride_t,
        K_OUT + b * k_out_stride_b + t * k_out_stride_t,
        k_in_stride_h,
        k_out_stride_h,
        n_k_heads,
        COS + cs_row,
        SIN + cs_row,
        HALF_DIM,
        INVERSE,
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
