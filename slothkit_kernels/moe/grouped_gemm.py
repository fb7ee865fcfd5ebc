"""The grouped GEMM of an expert block with each expert's LoRA adapter fused in:

    Y[i] = X[src(i)] W_e^T + s (X[src(i)] A_e^T) B_e^T + bias_e       e = expert of row i

for every sorted row i (``routing``), with src(i) the token of row i when ``gather``
(so the first projection reads x where it lies, never a permuted copy of it), else i.
W is logically (E, N, K), A (E, R, K), B (E, N, R); each is read through its strides,
so the (in, out) storage of gpt-oss is passed as a transposed view, never copied, and
the backward product dY W_e + s (dY B_e) A_e is this same kernel on transposed views of
W and the adapter (``ExpertLoRA.transposed``).

A program owns one tile of BLOCK_M rows of one expert and BLOCK_N output columns.  Its
K loop accumulates X W_e^T and the (BLOCK_M, r) product X A_e^T side by side in fp32 from
the same loaded X tile; the epilogue adds s (X A^T) B^T, a rank-r GEMM, and the bias,
and rounds once to the output dtype.  X A^T may be stored (by the programs of the first
column block) for the backward pass, which needs it for dB.

W may be an ``NF4Experts`` record instead (4-bit experts): a run of experts at a time is
dequantised into a 16-bit buffer (``nf4_dequantize``, at most ``NF4_STAGE_BYTES``) and
the same kernel multiplies it, restricted to that run's tiles, so no 16-bit copy of all
the experts is ever held, in forward or backward (the record's ``mT`` is W^T).  Under
the interpreter a cast to bf16 truncates, as every cast to bf16 there does.

Precision: 16-bit inputs multiply on the tensor cores with fp32 accumulation, the
adapter rounded to x's dtype as the base weight is; fp32 inputs, and every input under
the interpreter, multiply in full fp32 (``input_precision="ieee"``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slothkit_kernels.moe.grouped_mm import grouped_mm_applies, grouped_mm_lora_gemm, say_triton_instead
from slothkit_kernels.moe.lora import ExpertLoRA
from slothkit_kernels.moe.nf4_dequantize import dequantize_nf4_experts
from slothkit_kernels.moe.nf4_experts import NF4Experts
from slothkit_kernels.moe.routing import ExpertRouting
from slothkit_kernels.utils import interpreter_enabled


def tile_sizes(dtype: torch.dtype) -> dict:
    """Block sizes and launch settings of the grouped kernels for x's dtype.

    16-bit: the fastest of nine (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) settings timed
    on an H100 for the whole forward and backward of moe_lora_experts (bf16, r = 16, 4096
    tokens) at a Qwen3-30B-A3B layer's shape (H 2048, I 768, 128 experts, top 8): 3.32 ms
    against 3.54 for (64, 128, 64, 4, 4), and at gpt-oss-20b's (H = I = 2880, 32 experts,
    top 4): 6.40 ms against 7.03.  A BLOCK_M of 128 wastes more of each expert's last tile.
    """
    if interpreter_enabled():
        return {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "num_warps": 4, "num_stages": 1}
    if dtype == torch.float32:
        return {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "num_warps": 4, "num_stages": 3}
    return {"BLOCK_M": 64, "BLOCK_N": 256, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3}


# The most bytes of 4-bit experts held dequantised at once by one grouped GEMM: a run of
# experts of at most this size (at least one expert) is dequantised and multiplied, then
# the next.  A launch restricted to a run has that run's tiles only, so small runs leave
# SMs idle: on an H100 (bf16, r 16, 4,096 tokens, forward and backward,
# results/kernels/h100-2026-12-06-moe-experts-nf4-runs-933096a.md) Qwen3-30B-A3B's layer
# took 9.51, 6.26, 5.46 and 4.41 ms at runs of 128, 256, 512 and 1024 MiB (3.20 with
# 16-bit experts), gpt-oss-20b's 9.30, 7.98, 7.83 and 7.66 (6.35); 1 GiB holds either's
# largest weight (805 MB; 1.06 GB in two runs) for at most 1.1-1.5 GiB more at the peak.
NF4_STAGE_BYTES = 2**30


def dot_in_fp32(dtype: torch.dtype) -> bool:
    """Whether the kernels' products run in fp32 rather than on 16-bit tensor cores."""
    return dtype == torch.float32 or interpreter_enabled()


