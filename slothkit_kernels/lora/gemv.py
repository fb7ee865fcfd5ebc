"""A LoRA projection of a few rows, the decode step's shape, in one launch:

    y = x W^T + s (x A^T) B^T + bias          x: (M, K), M <= 8;  W: (N, K);  B: (N, R)

with ``x A^T`` given (``xa``, (M, R)): a decode step computes it once for every
projection that reads the same x (slothkit's decode projections stack their A matrices),
so what is left per projection is the base product and the adapter's second product.
Done as cuBLAS's GEMV and an ``addmm_`` that is two launches, the second reading the
output back; at M <= 8 each launch moves little and the step is a chain of several
hundred of them.  Here the adapter term is the GEMV's epilogue: each program reads a
BLOCK_N-row band of W once (the bytes that bound a decode step), accumulates every row of
x against it in fp32, then adds the band's rows of B times xa, scaled, and the bias, and
rounds once to the output dtype (cuBLAS's path rounds the base product, then the sum).

Work split.  A program owns a band of BLOCK_N rows of W and one slice of K.  FMA
candidates accumulate x * w elementwise in a (rows, BLOCK_N, BLOCK_K) fp32 tile and sum
along K once at the end, so the loop is loads and FMAs with no cross-thread reduction per
step.  Dot candidates pad x to 16 rows (masked loads: the padding reads no memory) and
multiply on the tensor cores with an fp32 accumulator, which keeps wide vector loads of W
at any row count and lets Triton pipeline them; the 16-bit products are exact in fp32, so
only the order of the additions differs from the FMA candidates.
A candidate with ``programs_per_sm`` > 0 cuts K into slices for the grid to hold that
many programs per SM (split_k.py: one launch, deterministic, a workspace kept per shape).

Whether this beats cuBLAS's GEMV plus ``addmm_`` depends on the GPU and the shape: the
decode path times both once per shape and keeps the faster
(slothkit.inference.gemv_choice).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slothkit_kernels import split_k
from slothkit_kernels.utils import interpreter_enabled, use_triton, warn_reference_once

MAX_ROWS = 8
# (BLOCK_N, BLOCK_K at one row, num_warps, programs per SM, tl.dot) to try per shape.
# Programs per SM 0 = one program per band of rows, no split of K.  FMA candidates
# (tl.dot False) divide BLOCK_K by the rows (down to 32), so that the (rows, BLOCK_N,
# BLOCK_K) tile a program accumulates in registers stays the same size; dot candidates
# pad the rows to 16 (the smallest tl.dot) and keep BLOCK_K.
CANDIDATES = (
    (16, 256, 4, 0, False),
    (32, 128, 4, 0, False),
    (8, 512, 4, 0, False),
    (64, 128, 8, 0, False),
    (32, 256, 8, 0, False),
    (16, 256, 4, 8, False),
    (8, 512, 4, 8, False),
    (32, 256, 8, 4, False),
    (16, 512, 4, 4, False),
    (16, 256, 4, 0, True),
    (32, 128, 4, 4, True),
    (16, 128, 4, 8, True),
    (64, 64, 4, 4, True),
)


@triton.jit
def epilogue(
    acc,
    offs_m,
    offs_n,
    m_mask,
    n_mask,
    pid_n,
    pid_k,
    XA,  # (M, R) the low-rank product x A^T (unused without HAS_LORA)
    B,  # (N, R) LoRA B (unused without HAS_LORA)
    BIAS,  # (N,) (unused without HAS_BIAS)
    Y,  # (M, N) output, rows stride_ym apart
    PARTIALS,  # (slices, M, N) fp32 partial sums (unused without SPLIT)
    COUNTERS,  # (bands,) int32, 0 between calls: programs of a band that have stored (SPLIT)
    M,
    N,
    R,
    slices,  # programs per band of rows
    stride_xam,
    stride_bn,
    stride_ym,
    scaling,
    SPLIT: tl.constexpr,
    HAS_LORA: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """The epilogue of lora_gemv and nf4_lora_gemv: acc (BLOCK_M, BLOCK_N) = x W^T in
    fp32 (of this program's slice of K when SPLIT: the band's last program to arrive sums
    the slices, split_k.py); add s xa B^T and the bias, round once, store."""
    last = True  # whether this program applies the epilogue
    if SPLIT:
        acc, last = split_k.combine_slices(
            acc, offs_m, offs_n, m_mask, n_mask, PARTIALS, COUNTERS, M, N, pid_n, pid_k, slices
        )
    if last:
        if HAS_LORA:
            offs_r = tl.arange(0, BLOCK_R)
            r_mask = offs_r < R
            xa = tl.load(
                XA + offs_m.to(tl.int64)[:, None] * stride_xam + offs_r[None, :],
                mask=m_mask[:, None] & r_mask[None, :],
                other=0.0,
            )
            b = tl.load(
                B + offs_n.to(tl.int64)[:, None] * stride_bn + offs_r[None, :],
                mask=n_mask[:, None] & r_mask[None, :],
                other=0.0,
            )
            acc += scaling * tl.sum(xa.to(tl.float32)[:, None, :] * b.to(tl.float32)[None, :, :], axis=2)
        if HAS_BIAS:
            acc += tl.load(BIAS + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        out = Y + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
        tl.store(out, acc.to(Y.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def band_product(
    X,
    W,  # the band's weight rows start at W + offs_n * stride_wn
    offs_m,
    offs_n,
    m_mask,
    n_mask,
    k_start,
    k_stop,
    stride_xm,
    stride_wn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """x W^T over one band of W's rows and the columns k_start..k_stop, in fp32:
    (BLOCK_M, BLOCK_N)."""
    rows_w = W + offs_n.to(tl.int64)[:, None] * stride_wn
    rows_x = X + offs_m.to(tl.int64)[:, None] * stride_xm
    if USE_DOT:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:  # x * w accumulated elementwise; summed along K once, after the loop
        acc3 = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(k_start, k_stop, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_stop
        w = tl.load(rows_w + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        x = tl.load(rows_x + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        if USE_DOT:
            if DOT_FP32:
                acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
            else:  # 16-bit products are exact in the fp32 accumulator
                acc = tl.dot(x, tl.trans(w), acc)
        else:
            acc3 += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    if not USE_DOT:
        acc = tl.sum(acc3, axis=2)
    return acc


@triton.jit
def _lora_gemv_kernel(
    X,  # (M, K), rows stride_xm apart, contiguous along K
    W,  # (N, K), rows stride_wn apart, contiguous along K
    K,
    k_per_slice,  # columns per slice of K, a multiple of BLOCK_K
    stride_xm,
    stride_wn,
    XA,  # from here on the epilogue's arguments (epilogue_arguments)
    B,
    BIAS,
    Y,
    PARTIALS,
    COUNTERS,
    M,
    N,
    R,
    slices,
    stride_xam,
    stride_bn,
    stride_ym,
    scaling,
    HAS_LORA: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    USE_DOT: tl.constexpr,  # tensor cores on rows padded to BLOCK_M = 16
    DOT_FP32: tl.constexpr,  # fp32 operands in IEEE precision (fp32 inputs; the interpreter)
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    n_mask = offs_n < N
    m_mask = offs_m < M
    k_start = pid_k * k_per_slice
    k_stop = tl.minimum(k_start + k_per_slice, K)
    acc = band_product(X, W, offs_m, offs_n, m_mask, n_mask, k_start, k_stop, stride_xm, stride_wn,
                       BLOCK_M, BLOCK_N, BLOCK_K, USE_DOT, DOT_FP32)  # fmt: skip
    epilogue(acc, offs_m, offs_n, m_mask, n_mask, pid_n, pid_k, XA, B, BIAS, Y, PARTIALS, COUNTERS, M, N, R,
             slices, stride_xam, stride_bn, stride_ym, scaling, SPLIT, HAS_LORA, HAS_BIAS, BLOCK_R)  # fmt: skip


def lora_gemv_reference(x, weight, bias=None, xa=None, lora_b=None, scaling: float = 1.0) -> torch.Tensor:
    """The same in plain torch, computed in fp32 and rounded once."""
    y = x.float() @ weight.float().t()
    if xa is not None:
        y += scaling * (xa.float() @ lora_b.float().t())
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype)


def check_low_rank(name: str, x, n: int, xa, lora_b) -> None:
    """Refuse an adapter term that does not fit x (M, K) and an output of n columns."""
    if (xa is None) != (lora_b is None):
        raise ValueError(f"{name}: give both xa and lora_b, or neither")
    if xa is not None and (
        xa.dim() != 2 or lora_b.dim() != 2 or xa.shape[0] != x.shape[0] or lora_b.shape != (n, xa.shape[1])
    ):
        raise ValueError(
            f"{name}: xa {tuple(xa.shape)} and lora_b {tuple(lora_b.shape)}; expected "
            f"({x.shape[0]}, R) and ({n}, R)"
        )


def _check(x, weight, bias, xa, lora_b) -> None:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"lora_gemv: x {tuple(x.shape)} and weight {tuple(weight.shape)}; expected (M, K) and (N, K)"
        )
    if not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"lora_gemv: x has {x.shape[0]} rows; it takes 1 to {MAX_ROWS} (a decode step's)")
    check_low_rank("lora_gemv", x, weight.shape[0], xa, lora_b)
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"lora_gemv: bias {tuple(bias.shape)}; expected ({weight.shape[0]},)")
    tensors = [t for t in (x, weight, bias, xa, lora_b) if t is not None]
    if len({t.dtype for t in tensors}) != 1:
        raise ValueError(f"lora_gemv: mixed dtypes {[t.dtype for t in tensors]}; give them in one")
    if len({t.device for t in tensors}) != 1:
        raise ValueError("lora_gemv: tensors on several devices")
    for name, t in (("x", x), ("weight", weight), ("xa", xa), ("lora_b", lora_b)):
        if t is not None and t.stride(-1) != 1:
            raise ValueError(f"lora_gemv: {name} needs a contiguous last dimension")


def launch(x, weight, bias, xa, lora_b, scaling, out, candidate: int):
    """(kernel, grid, arguments, constexprs and launch options) of a checked call: what
    ``lora_gemv`` launches, and what scripts/cuda_sass.py compiles for a GPU it does not
    have."""
    rows, n, k = x.shape[0], weight.shape[0], x.shape[1]
    _, block_n, block_k = tile(candidate, rows, k)
    programs_per_sm = CANDIDATES[candidate][3]
    bands, slices, k_per_slice, partials, counters = split_k.plan(
        x.device, rows, n, k, block_n, block_k, programs_per_sm
    )
    epilogue_args, constants = epilogue_arguments(
        x, n, bias, xa, lora_b, scaling, out, partials, counters, slices
    )
    arguments = (x, weight, k, k_per_slice, x.stride(0), weight.stride(0), *epilogue_args)
    constants.update(tile_constants(x, candidate))
    return _lora_gemv_kernel, (bands, slices), arguments, constants


def tile_constants(x: torch.Tensor, candidate: int) -> dict:
    """The tile's constexprs and launch options a candidate launches with for x (M, K):
    lora_gemv's and lora_gemv_group's."""
    block_m, block_n, block_k = tile(candidate, x.shape[0], x.shape[1])
    _, _, warps, _, use_dot = CANDIDATES[candidate]
    return dict(
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        USE_DOT=use_dot,
        DOT_FP32=x.dtype == torch.float32 or interpreter_enabled(),
        num_warps=warps,
    )


def lora_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    xa: torch.Tensor | None = None,
    lora_b: torch.Tensor | None = None,
    scaling: float = 1.0,
    *,
    out: torch.Tensor | None = None,
    candidate: int = 0,
) -> torch.Tensor:
    """``x W^T + scaling xa B^T + bias`` for x of 1 to 8 rows, in one launch.

    Args:
        x: (M, K).  weight: (N, K).  bias: (N,) or None.
        xa: (M, R), x times LoRA A transposed, or None (no adapter).  lora_b: (N, R).
        scaling: the adapter's scale (lora_alpha / r).
        out: (M, N) to write into (a row stride of its own is fine); a new tensor if None.
        candidate: which of ``CANDIDATES`` (tile sizes) to launch with.
    """
    _check(x, weight, bias, xa, lora_b)
    rows, n = x.shape[0], weight.shape[0]
    if out is None:
        out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if not use_triton(x):
        warn_reference_once("lora_gemv", x.device.type)
        return out.copy_(lora_gemv_reference(x, weight, bias, xa, lora_b, scaling))
    kernel, grid, arguments, constants = launch(x, weight, bias, xa, lora_b, scaling, out, candidate)
    kernel[grid](*arguments, **constants)
    return out


def epilogue_arguments(x, n: int, bias, xa, lora_b, scaling, out, partials, counters, slices):
    """The epilogue's launch arguments, from XA to scaling in the kernels' signatures, and
    its constexprs (HAS_LORA, HAS_BIAS, SPLIT, BLOCK_R); x stands in for absent tensors."""
    rank = 1 if xa is None else xa.shape[1]
    arguments = (
        x if xa is None else xa,
        x if lora_b is None else lora_b,
        x if bias is None else bias,
        out,
        out if partials is None else partials,
        out if counters is None else counters,
        x.shape[0],
        n,
        rank,
        slices,
        0 if xa is None else xa.stride(0),
        0 if lora_b is None else lora_b.stride(0),
        out.stride(0),
        float(scaling),
    )
    constants = dict(
        HAS_LORA=xa is not None,
        HAS_BIAS=bias is not None,
        SPLIT=partials is not None,
        BLOCK_R=max(1, triton.next_power_of_2(rank)),
    )
    return arguments, constants


def tile(candidate: int, rows: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K) a candidate launches with for ``rows`` rows and K = k."""
    block_n, block_k, _, _, use_dot = CANDIDATES[candidate]
    if use_dot:
        block_m = 16
    else:
        block_m = triton.next_power_of_2(rows)
        block_k = max(32, block_k // block_m)
    return block_m, block_n, min(block_k, max(16, triton.next_power_of_2(k)))
