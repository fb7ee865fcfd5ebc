"""Each (token, choice) pair's chosen expert applied to its row: a decode step's expert GEMVs.

A decode step of N tokens, each routed to top_k experts, has P = N * top_k pairs.  Pair p
multiplies row p // group of x (group = top_k for the gate/up product, whose input is the
token's hidden state; 1 for the down product, whose input is the pair's own activation)
by its expert's weight:

    y[p, n] = sum_k x[p // group, k] * W[ids[p], n, k]  (+ bias[ids[p], n])

The kernel reads W where it lies, at any strides ((E, N, K) as Qwen3-MoE stores its
experts, or a transposed view of gpt-oss's (E, K, N)), so a step reads each chosen
expert's matrix once per pair and copies nothing: the reference below gathers the P
matrices first and multiplies the copy (torch.bmm), reading each one, writing it and
reading it again, three times the bytes.  Each program owns BLOCK_N outputs of one pair
and walks K in steps of BLOCK_K, accumulating in fp32 and rounding once on store.  The
values are cast to fp32 as they are loaded (the Triton interpreter multiplies bf16
wrongly otherwise).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slothkit_kernels.utils import interpreter_enabled

# (BLOCK_N, BLOCK_K, warps) on a GPU: the fastest of five at Qwen3-30B-A3B's shapes on an
# H100, or within 0.1 us of it, for both products at batch 1 and 8 (32.4 us against 37.7
# for (16, 256, 4) at gate/up, batch 1;
# results/kernels/h100-2026-12-06-moe-decode-expert-gemv-90b14b7.md).
DEFAULT_TILES = (32, 256, 8)


@triton.jit
def _expert_gemv_kernel(
    X,  # pointer to the rows, (P // GROUP, K), contiguous along K
    stride_xm,  # X's row stride
    IDS,  # pointer to the expert of each pair, (P,) int64
    W,  # pointer to the experts' weights, element (e, n, k) at e * stride_we + n * stride_wn + k * stride_wk
    stride_we,  # W's expert stride
    stride_wn,  # W's output-feature stride
    stride_wk,  # W's input-feature stride
    BIAS,  # pointer to the experts' biases, (E, N) contiguous along N (HAS_BIAS only)
    stride_be,  # BIAS's expert stride
    Y,  # pointer to the output, (P, N), contiguous along N
    stride_ym,  # Y's row stride
    N,  # output features
    K,  # input features
    GROUP: tl.constexpr,  # pairs that read one row of X
    HAS_BIAS: tl.constexpr,  # add the expert's bias
    BLOCK_N: tl.constexpr,  # output features per program
    BLOCK_K: tl.constexpr,  # input features per step of the loop
):
    pair = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    expert = tl.load(IDS + pair).to(tl.int64)
    x_row = X + (pair // GROUP).to(tl.int64) * stride_xm
    w_rows = W + expert * stride_we + offs_n[:, None].to(tl.int64) * stride_wn  # (BLOCK_N, 1)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        offs_k = start + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(x_row + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        w = tl.load(
            w_rows + offs_k[None, :].to(tl.int64) * stride_wk,
            mask=n_mask[:, None] & k_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        acc += tl.sum(w * x[None, :], axis=1)
    if HAS_BIAS:
        acc += tl.load(BIAS + expert * stride_be + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(Y + pair.to(tl.int64) * stride_ym + offs_n, acc.to(Y.dtype.element_ty), mask=n_mask)


def _logical(weight: torch.Tensor, weights_in_out: bool) -> torch.Tensor:
    """The (E, N, K) view of the experts' weights."""
    return weight.transpose(1, 2) if weights_in_out else weight


def _check(x, ids, weight, group, bias):
    if x.dim() != 2 or ids.dim() != 1 or weight.dim() != 3:
        raise ValueError(
            f"expert_gemv: x must be (rows, K), ids (P,) and weight (E, N, K); got {tuple(x.shape)}, "
            f"{tuple(ids.shape)} and {tuple(weight.shape)}"
        )
    if ids.shape[0] != x.shape[0] * group:
        raise ValueError(
            f"expert_gemv: {ids.shape[0]} pairs for {x.shape[0]} rows of {group} pairs each; "
            f"ids must hold rows * group = {x.shape[0] * group}"
        )
    if weight.shape[2] != x.shape[1]:
        raise ValueError(f"expert_gemv: x has {x.shape[1]} features; the experts take {weight.shape[2]}")
    if bias is not None and bias.shape != weight.shape[:2]:
        raise ValueError(f"expert_gemv: bias is {tuple(bias.shape)}; expected {tuple(weight.shape[:2])}")


def expert_gemv_reference(
    x: torch.Tensor,
    ids: torch.Tensor,
    weight: torch.Tensor,
    group: int = 1,
    bias: torch.Tensor | None = None,
    weights_in_out: bool = False,
) -> torch.Tensor:
    """expert_gemv in plain torch: the P experts gathered, then one batched matmul."""
    w = _logical(weight, weights_in_out)
    _check(x, ids, w, group, bias)
    rows = x.repeat_interleave(group, dim=0)[:, None]  # (P, 1, K)
    y = torch.bmm(rows, w.index_select(0, ids).to(x.dtype).transpose(1, 2))[:, 0]  # (P, N)
    if bias is not None:
        y = y + bias.index_select(0, ids).to(x.dtype)
    return y


def expert_gemv(
    x: torch.Tensor,
    ids: torch.Tensor,
    weight: torch.Tensor,
    group: int = 1,
    bias: torch.Tensor | None = None,
    weights_in_out: bool = False,
    tiles: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """(P, N) in x's dtype: row p // group of ``x`` (rows, K) times expert ``ids[p]``'s
    weight, for the P pairs of ``ids``, reading only those experts' weights (module
    docstring).

    Args:
        x: (rows, K) inputs; each feeds ``group`` consecutive pairs.
        ids: (P,) the expert of each pair, P = rows * group, each in [0, E).
        weight: (E, N, K) the experts' weights, any strides; (E, K, N) with ``weights_in_out``.
        group: pairs per row of x (top_k for the tokens' hidden states, 1 for the pairs' own rows).
        bias: (E, N) the experts' biases, or None.
        weights_in_out: ``weight`` holds each expert as (in, out) (gpt-oss), y = x W_e.
        tiles: (BLOCK_N, BLOCK_K, warps) in place of the default (scripts/moe_decode_timing.py
            times a few).
    """
    w = _logical(weight, weights_in_out)
    _check(x, ids, w, group, bias)
    x = x.contiguous()
    ids = ids.to(torch.int64)
    experts, n, k = w.shape
    y = torch.empty((ids.shape[0], n), dtype=x.dtype, device=x.device)
    if bias is not None:
        bias = bias.contiguous()
    if tiles is not None:
        block_n, block_k, warps = tiles
    elif interpreter_enabled():
        block_n, block_k, warps = 16, 32, 1
    else:  # (32, 256) a program: 384 programs for Qwen3-30B-A3B's gate/up at one token
        block_n, block_k, warps = DEFAULT_TILES
    grid = (ids.shape[0], triton.cdiv(n, block_n))
    _expert_gemv_kernel[grid](
        x, x.stride(0),
        ids,
        w, *w.stride(),
        bias if bias is not None else y, bias.stride(0) if bias is not None else 0,
        y, y.stride(0),
        n, k,
        GROUP=group, HAS_BIAS=bias is not None,
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
    )  # fmt: skip
    return y