def rank_block(rank: int) -> int:
    """The rank padded for tl.dot, whose every dimension is at least 16."""
    return max(16, triton.next_power_of_2(rank))


@triton.jit
def _grouped_lora_gemm_kernel(
    X,  # pointer to the input rows: (M, K), or (T, K) read through ROWS when GATHER
    stride_xm,  # X's row stride
    stride_xk,  # X's column stride
    ROWS,  # pointer to the row of X each sorted row reads, (M,) int32 (GATHER only)
    W,  # pointer to the base weights, logically (E, N, K): y = x W_e^T
    stride_we,  # W's expert stride
    stride_wn,  # W's stride along N (output features)
    stride_wk,  # W's stride along K (input features)
    EXPERT_FIRST,  # the first expert of this launch: W holds experts EXPERT_FIRST ..
    EXPERT_STOP,  # one past the last; tiles of other experts are left to other launches
    BIAS,  # pointer to the biases, (E, N) (HAS_BIAS only)
    stride_bias_e,  # BIAS's expert stride
    stride_bias_n,  # BIAS's feature stride
    A,  # pointer to LoRA A, logically (E, R, K) (HAS_LORA only)
    stride_ae,  # A's expert stride
    stride_ar,  # A's rank stride
    stride_ak,  # A's stride along K
    B,  # pointer to LoRA B, logically (E, N, R) (HAS_LORA only)
    stride_be,  # B's expert stride
    stride_bn,  # B's stride along N
    stride_br,  # B's rank stride
    scale,  # LoRA scale s
    Y,  # pointer to the output, (M, N), sorted rows
    stride_ym,  # Y's row stride
    stride_yn,  # Y's column stride
    XA,  # pointer where X A_e^T is written, (M, R) (STORE_XA only)
    stride_xam,  # XA's row stride
    stride_xar,  # XA's rank stride
    OFFSETS,  # pointer to (E + 1,) int32: expert e's rows are OFFSETS[e] .. OFFSETS[e+1] - 1
    TILE_EXPERT,  # pointer to (tiles,) int32: the expert of each tile, -1 for none
    TILE_ROW,  # pointer to (tiles,) int32: the first sorted row of each tile
    N,  # output features
    K,  # input features
    R,  # LoRA rank
    GATHER: tl.constexpr,  # read X's rows through ROWS
    HAS_BIAS: tl.constexpr,  # add BIAS[e]
    HAS_LORA: tl.constexpr,  # add s (X A_e^T) B_e^T
    STORE_XA: tl.constexpr,  # write X A_e^T to XA
    DOT_FP32: tl.constexpr,  # multiply in fp32 (else 16-bit tensor cores, fp32 accumulation)
    BLOCK_M: tl.constexpr,  # rows per tile (the routing's block_m)
    BLOCK_N: tl.constexpr,  # output columns per program
    BLOCK_K: tl.constexpr,  # input features per step of the K loop
    BLOCK_R: tl.constexpr,  # the rank padded to a power of two >= 16
):
    tile = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(TILE_EXPERT + tile)
    if expert < EXPERT_FIRST or expert >= EXPERT_STOP:  # no expert (-1), or another launch's
        return
    e = expert.to(tl.int64)
    row_end = tl.load(OFFSETS + expert + 1)
    offs_m = tl.load(TILE_ROW + tile) + tl.arange(0, BLOCK_M)
    m_mask = offs_m < row_end
    if GATHER:
        src = tl.load(ROWS + offs_m, mask=m_mask, other=0).to(tl.int64)
    else:
        src = offs_m.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < R

    # Tiles of X (BLOCK_M, BLOCK_K), W_e^T (BLOCK_K, BLOCK_N) and A_e^T (BLOCK_K, BLOCK_R).
    x_ptrs = X + src[:, None] * stride_xm + offs_k[None, :] * stride_xk
    w_e = e - EXPERT_FIRST
    w_ptrs = W + w_e * stride_we + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn
    a_ptrs = A + e * stride_ae + offs_k[:, None] * stride_ak + offs_r[None, :] * stride_ar
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    xa = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = (k0 + offs_k) < K
        x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if DOT_FP32:
            x = x.to(tl.float32)
            acc = tl.dot(x, w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w.to(x.dtype), acc)
        if HAS_LORA:
            a = tl.load(a_ptrs, mask=k_mask[:, None] & r_mask[None, :], other=0.0)
            if DOT_FP32:
                xa = tl.dot(x, a.to(tl.float32), xa, input_precision="ieee")
            else:
                xa = tl.dot(x, a.to(x.dtype), xa)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
        a_ptrs += BLOCK_K * stride_ak

    if HAS_LORA:
        b_ptrs = B + e * stride_be + offs_r[:, None] * stride_br + offs_n[None, :] * stride_bn
        b = tl.load(b_ptrs, mask=r_mask[:, None] & n_mask[None, :], other=0.0)  # (BLOCK_R, BLOCK_N)
        if DOT_FP32:
            acc += scale * tl.dot(xa, b.to(tl.float32), input_precision="ieee")
        else:
            # X A^T rounded to x's dtype, as a separate rank-r GEMM would store it.
            acc += scale * tl.dot(xa.to(X.dtype.element_ty), b.to(X.dtype.element_ty))
        if STORE_XA:
            if pid_n == 0:
                xa_ptrs = XA + offs_m.to(tl.int64)[:, None] * stride_xam + offs_r[None, :] * stride_xar
                tl.store(xa_ptrs, xa.to(XA.dtype.element_ty), mask=m_mask[:, None] & r_mask[None, :])
    if HAS_BIAS:
        bias = tl.load(BIAS + e * stride_bias_e + offs_n * stride_bias_n, mask=n_mask, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    y_ptrs = Y + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :] * stride_yn
    tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def grouped_lora_gemm(
    x: torch.Tensor,
    routing: ExpertRouting,
    weight: torch.Tensor | NF4Experts,
    lora: ExpertLoRA | None = None,
    bias: torch.Tensor | None = None,
    *,
    gather: bool,
    store_xa: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Y = X W_e^T + s (X A_e^T) B_e^T + bias_e per expert's sorted rows, no autograd.

    x: (T, K) read through routing.tokens when ``gather``, else (M, K) in sorted order.
    weight: logically (E, N, K), any strides, or an NF4Experts record of that logical
    shape (read transposed through ``.mT``), dequantised a run of experts at a time;
    lora: A (E, r, K), B (E, N, r); bias (E, N).
    Returns (Y (M, N) in x's dtype, X A^T (M, r) in x's dtype when ``store_xa`` and there
    is an adapter, else None).  Rows past the last expert's (ids outside [0, E)) are left
    unwritten.
    """
    m = routing.num_rows
    num_experts, n, k = weight.shape
    if grouped_mm_applies(x, n, k, lora):  # set_backend("grouped_mm") (grouped_mm.py)
        if not isinstance(weight, NF4Experts):
            return grouped_mm_lora_gemm(x, routing, weight, lora, bias, gather=gather, store_xa=store_xa)
        _, rows, cols = weight.stored_shape
        if num_experts * rows * cols * weight.dtype.itemsize <= NF4_STAGE_BYTES:
            stored = dequantize_nf4_experts(weight, 0, num_experts)
            dense = stored.mT if weight.transposed else stored
            return grouped_mm_lora_gemm(x, routing, dense, lora, bias, gather=gather, store_xa=store_xa)
        say_triton_instead(
            f"4-bit experts larger than one dequantisation run ({NF4_STAGE_BYTES / 2**30:g} GiB)"
        )
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    xa = None
    if lora is not None and store_xa:
        xa = torch.empty((m, lora.rank), dtype=x.dtype, device=x.device)
    if not isinstance(weight, NF4Experts):
        _launch(x, routing, weight, (0, num_experts), lora, bias, y, xa, gather)
        return y, xa
    _, rows, cols = weight.stored_shape
    per_run = max(1, NF4_STAGE_BYTES // (rows * cols * weight.dtype.itemsize))
    buffer = torch.empty((min(per_run, num_experts), rows, cols), dtype=weight.dtype, device=x.device)
    for first in range(0, num_experts, per_run):
        stop = min(first + per_run, num_experts)
        stored = dequantize_nf4_experts(weight, first, stop, out=buffer)
        dense = stored.mT if weight.transposed else stored
        _launch(x, routing, dense, (first, stop), lora, bias, y, xa, gather)
    return y, xa


def _launch(x, routing: ExpertRouting, weight, experts, lora, bias, y, xa, gather: bool) -> None:
    """One launch of the kernel over the tiles of ``experts`` = (first, stop), whose
    weights ``weight`` holds as (stop - first, N, K); writes their rows of y (and xa)."""
    settings = tile_sizes(x.dtype)
    block_m = settings.pop("BLOCK_M")
    if block_m != routing.block_m:
        raise ValueError(f"routing was built for tiles of {routing.block_m} rows, the kernel uses {block_m}")
    n, k = weight.shape[1:]
    rank = lora.rank if lora is not None else 1
    dummy = y  # any pointer for arguments a constexpr switch leaves unread
    a, b = (lora.A, lora.B) if lora is not None else (dummy.view(1, 1, -1), dummy.view(1, -1, 1))
    bias_t = bias if bias is not None else dummy
    bias_strides = bias.stride() if bias is not None else (0, 0)
    xa_t = xa if xa is not None else dummy
    grid = (routing.num_tiles, triton.cdiv(n, settings["BLOCK_N"]))
    _grouped_lora_gemm_kernel[grid](
        x, x.stride(0), x.stride(1),
        routing.tokens,
        weight, *weight.stride(),
        *experts,
        bias_t, *bias_strides,
        a, *a.stride(),
        b, *b.stride(),
        float(lora.scale) if lora is not None else 0.0,
        y, y.stride(0), y.stride(1),
        xa_t, xa_t.stride(0), xa_t.stride(1),
        routing.offsets, routing.tile_expert, routing.tile_row,
        n, k, rank,
        GATHER=gather,
        HAS_BIAS=bias is not None,
        HAS_LORA=lora is not None,
        STORE_XA=xa is not None,
        DOT_FP32=dot_in_fp32(x.dtype),
        BLOCK_M=block_m,
        BLOCK_R=rank_block(rank),
        **settings,
    )  # fmt: skip


def grouped_lora_gemm_reference(
    x: torch.Tensor,
    routing: ExpertRouting,
    weight: torch.Tensor | NF4Experts,
    lora: ExpertLoRA | None = None,
    bias: torch.Tensor | None = None,
    *,
    gather: bool,
) -> torch.Tensor:
    """grouped_lora_gemm's Y as a loop over experts in plain torch, in x's dtype; rows of
    no expert are zero.  An NF4Experts weight is dequantised first."""
    if isinstance(weight, NF4Experts):
        weight = weight.dequantize()
    m = routing.num_rows
    offsets = routing.offsets.tolist()
    rows = x[routing.tokens.long()] if gather else x
    y = x.new_zeros((m, weight.shape[1]))
    for e in range(routing.num_experts):
        xs = rows[offsets[e] : offsets[e + 1]]
        ys = xs @ weight[e].to(x.dtype).t()
        if lora is not None:
            ys = ys + lora.scale * (xs @ lora.A[e].to(x.dtype).t()) @ lora.B[e].to(x.dtype).t()
        if bias is not None:
            ys = ys + bias[e].to(x.dtype)
        y[offsets[e] : offsets[e + 1]] = ys
    return y
