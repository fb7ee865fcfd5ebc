"""Several projections' NF4 GEMVs of the same few rows in one launch: ``nf4_lora_gemv``'s
products over ``lora_gemv_group``'s layout, for a decode step's q, k and v (or gate and
up) in 4 bits,

    y_g = x W_g^T + s_g (x A_g^T) B_g^T + bias_g          x: (M, K), M <= 8;  W_g NF4 (N_g, K)

A Llama-3-8B k or v projection is 2 MB of codes: alone, its GEMV is mostly a launch's
fill and drain (7.9 us on an H100 against 13.2 for q's 8 MB, docs/inference.md), which
one grid over the three weights' bands shares.  Each program runs one band of one
projection through the CUDA-core or tensor-core band product of gemv.py /
gemv_mma.py (the candidate's), with that projection's codes and scales, then
lora_gemv's epilogue with its adapter, bias and output; the split-K workspace spans the
groups' bands side by side (lora/gemv_group.py).

The weights must share their quantisation: K, the block sizes, double quantisation or
not, the dtype they dequantise to, and their 16 levels (the lookup, made from the first
weight's levels, serves them all).  bitsandbytes' NF4 layers of one model all do.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from slothkit_kernels import split_k
from slothkit_kernels.lora.gemv import epilogue
from slothkit_kernels.lora.gemv_group import (
    bands_of,
    check_group_terms,
    group_epilogue_arguments,
    group_terms,
)
from slothkit_kernels.nf4.dequantize import launch_arguments
from slothkit_kernels.nf4.gemv import (
    CANDIDATES,
    LOOKUPS,
    _check,
    candidate_level_source,
    cuda_core_band,
    host_levels,
    nf4_lora_gemv_reference,
    steps,
    tile,
)
from slothkit_kernels.nf4.gemv_mma import tensor_core_band
from slothkit_kernels.nf4.weight import NF4Weight
from slothkit_kernels.utils import interpreter_enabled, use_triton, warn_reference_once


@triton.jit
def _nf4_lora_gemv_group_kernel(
    X,  # (M, K), rows stride_xm apart, contiguous along K
    PACKEDs,  # per group, as nf4_lora_gemv's kernel takes them: the codes,
    ABSMAXs,  # the block scales (or their codes when NESTED),
    NESTED_ABSMAXs,  # the scales of those codes,
    NESTED_CODEs,  # their 256 levels,
    OFFSETs,  # and the offset added to every nested scale
    LEVELS,  # the lookup's table (level_source), shared: the groups' levels are the same
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
    BLOCKSIZE: tl.constexpr,
    NESTED: tl.constexpr,
    NESTED_BLOCKSIZE: tl.constexpr,
    INTERPRETER: tl.constexpr,
    LOOKUP_ASM: tl.constexpr,
    TENSOR_CORES: tl.constexpr,  # nf4_gemv_mma's band product, else nf4_gemv's
    STEPS: tl.constexpr,  # the CUDA-core product's BLOCK_K steps per loop iteration
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
            if TENSOR_CORES:
                acc = tensor_core_band(X, PACKEDs[g], ABSMAXs[g], NESTED_ABSMAXs[g], NESTED_CODEs[g], OFFSETs[g],
                                       LEVELS, K, k_start, k_stop, stride_xm, offs_m, offs_n, m_mask, n_mask,
                                       BLOCKSIZE, NESTED, NESTED_BLOCKSIZE, BLOCK_M, BLOCK_N, BLOCK_K,
                                       INTERPRETER, LOOKUP_ASM)  # fmt: skip
            else:
                acc = cuda_core_band(X, PACKEDs[g], ABSMAXs[g], NESTED_ABSMAXs[g], NESTED_CODEs[g], OFFSETs[g],
                                     LEVELS, K, k_start, k_stop, stride_xm, offs_m, offs_n, m_mask, n_mask,
                                     BLOCKSIZE, NESTED, NESTED_BLOCKSIZE, BLOCK_M, BLOCK_N, BLOCK_K,
                                     INTERPRETER, LOOKUP_ASM, STEPS)  # fmt: skip
            # The band's partial sums sit at its columns of the side-by-side layout.
            partials = PARTIALS + band_starts[g] * BLOCK_N
            epilogue(acc, offs_m, offs_n, m_mask, n_mask, pid_n, pid_k, XA + xa_columns[g], Bs[g], BIASES[g],
                     Ys[g], partials, COUNTERS, M, padded_n, ranks[g], slices, stride_xam, ranks[g], ns[g],
                     scalings[g], SPLIT, HAS_LORA, HAS_BIAS, BLOCK_R)  # fmt: skip


def nf4_lora_gemv_group_reference(x, weights, biases=None, xa=None, lora_bs=None, scalings=None) -> list:
    """Each projection by nf4_lora_gemv_reference (the dequantised weight, fp32, rounded once)."""
    terms = group_terms([w.shape[0] for w in weights], biases, xa, lora_bs, scalings)
    return [nf4_lora_gemv_reference(x, weight, *term) for weight, term in zip(weights, terms)]


def _check_group(x, weights: Sequence[NF4Weight], biases, xa, lora_bs, scalings, candidate: int) -> None:
    for weight in weights:
        _check(x, weight, None, None, None, candidate)  # x against each weight, as nf4_lora_gemv
    check_group_terms("nf4_lora_gemv_group", x, [w.shape[0] for w in weights], biases, xa, lora_bs, scalings)
    first = weights[0]
    quantisation = (first.blocksize, first.is_nested, first.nested_blocksize if first.is_nested else None)
    for weight in weights[1:]:
        if (
            weight.blocksize,
            weight.is_nested,
            weight.nested_blocksize if weight.is_nested else None,
        ) != quantisation:
            raise ValueError(
                "nf4_lora_gemv_group: the weights are quantised differently (block size, double "
                "quantisation); group only weights quantised alike"
            )
        if host_levels(weight) != host_levels(first):
            raise ValueError(
                "nf4_lora_gemv_group: the weights' 16 levels differ; group only NF4 weights of one table"
            )
    terms = [t for t in (*(biases or []), *(lora_bs or []), xa) if t is not None]
    if {t.dtype for t in terms} - {x.dtype} or {t.device for t in terms} - {x.device}:
        raise ValueError(f"nf4_lora_gemv_group: give the biases, xa and lora_bs in {x.dtype} on {x.device}")


def launch(x, weights, biases, xa, lora_bs, scalings, outs, candidate: int, lookup: str):
    """(kernel, grid, arguments, constexprs and launch options) of a checked call."""
    rows, k = x.shape
    first = weights[0]
    widths = [w.shape[0] for w in weights]
    block_m, block_n, block_k = tile(candidate, rows, first.blocksize)
    _, _, warps, programs_per_sm, multiplier = CANDIDATES[candidate]
    tensor_cores = multiplier == "tensor cores"
    steps_per_iteration = steps(candidate, rows, first.blocksize, k)
    _, bands = bands_of(widths, block_n)
    _, slices, k_per_slice, partials, counters = split_k.plan(
        x.device, rows, bands * block_n, k, block_n, block_k * steps_per_iteration, programs_per_sm
    )
    epilogue_args, constants = group_epilogue_arguments(
        x, widths, biases, xa, lora_bs, scalings, outs, block_n, partials, counters, slices
    )
    interpreter = interpreter_enabled()
    records = [
        launch_arguments(w) for w in weights
    ]  # packed, absmax, code, nested_absmax, nested_code, offset
    asm, levels = candidate_level_source(first, candidate, lookup)  # the groups' levels are one
    arguments = (
        x,
        *(tuple(record[i] for record in records) for i in (0, 1, 3, 4, 5)),
        levels,
        k,
        k_per_slice,
        x.stride(0),
        *epilogue_args,
    )
    constants.update(
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        BLOCKSIZE=first.blocksize,
        NESTED=first.is_nested,
        NESTED_BLOCKSIZE=first.nested_blocksize if first.is_nested else 1,
        INTERPRETER=interpreter,
        LOOKUP_ASM=asm,
        TENSOR_CORES=tensor_cores,
        STEPS=steps_per_iteration,
        num_warps=warps,
    )
    return _nf4_lora_gemv_group_kernel, (bands, slices), arguments, constants


def nf4_lora_gemv_group(
    x: torch.Tensor,
    weights: Sequence[NF4Weight],
    biases: Sequence[torch.Tensor | None] | None = None,
    xa: torch.Tensor | None = None,
    lora_bs: Sequence[torch.Tensor | None] | None = None,
    scalings: Sequence[float] | None = None,
    *,
    candidate: int = 0,
    lookup: str = "auto",
) -> list[torch.Tensor]:
    """``[x W_g^T + s_g xa_g B_g^T + bias_g for each g]`` for x of 1 to 8 rows and NF4
    weights quantised alike, in one launch, each weight dequantised in registers.

    Args:
        x: (M, K) in the weights' dtype.  weights: 1 to 4 NF4Weight (N_g, K) (``supports``).
        biases, xa, lora_bs, scalings: as lora_gemv_group takes them.
        candidate: which of nf4_gemv's ``CANDIDATES`` to launch with.
        lookup: "auto", "registers", "shuffle" or "table", as nf4_lora_gemv takes it.

    Returns:
        One new contiguous (M, N_g) tensor per weight.
    """
    if lookup not in LOOKUPS:
        raise ValueError(f"nf4_lora_gemv_group: lookup={lookup!r}; expected one of {LOOKUPS}")
    if not 0 <= candidate < len(CANDIDATES):
        raise ValueError(f"nf4_lora_gemv_group: candidate {candidate}; there are {len(CANDIDATES)}")
    _check_group(x, weights, biases, xa, lora_bs, scalings, candidate)
    if not use_triton(x):
        warn_reference_once("nf4_lora_gemv_group", x.device.type)
        return nf4_lora_gemv_group_reference(x, weights, biases, xa, lora_bs, scalings)
    outs = [torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device) for w in weights]
    kernel, grid, arguments, constants = launch(
        x, weights, biases, xa, lora_bs, scalings, outs, candidate, lookup
    )
    kernel[grid](*arguments, **constants)
    return outs
