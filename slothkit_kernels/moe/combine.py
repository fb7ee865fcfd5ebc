"""Back from sorted rows to tokens: out[t] = sum_j w[t, j] * Y[row(t, j)].

Each program owns one token and a block of features and adds the token's top_k rows
in fp32, in the order j = 0 .. top_k - 1, rounding once on store: deterministic, with
no atomics.  The forward pass combines the experts' outputs with the routing weights;
the backward pass combines the per-row input gradients into dx with no weights.  An
assignment to no expert (sorted row -1) adds nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slothkit_kernels.moe.routing import ExpertRouting
from slothkit_kernels.utils import interpreter_enabled


@triton.jit
def _combine_kernel(
    Y,  # pointer to the sorted rows, (M, N)
    stride_ym,  # Y's row stride
    INVERSE,  # pointer to the sorted row of each assignment t * TOP_K + j, (T * TOP_K,) int32, -1 for none
    WEIGHTS,  # pointer to the routing weights, (T, TOP_K) (WEIGHTED only)
    stride_wt,  # WEIGHTS's token stride
    stride_wk,  # WEIGHTS's stride along top_k
    OUT,  # pointer to the output, (T, N)
    stride_om,  # OUT's row stride
    N,  # features per row
    TOP_K: tl.constexpr,  # experts per token
    WEIGHTED: tl.constexpr,  # multiply each row by its routing weight
    BLOCK_N: tl.constexpr,  # features per program
):
    token = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = offs < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        row = tl.load(INVERSE + token * TOP_K + j)
        row_mask = mask & ((offs * 0 + row) >= 0)  # a vector mask; row -1: nothing
        y = tl.load(Y + tl.maximum(row, 0).to(tl.int64) * stride_ym + offs, mask=row_mask, other=0.0)
        y = y.to(tl.float32)
        if WEIGHTED:
            y *= tl.load(WEIGHTS + token.to(tl.int64) * stride_wt + j * stride_wk).to(tl.float32)
        acc += y
    tl.store(OUT + token.to(tl.int64) * stride_om + offs, acc.to(OUT.dtype.element_ty), mask=mask)


def combine_rows(
    y: torch.Tensor, routing: ExpertRouting, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """(T, N) in y's dtype: each token's top_k sorted rows of y, weighted by ``weights``
    (T, top_k) when given, summed; no autograd."""
    n = y.shape[1]
    num_tokens = routing.num_rows // routing.top_k
    out = torch.empty((num_tokens, n), dtype=y.dtype, device=y.device)
    block = min(64 if interpreter_enabled() else 1024, max(16, triton.next_power_of_2(n)))
    grid = (num_tokens, triton.cdiv(n, block))
    _combine_kernel[grid](
        y, y.stride(0),
        routing.inverse,
        weights if weights is not None else y, *(weights.stride() if weights is not None else (0, 0)),
        out, out.stride(0),
        n,
        TOP_K=routing.top_k, WEIGHTED=weights is not None, BLOCK_N=block,
    )  # fmt: skip
    return out
