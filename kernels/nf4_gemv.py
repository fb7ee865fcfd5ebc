"""y = x W^T for a few rows of x, straight from an NF4 weight (decode-time projections).

At batch 1 a decoder step is a chain of matrix-vector products whose cost is reading the
weights: a 4-bit Llama-3-8B step reads 4.9 GB.  ``nf4_matmul`` reads the packed codes
once and dequantises them in registers, so the 16-bit weight never exists in memory:

    w[n, k] = dtype(fp32(NF4[code(n, k)] * absmax[(n K + k) / blocksize]))     (as nf4.py)
    y[m, n] = dtype(sum_k fp32(x[m, k]) * fp32(w[n, k])  (+ bias[n]))

The weight is rounded to its dtype exactly as ``dequantize_nf4`` rounds it (the nested
absmax included, with the same two separate fp32 roundings), the sum runs in fp32 and y
is rounded once.  So ``nf4_matmul(x, W)`` is ``x @ dequantize_nf4(W).T`` evaluated in
fp32, up to the order of the fp32 additions; ``nf4_matmul_reference`` is that, written in
torch.  (bitsandbytes' own 4-bit GEMV multiplies in the 16-bit dtype and gives other
values.)

What it is for: slothkit/inference will call it for the 4-bit projections of the decode
step (M = batch = 1..8 rows) once it is measured faster than bitsandbytes' GEMV on a GPU,
which reads those 4.9 GB at 1.2 TB/s, 28% of an H200's bandwidth.  It is not wired into
decoding or training yet.  It is correct for any M, but beyond a few rows dequantising
once and calling cuBLAS is the faster way (``dequantize_nf4`` then a matmul).

Layout and work split.  The weight is (N, K) row-major with K a multiple of the block
size, so row n is whole blocks and byte b of the row holds columns 2b (high nibble) and
2b + 1 (low nibble).  A program owns BLOCK_N output rows and one slice of K (split-K), and
walks its slice BLOCK_K columns at a time.  Each step loads the tile of packed bytes as
(BLOCK_N, GROUPS, GROUP / 2), where a group of GROUP = min(BLOCK_K, blocksize) columns
shares one scale, so a scale is loaded (and a nested one dequantised: three cached
gathers) once per row and group, never per element.  A byte's two levels come from one
8-byte gather into a 256-entry table of level pairs (``NF4Weight.code_pairs``, 2 KB, held
in L1), half the lookups of one gather per nibble.  Then:

* row programs (``use_dot=False``, one row of x each): a fp32 accumulator of the tile's
  shape takes the even columns of x times the high nibbles' weights and the odd columns
  times the low ones (one FMA per weight element), and is summed once at the end;
* dot programs (``use_dot=True``, up to 16 rows of x, zero-padded): the tile is reshaped
  to (BLOCK_N, BLOCK_K / 2) and fed to ``tl.dot`` twice (high nibbles with the even
  columns of x, low with the odd), in x's dtype with an fp32 accumulator: the weight is
  already rounded to that dtype, so the products are exact and only the additions differ
  from the reference.  fp32 weights use ``input_precision="ieee"`` (no TF32).

A slice is a multiple of ``SPLIT_GRANULE`` columns; the number of slices is chosen so
that the grid has at least ``PROGRAMS_PER_SM`` programs per SM (at 64 rows per program):
on an H200 (132 SMs) Llama-3-8B's (4096, 4096) and (4096, 14336) weights split K in 4
and 5, (1024, 4096) in 8 and (14336, 4096) in 2.  With more than one slice the programs
write fp32 partial sums (slices, M, N) and a second small kernel adds them in a fixed
order, adds the bias and rounds (deterministic, unlike atomics; at M = 1 the partials
add 0.5-3% to the bytes read on those four shapes).

Traffic per call: the NF4 record (0.5 byte per weight element, plus one absmax byte per
block when nested), x and y: a Llama-3-8B (14336, 4096) weight is 30.3 MB, 7.0 us at
4.3 TB/s.  At that rate the GPU must dequantise about 33 elements per clock per SM, and
the compiled loops take 8-12 instructions per element (``CONFIGS``) against 128 issued
per clock per SM: the issue rate, not DRAM, is the expected bound.  Which program kind
wins at which M is left to the tuner (below).

Tuning.  The first call for a given (N, K, M, dtype, block size, double quantisation,
bias) times every candidate in ``CONFIGS`` with ``triton.testing.do_bench`` and keeps the
fastest; later calls launch it directly.  Tuning cannot run inside CUDA graph capture,
so call once for each shape before capturing: a call made while capturing that finds no
tuned setting uses the fixed default (``DEFAULT_ROW_CONFIG`` at M = 1,
``DEFAULT_DOT_CONFIG`` otherwise), which is also what runs under the Triton interpreter.

The kernels are launched with ``enable_fp_fusion=False`` so that the nested scale keeps
bitsandbytes' two roundings (nf4.py); the GEMV's own multiply-adds are written as
explicit ``tl.fma`` and stay fused.  Under the Triton interpreter (which truncates fp32 ->
bf16 casts and multiplies 16-bit operands in 16 bits) the weight and y are rounded with
integer arithmetic and ``tl.dot`` gets fp32 operands; values are the same.

There is no backward: the packed codes are frozen.
"""

