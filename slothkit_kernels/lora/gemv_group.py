"""Several LoRA projections of the same few rows in one launch: a decode step's q, k and v
(or gate and up), each

    y_g = x W_g^T + s_g (x A_g^T) B_g^T + bias_g          x: (M, K), M <= 8;  W_g: (N_g, K)

with the ``x A_g^T`` given side by side in one (M, sum of ranks) tensor, as the decode
step's stacked A matrices make them.

Why one launch.  At one row a projection's GEMV is as long as its weight takes to stream,
plus a launch's fill and drain, which a small projection cannot hide: a Llama-3-8B k or
v projection (1,024 x 4,096, 8 MB in bf16) took 8.1 us on an H200 where its bytes need
about 2, while q (4,096 x 4,096) took 11.8 (docs/inference.md).  As one launch the three
are one stream of 50 MB over the whole GPU (on an H100 at one row: 22.7 us as one
launch against 31.6 apart, docs/inference.md).  Each program owns one band of BLOCK_N rows
of one projection's weight (the bands of W_0, then of W_1, ...) and one slice of K, and
runs ``lora_gemv``'s product and epilogue on it: the same tiles and split of K
(lora_gemv.CANDIDATES), so the sums are lora_gemv's, bit for bit where the split is the
same.  The groups' weights stay where they are (no concatenated copy): the kernel takes
a tuple of each per-projection pointer and size, and a program branches once on which
projection its band belongs to.

The split-K workspace spans the groups' bands as if their outputs were side by side,
each group's columns starting at its first band (padded to whole bands).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from slothkit_kernels import split_k
from slothkit_kernels.lora.gemv import (
    CANDIDATES,
    MAX_ROWS,
    band_product,
    check_low_rank,
    epilogue,
    lora_gemv_reference,
    tile,
    tile_constants,
)
from slothkit_kernels.utils import use_triton, warn_reference_once

MAX_GROUPS = 4


@triton.jit
def _lora_gemv_group_kernel(
    X,  # (M, K), rows stride_xm apart, contiguous along K
    Ws,  # per group: (N_g, K), contiguous
    K,
    k_per_slice,
    stride_xm,
    XA,  # from here on the groups' epilogue arguments (group_epilogue_arguments)
    Bs,
    BIASES,
    Ys,
    PARTIALS,
    COUNTERS,
    band_starts,
    ns,
    ranks,
    xa_columns,
    scalings,
    stride_xam,
    M,
    padded_n,
    slices,
    GROUPS: tl.constexpr,
    HAS_LORA: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    USE_DOT: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    group = 0
    for g in tl.static_range(1, GROUPS):
        group += (pid_n >= band_starts[g]).to(tl.int32)
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    k_start = pid_k * k_per_slice
    k_stop = tl.minimum(k_start + k_per_slice, K)
    for g in tl.static_range(GROUPS):
        if group == g:
            offs_n = (pid_n - band_starts[g]) * BLOCK_N + tl.arange(0, BLOCK_N)
            n_mask = offs_n < ns[g]
            acc = band_product(X, Ws[g], offs_m, offs_n, m_mask, n_mask, k_start, k_stop, stride_xm, K,
                               BLOCK_M, BLOCK_N, BLOCK_K, USE_DOT, DOT_FP32)  # fmt: skip
            # The band's partial sums sit at its columns of the side-by-side layout.
            partials = PARTIALS + band_starts[g] * BLOCK_N
            epilogue(acc, offs_m, offs_n, m_mask, n_mask, pid_n, pid_k, XA + xa_columns[g], Bs[g], BIASES[g],
                     Ys[g], partials, COUNTERS, M, padded_n, ranks[g], slices, stride_xam, ranks[g], ns[g],
                     scalings[g], SPLIT, HAS_LORA, HAS_BIAS, BLOCK_R)  # fmt: skip


def lora_gemv_group_reference(x, weights, biases=None, xa=None, lora_bs=None, scalings=None) -> list:
    """The same in plain torch, each projection computed in fp32 and rounded once."""
    terms = group_terms([w.shape[0] for w in weights], biases, xa, lora_bs, scalings)
    return [lora_gemv_reference(x, weight, *term) for weight, term in zip(weights, terms)]


def group_terms(widths, biases, xa, lora_bs, scalings) -> list[tuple]:
    """Per group: (bias, its columns of xa, lora_b, scaling)."""
    groups = len(widths)
    biases = list(biases) if biases is not None else [None] * groups
    lora_bs = list(lora_bs) if lora_bs is not None else [None] * groups
    scalings = list(scalings) if scalings is not None else [1.0] * groups
    column = 0
    terms = []
    for bias, lora_b, scaling in zip(biases, lora_bs, scalings):
        xa_g = None
        if lora_b is not None:
            xa_g = xa[:, column : column + lora_b.shape[1]]
            column += lora_b.shape[1]
        terms.append((bias, xa_g, lora_b, scaling))
    return terms


def check_group_terms(name: str, x, widths, biases, xa, lora_bs, scalings) -> None:
    """Refuse per-projection terms (biases, side-by-side xa, B's, scalings) that do not fit
    x (M, K) and outputs of ``widths`` columns."""
    groups = len(widths)
    if not 1 <= groups <= MAX_GROUPS:
        raise ValueError(f"{name}: {groups} weights; it takes 1 to {MAX_GROUPS}")
    for what, given in (("biases", biases), ("lora_bs", lora_bs), ("scalings", scalings)):
        if given is not None and len(given) != groups:
            raise ValueError(f"{name}: {len(given)} {what} for {groups} weights")
    if x.dim() != 2 or not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"{name}: x {tuple(x.shape)}; expected (M, K) with 1 to {MAX_ROWS} rows")
    if x.stride(1) != 1:
        raise ValueError(f"{name}: x needs a contiguous last dimension")
    if biases is not None and len({b is None for b in biases}) > 1:
        raise ValueError(f"{name}: give a bias for every weight, or for none")
    for width, bias in zip(widths, biases or [None] * groups):
        if bias is not None and bias.shape != (width,):
            raise ValueError(f"{name}: bias {tuple(bias.shape)}; expected ({width},)")
    rank = sum(b.shape[1] for b in lora_bs or [] if b is not None)
    if (xa is None) != (rank == 0):
        raise ValueError(f"{name}: give xa with at least one lora_b, or neither")
    if xa is not None:
        if xa.dim() != 2 or xa.shape != (x.shape[0], rank) or xa.stride(1) != 1:
            raise ValueError(
                f"{name}: xa {tuple(xa.shape)}; expected ({x.shape[0]}, {rank}), the groups' "
                "x A^T side by side, contiguous along its rows"
            )
        for width, (_, xa_g, lora_b, _) in zip(widths, group_terms(widths, biases, xa, lora_bs, scalings)):
            check_low_rank(name, x, width, xa_g, lora_b)
            if lora_b is not None and not lora_b.is_contiguous():
                raise ValueError(f"{name}: lora_b needs to be contiguous")


def _check(x, weights, biases, xa, lora_bs, scalings) -> None:
    for weight in weights:
        if weight.dim() != 2 or weight.shape[1] != x.shape[1] or not weight.is_contiguous():
            raise ValueError(
                f"lora_gemv_group: weight {tuple(weight.shape)}; expected a contiguous (N, {x.shape[1]})"
            )
    check_group_terms("lora_gemv_group", x, [w.shape[0] for w in weights], biases, xa, lora_bs, scalings)
    tensors = [
        x,
        *weights,
        *(b for b in biases or [] if b is not None),
        *(b for b in lora_bs or [] if b is not None),
    ]
    tensors += [] if xa is None else [xa]
    if len({t.dtype for t in tensors}) != 1:
        raise ValueError(f"lora_gemv_group: mixed dtypes {sorted({str(t.dtype) for t in tensors})}")
    if len({t.device for t in tensors}) != 1:
        raise ValueError("lora_gemv_group: tensors on several devices")


def bands_of(widths, block_n: int) -> tuple[list[int], int]:
    """Each group's first band of ``block_n`` rows, and the bands of all groups."""
    starts, bands = [], 0
    for width in widths:
        starts.append(bands)
        bands += triton.cdiv(width, block_n)
    return starts, bands


def group_epilogue_arguments(
    x, widths, biases, xa, lora_bs, scalings, outs, block_n: int, partials, counters, slices
):
    """The groups' epilogue arguments, from XA to slices in the group kernels' signatures,
    and their constexprs (HAS_LORA, HAS_BIAS, SPLIT, BLOCK_R); x stands in for absent
    tensors."""
    terms = group_terms(widths, biases, xa, lora_bs, scalings)
    starts, bands = bands_of(widths, block_n)
    ranks = [0 if lora_b is None else lora_b.shape[1] for _, _, lora_b, _ in terms]
    has_bias = terms[0][0] is not None
    arguments = (
        x if xa is None else xa,
        tuple(x if lora_b is None else lora_b for _, _, lora_b, _ in terms),
        tuple(bias if has_bias else x for bias, *_ in terms),
        tuple(outs),
        outs[0] if partials is None else partials,
        outs[0] if counters is None else counters,
        tuple(starts),
        tuple(widths),
        tuple(ranks),
        tuple(sum(ranks[:g]) for g in range(len(widths))),
        tuple(float(scaling) for *_, scaling in terms),
        0 if xa is None else xa.stride(0),
        x.shape[0],
        bands * block_n,
        slices,
    )
    constants = dict(
        GROUPS=len(widths),
        HAS_LORA=xa is not None,
        HAS_BIAS=has_bias,
        SPLIT=partials is not None,
        BLOCK_R=max(1, triton.next_power_of_2(max(ranks))),
    )
    return arguments, constants


def launch(x, weights, biases, xa, lora_bs, scalings, outs, candidate: int):
    """(kernel, grid, arguments, constexprs and launch options) of a checked call."""
    rows, k = x.shape
    widths = [w.shape[0] for w in weights]
    _, block_n, block_k = tile(candidate, rows, k)
    programs_per_sm = CANDIDATES[candidate][3]
    _, bands = bands_of(widths, block_n)
    _, slices, k_per_slice, partials, counters = split_k.plan(
        x.device, rows, bands * block_n, k, block_n, block_k, programs_per_sm
    )
    epilogue_args, constants = group_epilogue_arguments(
        x, widths, biases, xa, lora_bs, scalings, outs, block_n, partials, counters, slices
    )
    arguments = (x, tuple(weights), k, k_per_slice, x.stride(0), *epilogue_args)
    constants.update(tile_constants(x, candidate))
    return _lora_gemv_group_kernel, (bands, slices), arguments, constants


def lora_gemv_group(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    biases: Sequence[torch.Tensor | None] | None = None,
    xa: torch.Tensor | None = None,
    lora_bs: Sequence[torch.Tensor | None] | None = None,
    scalings: Sequence[float] | None = None,
    *,
    candidate: int = 0,
) -> list[torch.Tensor]:
    """``[x W_g^T + s_g xa_g B_g^T + bias_g for each g]`` for x of 1 to 8 rows, in one launch.

    Args:
        x: (M, K).  weights: 1 to MAX_GROUPS contiguous (N_g, K).
        biases: one (N_g,) per weight, or None (a bias for every weight or for none).
        xa: (M, sum of the ranks): x A_g^T of each weight with an adapter, side by side in
            the weights' order, or None (no adapters).
        lora_bs: per weight its contiguous LoRA B (N_g, R_g), or None for no adapter.
        scalings: per weight its adapter's scale (lora_alpha / r); 1.0 each if None.
        candidate: which of lora_gemv's ``CANDIDATES`` (tile sizes) to launch with.

    Returns:
        One new contiguous (M, N_g) tensor per weight.
    """
    _check(x, weights, biases, xa, lora_bs, scalings)
    if not use_triton(x):
        warn_reference_once("lora_gemv_group", x.device.type)
        return lora_gemv_group_reference(x, weights, biases, xa, lora_bs, scalings)
    outs = [torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device) for weight in weights]
    kernel, grid, arguments, constants = launch(x, weights, biases, xa, lora_bs, scalings, outs, candidate)
    kernel[grid](*arguments, **constants)
    return outs
