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

Whether this beats cuBLAS's GEMV plus ``addmm_`` depends on the GPU and the shape: the
decode path times both once per shape and keeps the faster
(slothkit.inference.gemv_choice).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slothkit_kernels.utils import use_triton, warn_reference_once

MAX_ROWS = 8
# (BLOCK_N, BLOCK_K at one row, num_warps) to try per shape.  With more rows BLOCK_K is
# divided by the rows (down to 32), so that the (rows, BLOCK_N, BLOCK_K) product a
# program holds in registers stays the same size.
CANDIDATES = ((16, 256, 4), (32, 128, 4), (8, 512, 4), (64, 128, 8), (32, 256, 8))


@triton.jit
def _lora_gemv_kernel(
    X,  # (M, K), rows stride_xm apart, contiguous along K
    W,  # (N, K), rows stride_wn apart, contiguous along K
    XA,  # (M, R) the low-rank product x A^T (unused without HAS_LORA)
    B,  # (N, R) LoRA B (unused without HAS_LORA)
    BIAS,  # (N,) (unused without HAS_BIAS)
    Y,  # (M, N) output, rows stride_ym apart
    M,
    N,
    K,
    R,
    stride_xm,
    stride_wn,
    stride_xam,
    stride_bn,
    stride_ym,
    scaling,
    HAS_LORA: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    n_mask = offs_n < N
    m_mask = offs_m < M
    rows_w = W + offs_n.to(tl.int64)[:, None] * stride_wn
    rows_x = X + offs_m.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        w = tl.load(rows_w + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        x = tl.load(rows_x + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        # (M, 1, K) * (1, N, K) summed over K: every row of x against the band of W.
        acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
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


def lora_gemv_reference(x, weight, bias=None, xa=None, lora_b=None, scaling: float = 1.0) -> torch.Tensor:
    """The same in plain torch, computed in fp32 and rounded once."""
    y = x.float() @ weight.float().t()
    if xa is not None:
        y += scaling * (xa.float() @ lora_b.float().t())
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype)


def _check(x, weight, bias, xa, lora_b) -> None:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"lora_gemv: x {tuple(x.shape)} and weight {tuple(weight.shape)}; expected (M, K) and (N, K)"
        )
    if not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"lora_gemv: x has {x.shape[0]} rows; it takes 1 to {MAX_ROWS} (a decode step's)")
    if (xa is None) != (lora_b is None):
        raise ValueError("lora_gemv: give both xa and lora_b, or neither")
    if xa is not None and (
        xa.dim() != 2
        or lora_b.dim() != 2
        or xa.shape[0] != x.shape[0]
        or lora_b.shape != (weight.shape[0], xa.shape[1])
    ):
        raise ValueError(
            f"lora_gemv: xa {tuple(xa.shape)} and lora_b {tuple(lora_b.shape)}; expected "
            f"({x.shape[0]}, R) and ({weight.shape[0]}, R)"
        )
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
    block_n, block_k, warps = CANDIDATES[candidate]
    block_m = triton.next_power_of_2(rows)
    rank = 1 if xa is None else xa.shape[1]
    _lora_gemv_kernel[(triton.cdiv(n, block_n),)](
        x,
        weight,
        x if xa is None else xa,
        weight if lora_b is None else lora_b,
        weight if bias is None else bias,
        out,
        rows,
        n,
        x.shape[1],
        rank,
        x.stride(0),
        weight.stride(0),
        0 if xa is None else xa.stride(0),
        0 if lora_b is None else lora_b.stride(0),
        out.stride(0),
        float(scaling),
        HAS_LORA=xa is not None,
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=min(max(32, block_k // block_m), max(16, triton.next_power_of_2(x.shape[1]))),
        BLOCK_R=max(1, triton.next_power_of_2(rank)),
        num_warps=warps,
    )
    return out