from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .nf4 import _check_weight, _round_to_bf16, dequantize_nf4_reference, launch_arguments
from .nf4_weight import NF4Weight
from .utils import interpreter_enabled, use_triton, warn_reference_once

# --------------------------------------------------------------------------- reference


def nf4_matmul_reference(
    x: torch.Tensor, weight: NF4Weight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ W^T (+ bias)`` with W from ``dequantize_nf4_reference``, in fp32, rounded once.

    Args:
        x: (..., in_features) in ``weight.dtype``.
        weight: the NF4 weight, shape (out_features, in_features).
        bias: optional (out_features,) in x's dtype.

    Returns:
        (..., out_features) in x's dtype.
    """
    _check_arguments(x, weight, bias, None)
    w = dequantize_nf4_reference(weight).float()  # (N, K), the rounded weight
    y = x.float() @ w.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


# --------------------------------------------------------------------------- kernels


@triton.jit
def _rounded_to(x, DTYPE: tl.constexpr, INTERPRETER: tl.constexpr):
    """fp32 values rounded to DTYPE (to nearest even), returned as fp32."""
    if DTYPE == tl.float32:
        out = x
    elif INTERPRETER and DTYPE == tl.bfloat16:  # the interpreter truncates this cast
        bits = x.to(tl.uint32, bitcast=True)
        rounded = bits + 0x7FFF + ((bits >> 16) & 1)
        rounded = tl.where(x != x, 0x7FC00000, rounded)  # noqa: PLR0124 (keep NaN a NaN)
        out = ((rounded >> 16) << 16).to(tl.float32, bitcast=True)
    else:
        out = x.to(DTYPE).to(tl.float32)
    return out


@triton.jit
def _stored_as(y, DTYPE: tl.constexpr, INTERPRETER: tl.constexpr):
    """fp32 values rounded once to DTYPE, for a store."""
    if INTERPRETER and DTYPE == tl.bfloat16:
        out = _round_to_bf16(y)
    else:
        out = y.to(DTYPE)
    return out


@triton.jit
def _nf4_matmul_kernel(
    X,  # pointer to the input, (M, K), rows stride_xm apart, columns contiguous
    PACKED,  # pointer to the packed codes, uint8, (N, K / 2): high nibble = even column
    CODE_PAIRS,  # pointer to 256 int64: the (high, low) nibbles' fp32 levels of a byte
    ABSMAX,  # pointer to the block scales (float), or their uint8 codes when NESTED
    NESTED_ABSMAX,  # pointer to the fp32 scales of the absmax codes (read when NESTED)
    NESTED_CODE,  # pointer to the 256-entry table of the absmax codes (read when NESTED)
    OFFSET,  # pointer to the fp32 scalar added to every nested absmax (read when NESTED)
    BIAS,  # pointer to the bias, (N,) (read when HAS_BIAS and not WRITE_PARTIALS)
    OUT,  # pointer to the output, (M, N) contiguous (written when not WRITE_PARTIALS)
    PARTIALS,  # pointer to fp32 partial sums, (slices, M, N) (written when WRITE_PARTIALS)
    M,  # rows of x
    N,  # output features (rows of the weight)
    K,  # input features (columns of the weight), a multiple of BLOCKSIZE
    stride_xm,  # elements between rows of x
    packed_row_bytes,  # K // 2
    row_blocks,  # K // BLOCKSIZE: quantisation blocks per weight row
    k_per_slice,  # columns per K slice, a multiple of BLOCK_K
    BLOCKSIZE: tl.constexpr,  # weight elements per block scale (a power of two)
    NESTED: tl.constexpr,  # whether the block scales are double-quantised
    NESTED_BLOCKSIZE: tl.constexpr,  # absmax codes per nested scale
    HAS_BIAS: tl.constexpr,  # whether to add BIAS
    WRITE_PARTIALS: tl.constexpr,  # K is split: write fp32 partial sums, not OUT
    BLOCK_M: tl.constexpr,  # rows of x per program: 1 (row programs) or 16 (dot programs)
    BLOCK_N: tl.constexpr,  # output features per program
    BLOCK_K: tl.constexpr,  # columns per step
    GROUP: tl.constexpr,  # columns sharing one scale within a step: min(BLOCK_K, BLOCKSIZE)
    USE_DOT: tl.constexpr,  # tl.dot (tensor cores) rather than one FMA per element
    INTERPRETER: tl.constexpr,  # running under the Triton interpreter
):
    HALF: tl.constexpr = GROUP // 2  # packed bytes per group
    GROUPS: tl.constexpr = BLOCK_K // GROUP  # groups per step
    DTYPE: tl.constexpr = X.dtype.element_ty
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)

    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,) output features
    row_mask = rows < N
    rows64 = rows.to(tl.int64)
    groups = tl.arange(0, GROUPS)
    group_bytes = groups[:, None] * HALF + tl.arange(0, HALF)[None, :]  # (GROUPS, HALF)
    k_start = pid_k * k_per_slice
    k_stop = tl.minimum(k_start + k_per_slice, K)
    if NESTED:
        offset = tl.load(OFFSET).to(tl.float32)
    if USE_DOT:
        x_rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
        half_cols = 2 * tl.arange(0, BLOCK_K // 2)  # (BLOCK_K / 2,) even columns of a step
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        x_row = X + pid_m.to(tl.int64) * stride_xm
        acc = tl.zeros((BLOCK_N, GROUPS, HALF), dtype=tl.float32)

    for k0 in range(k_start, k_stop, BLOCK_K):
        # K and the slice bounds are multiples of GROUP: a group is all in or all out.
        group_cols = k0 + groups * GROUP  # (GROUPS,) first column of each group
        tile_mask = row_mask[:, None] & (group_cols < k_stop)[None, :]  # (BLOCK_N, GROUPS)

        blocks = rows64[:, None] * row_blocks + (group_cols // BLOCKSIZE)[None, :]
        if NESTED:
            q = tl.load(ABSMAX + blocks, mask=tile_mask, other=0).to(tl.int32)
            level = tl.load(NESTED_CODE + q).to(tl.float32)
            nested_scale = tl.load(NESTED_ABSMAX + blocks // NESTED_BLOCKSIZE, mask=tile_mask, other=0.0)
            # Rounded after the product and after the sum (no FMA: see the launch).
            scale = level * nested_scale.to(tl.float32) + offset
        else:
            scale = tl.load(ABSMAX + blocks, mask=tile_mask, other=0.0).to(tl.float32)
        scale = scale[:, :, None]  # (BLOCK_N, GROUPS, 1)

        byte_offsets = rows64[:, None, None] * packed_row_bytes + (k0 // 2 + group_bytes)[None, :, :]
        packed = tl.load(
            PACKED + byte_offsets, mask=tile_mask[:, :, None], other=0, eviction_policy="evict_first"
        )  # (BLOCK_N, GROUPS, HALF) uint8
        pair = tl.load(CODE_PAIRS + packed.to(tl.int32))  # int64: low word high nibble's level
        high = pair.to(tl.uint32).to(tl.float32, bitcast=True) * scale  # even columns
        low = (pair >> 32).to(tl.uint32).to(tl.float32, bitcast=True) * scale  # odd columns

        if USE_DOT:
            x_cols = k0 + half_cols  # (BLOCK_K / 2,) even columns
            x_mask = (x_cols < k_stop)[:, None] & (x_rows < M)[None, :]
            x_ptrs = X + x_rows[None, :].to(tl.int64) * stride_xm + x_cols[:, None]  # (BLOCK_K / 2, BLOCK_M)
            x_even = tl.load(x_ptrs, mask=x_mask, other=0.0)
            x_odd = tl.load(x_ptrs + 1, mask=x_mask, other=0.0)
            w_high = tl.reshape(high, (BLOCK_N, BLOCK_K // 2))
            w_low = tl.reshape(low, (BLOCK_N, BLOCK_K // 2))
            if INTERPRETER or DTYPE == tl.float32:
                w_high = _rounded_to(w_high, DTYPE, INTERPRETER)
                w_low = _rounded_to(w_low, DTYPE, INTERPRETER)
                acc = tl.dot(w_high, x_even.to(tl.float32), acc, input_precision="ieee")
                acc = tl.dot(w_low, x_odd.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(w_high.to(DTYPE), x_even, acc)
                acc = tl.dot(w_low.to(DTYPE), x_odd, acc)
        else:
            x_cols = k0 + 2 * group_bytes  # (GROUPS, HALF) even columns
            x_mask = (group_cols < k_stop)[:, None]
            x_even = tl.load(x_row + x_cols, mask=x_mask, other=0.0).to(tl.float32)
            x_odd = tl.load(x_row + x_cols + 1, mask=x_mask, other=0.0).to(tl.float32)
            x_even = tl.broadcast_to(x_even[None, :, :], (BLOCK_N, GROUPS, HALF))
            x_odd = tl.broadcast_to(x_odd[None, :, :], (BLOCK_N, GROUPS, HALF))
            acc = tl.fma(_rounded_to(high, DTYPE, INTERPRETER), x_even, acc)
            acc = tl.fma(_rounded_to(low, DTYPE, INTERPRETER), x_odd, acc)

    if USE_DOT:
        y = acc  # (BLOCK_N, BLOCK_M)
        out_offsets = x_rows[None, :].to(tl.int64) * N + rows64[:, None]
        out_mask = row_mask[:, None] & (x_rows < M)[None, :]
    else:
        y = tl.sum(tl.sum(acc, axis=2), axis=1)  # (BLOCK_N,)
        out_offsets = pid_m.to(tl.int64) * N + rows64
        out_mask = row_mask
    if WRITE_PARTIALS:
        slice_offset = pid_k.to(tl.int64) * M * N
        tl.store(PARTIALS + slice_offset + out_offsets, y, mask=out_mask)
    else:
        if HAS_BIAS:
            bias = tl.load(BIAS + rows, mask=row_mask, other=0.0).to(tl.float32)
            if USE_DOT:
                y = y + bias[:, None]
            else:
                y = y + bias
        tl.store(OUT + out_offsets, _stored_as(y, DTYPE, INTERPRETER), mask=out_mask)


@triton.jit
def _sum_slices_kernel(
    PARTIALS,  # pointer to fp32 partial sums, (slices, M, N) contiguous
    BIAS,  # pointer to the bias, (N,) (read when HAS_BIAS)
    OUT,  # pointer to the output, (M, N) contiguous
    total,  # M * N
    N,  # output features
    slices,  # K slices to add
    HAS_BIAS: tl.constexpr,  # whether to add BIAS
    BLOCK: tl.constexpr,  # outputs per program
    INTERPRETER: tl.constexpr,  # running under the Triton interpreter
):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < total
    y = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(0, slices):  # in slice order, so the result does not vary between runs
        y += tl.load(PARTIALS + s * total + offsets, mask=mask, other=0.0)
    if HAS_BIAS:
        y += tl.load(BIAS + offsets % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + offsets, _stored_as(y, OUT.dtype.element_ty, INTERPRETER), mask=mask)


# --------------------------------------------------------------------------- launch settings


@dataclass(frozen=True)
class GemvConfig:
    block_n: int  # output features per program
    block_k: int  # columns per step (at most SPLIT_GRANULE)
    num_warps: int
    num_stages: int
    use_dot: bool  # tl.dot on up to 16 rows of x, or one row of x per program with FMAs

    @property
    def block_m(self) -> int:
        return 16 if self.use_dot else 1


# Candidates for the tuner, not yet timed on a GPU.  Compiled for sm_90 with Triton 3.6
# (bf16, nested scales; the comments give registers and the main loop's instructions per
# weight element), they take 7.6-11.7 instructions per element: a packed byte's gather
# and its 64-bit address, the scale multiply, the rounding to bf16 and back, the FMA (dot
# programs: the store of the operand to shared memory instead).  At 128 instructions per
# clock per SM that allows under half of the H200's bandwidth, so the issue rate, not
# DRAM, is the expected bound.  Tiles are wider than a CTA's rows so that a thread
# reuses its x values across rows.
CONFIGS = (
    GemvConfig(32, 256, 4, 1, False),  # 128 registers, 9.1 instructions per element
    GemvConfig(16, 256, 4, 1, False),  # 80, 9.9: more resident programs
    GemvConfig(16, 512, 4, 2, False),  # 139, 9.3: narrow rows, for short N
    GemvConfig(32, 512, 8, 1, False),  # 141, 9.2
    GemvConfig(64, 256, 8, 1, False),  # 134, 11.7
    GemvConfig(64, 128, 4, 3, True),  # 87, 8.8
    GemvConfig(64, 128, 4, 2, True),  # 101, 8.9
    GemvConfig(128, 64, 4, 3, True),  # 143, 7.6
    GemvConfig(128, 128, 8, 3, True),  # 105, 8.1
    GemvConfig(256, 64, 8, 3, True),  # 104, 7.7
)
DEFAULT_ROW_CONFIG = CONFIGS[0]  # M = 1, and under capture before tuning
DEFAULT_DOT_CONFIG = CONFIGS[5]  # M > 1
# Row programs re-read the weight tile for every row of x (from L2); past this many rows
# only dot programs are tried.
ROW_PROGRAMS_MAX_M = 8

SPLIT_GRANULE = 512  # K slices are multiples of this many columns (>= every BLOCK_K)
PROGRAMS_PER_SM = 2  # split K until the grid has this many programs per SM
SPLIT_REFERENCE_ROWS = 64  # rows per program assumed when choosing the split
SUM_BLOCK = 1024  # outputs per program of the slice sum

# Tuned settings, keyed by the problem (see nf4_matmul): filled by the first call of each.
_TUNED: dict[tuple, GemvConfig] = {}


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _k_slices(k: int, n: int, m_tiles: int, sm_count: int, split_k: int | None) -> tuple[int, int]:
    """(columns per slice, slices): enough programs for the SMs, slices of whole granules."""
    granules = triton.cdiv(k, SPLIT_GRANULE)
    if split_k is None:
        programs = triton.cdiv(n, SPLIT_REFERENCE_ROWS) * m_tiles
        split_k = triton.cdiv(PROGRAMS_PER_SM * sm_count, programs)
    per_slice = triton.cdiv(granules, max(1, min(split_k, granules))) * SPLIT_GRANULE
    return per_slice, triton.cdiv(k, per_slice)


def _code_pairs(weight: NF4Weight) -> torch.Tensor:
    """256 int64: for byte b, the fp32 bits of NF4[b >> 4] (low word) and NF4[b & 15] (high)."""
    if weight.code_pairs is None:
        bits = weight.code.reshape(-1).float().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        byte = torch.arange(256, device=bits.device)
        weight.code_pairs = (bits[byte >> 4] | (bits[byte & 0xF] << 32)).contiguous()
    return weight.code_pairs


def _launch(
    x2d: torch.Tensor,
    weight: NF4Weight,
    bias: torch.Tensor | None,
    out2d: torch.Tensor,
    config: GemvConfig,
    split_k: int | None = None,
) -> None:
    """Fill out2d (M, N) with x2d (M, K) @ W^T (+ bias) using one launch setting."""
    m, k = x2d.shape
    n = out2d.shape[1]
    interpreter = interpreter_enabled()
    m_tiles = triton.cdiv(m, config.block_m)
    sm_count = 1 if x2d.device.type != "cuda" else _sm_count(x2d.device.index or 0)
    per_slice, slices = _k_slices(k, n, triton.cdiv(m, 16), sm_count, split_k)
    partials = None
    if slices > 1:
        partials = torch.empty((slices, m, n), dtype=torch.float32, device=x2d.device)
    packed, absmax, _, nested_absmax, nested_code, offset = launch_arguments(weight)
    grid = (m_tiles, triton.cdiv(n, config.block_n), slices)
    _nf4_matmul_kernel[grid](
        x2d,
        packed,
        _code_pairs(weight),
        absmax,
        nested_absmax,
        nested_code,
        offset,
        bias if bias is not None else out2d,
        out2d,
        partials if partials is not None else out2d,
        m,
        n,
        k,
        x2d.stride(0),
        k // 2,
        k // weight.blocksize,
        per_slice,
        BLOCKSIZE=weight.blocksize,
        NESTED=weight.is_nested,
        NESTED_BLOCKSIZE=weight.nested_blocksize if weight.is_nested else 1,
        HAS_BIAS=bias is not None,
        WRITE_PARTIALS=partials is not None,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        GROUP=min(config.block_k, weight.blocksize),
        USE_DOT=config.use_dot,
        INTERPRETER=interpreter,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        # bitsandbytes rounds the nested product before adding the offset (nf4.py).
        enable_fp_fusion=False,
    )
    if partials is not None:
        total = m * n
        _sum_slices_kernel[(triton.cdiv(total, SUM_BLOCK),)](
            partials,
            bias if bias is not None else out2d,
            out2d,
            total,
            n,
            slices,
            HAS_BIAS=bias is not None,
            BLOCK=SUM_BLOCK,
            INTERPRETER=interpreter,
            num_warps=4,
        )


def _candidates(m: int) -> tuple[GemvConfig, ...]:
    return CONFIGS if m <= ROW_PROGRAMS_MAX_M else tuple(c for c in CONFIGS if c.use_dot)


def _default_config(m: int) -> GemvConfig:
    return DEFAULT_ROW_CONFIG if m == 1 else DEFAULT_DOT_CONFIG


def _config_for(x2d, weight: NF4Weight, bias, out2d) -> GemvConfig:
    """The tuned setting for this problem, tuning it first where that is possible."""
    m, k = x2d.shape
    n = out2d.shape[1]
    key = (
        x2d.device,
        n,
        k,
        m,
        x2d.dtype,
        weight.blocksize,
        weight.nested_blocksize if weight.is_nested else 0,
        bias is not None,
    )
    config = _TUNED.get(key)
    if config is not None:
        return config
    if x2d.device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return _default_config(m)  # nothing to time here, or timing would break the capture
    from triton.testing import do_bench

    timings, failures = {}, []
    for candidate in _candidates(m):

        def run(candidate=candidate):
            _launch(x2d, weight, bias, out2d, candidate)

        try:
            run()  # compiles
            timings[candidate] = do_bench(run, warmup=5, rep=20)
        except Exception as exc:  # a setting the compiler refuses (e.g. out of resources)
            failures.append(f"{candidate}: {type(exc).__name__}: {exc}".splitlines()[0])
    if not timings:
        raise RuntimeError("nf4_matmul: no launch setting compiled:\n" + "\n".join(failures))
    if failures:
        warnings.warn(
            "nf4_matmul: launch settings skipped while tuning:\n" + "\n".join(failures), stacklevel=3
        )
    config = _TUNED[key] = min(timings, key=timings.get)
    return config


# --------------------------------------------------------------------------- checks


def _check_arguments(x, weight: NF4Weight, bias, out) -> None:
    if getattr(weight, "launch_cache", None) is None:  # checked once per record
        _check_weight(weight)
    if len(weight.shape) != 2:
        raise ValueError(f"weight must be 2-D (out_features, in_features), got shape {tuple(weight.shape)}")
    n, k = weight.shape
    if k % weight.blocksize:
        raise ValueError(
            f"nf4_matmul needs weight rows of whole blocks: in_features={k} is not a multiple "
            f"of the block size {weight.blocksize}; use dequantize_nf4(weight) and a matmul"
        )
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype != weight.dtype:
        raise TypeError(
            f"x has dtype {x.dtype} but the weight dequantises to {weight.dtype}; they must match"
        )
    if x.dim() < 1 or x.shape[-1] != k:
        raise ValueError(f"x has shape {tuple(x.shape)}; expected (..., {k}) (in_features of the weight)")
    if x.device != weight.device:
        raise ValueError(f"x is on {x.device} but weight is on {weight.device}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or bias.shape != (n,) or bias.dtype != x.dtype:
            got = (tuple(bias.shape), bias.dtype) if isinstance(bias, torch.Tensor) else type(bias).__name__
            raise ValueError(f"bias must be a ({n},) tensor of dtype {x.dtype}, got {got}")
        if bias.device != x.device:
            raise ValueError(f"bias is on {bias.device} but x is on {x.device}")
    if out is not None:
        shape = (*x.shape[:-1], n)
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out must be a tensor, got {type(out).__name__}")
        if out.shape != shape or out.dtype != x.dtype:
            raise ValueError(
                f"out has shape {tuple(out.shape)} and dtype {out.dtype}; expected shape {shape} and dtype {x.dtype}"
            )
        if out.device != x.device:
            raise ValueError(f"out is on {out.device} but x is on {x.device}")
        if not out.is_contiguous():
            raise ValueError("out must be contiguous")


# --------------------------------------------------------------------------- public


def nf4_matmul(
    x: torch.Tensor,
    weight: NF4Weight,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    split_k: int | None = None,
) -> torch.Tensor:
    """``x @ W^T (+ bias)`` for an NF4 weight W, dequantised inside the kernel.

    The same function as ``x @ dequantize_nf4(weight).T`` computed in fp32 and rounded
    once, without the 16-bit weight in memory (see the module docstring).  Meant for a
    few rows of x (decoding); the first call for each problem shape tunes the launch
    setting, so make it before capturing a CUDA graph.

    Args:
        x: (..., in_features), in ``weight.dtype``; any leading dimensions.
        weight: an ``NF4Weight`` of shape (out_features, in_features) whose
            in_features is a multiple of its block size.
        bias: optional (out_features,) tensor in x's dtype, added before the rounding.
        out: optional contiguous (..., out_features) tensor of x's dtype, not
            overlapping x, filled and returned (the first call writes it several times
            while tuning).
        split_k: how many slices K is cut into (each program sums one slice, a second
            kernel adds them); None chooses from the shape and the GPU's SM count.

    Returns:
        (..., out_features) in x's dtype.
    """
    _check_arguments(x, weight, bias, out)
    n, k = weight.shape
    if split_k is not None and (not isinstance(split_k, int) or split_k < 1):
        raise ValueError(f"split_k must be a positive int or None, got {split_k!r}")
    if not use_triton(weight.packed):
        warn_reference_once("nf4_matmul", weight.device.type)
        result = nf4_matmul_reference(x, weight, bias)
        return result if out is None else out.copy_(result)

    if out is None:
        out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    m = math.prod(x.shape[:-1])
    if m == 0:
        return out
    x2d = x.reshape(m, k)
    if x2d.stride(1) != 1:
        x2d = x2d.contiguous()
    out2d = out.view(m, n)
    bias = None if bias is None else bias.contiguous()
    config = _config_for(x2d, weight, bias, out2d)
    _launch(x2d, weight, bias, out2d, config, split_k)
    return out
