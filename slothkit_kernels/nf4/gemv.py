"""A LoRA projection of a few rows on an NF4 weight, dequantised in registers:

    y = x W^T + s (x A^T) B^T + bias          x: (M, K), M <= 8;  W: (N, K) in NF4

W is never written out: each program reads a band of BLOCK_N rows of the packed codes
(half a byte per weight) and their block scales once and accumulates, for every row of x,

    y[m, n] = sum over the blocks b of row n:  scale_b * sum_{k in b} x[m, k] * NF4[code(n, k)]

in fp32, the nested scale's product and sum rounded separately as bitsandbytes rounds
them.  The epilogue adds the adapter's second product ``s xa B^T`` and the bias and
rounds once (lora/gemv.py's ``epilogue``), and K may be cut into slices (split_k.py), as
in the 16-bit lora_gemv.  This moves about a quarter of a 16-bit weight's bytes.

Numbers.  The weights are the products level x scale in fp32, not rounded to the 16-bit
dtype as ``dequantize_nf4`` (and bitsandbytes' dequantisation) rounds them before a
matmul: the result differs from ``F.linear(x, dequantize_nf4(W))`` by that rounding of
the weights (relative 2^-9 in bf16, random in sign, so far less in a sum over K) and the
order of the fp32 additions, below the output's own rounding.  bitsandbytes' 4-bit GEMV
multiplies in the 16-bit dtype and differs more.

Instructions, not bytes, bound a dequantising GEMV at one row: an H200 must turn about
ten trillion codes a second (4.8 TB/s at half a byte each) into products to keep up with
its memory, a few instructions per code at most.  So a code's level is looked up in
registers, bit for bit and with no memory touched (level_lookup.py): on CUDA cores by a
warp shuffle from the lane that holds it (under two instructions a code), on tensor cores
by byte permutes of a table held in the instructions and in registers (under three a
code at 16 bits; ``candidate_lookup`` says why each), and at
one row a packed byte's two weights cost a multiply and two fused multiply-adds
(x_even * level_high + x_odd * level_low, times the row's scale, into the accumulator);
with more rows the pair of levels is scaled once and each row adds two fused
multiply-adds.  Nothing is rounded to 16 bits.  The alternative lookup (``lookup="table"``,
and always under the Triton interpreter, which runs no PTX) loads both levels of a byte
from a 256-entry table of level pairs (2 KB, held in L1; ``level_source``): one load, but
a gather across the warp, which on the H200 bounds the kernel below bitsandbytes' GEMV
(docs/inference.md).  scripts/cuda_sass.py counts each one's main loop for a GPU
without one.

Layout.  Byte j of a row's packed codes holds columns 2j (high nibble) and 2j + 1 (low
nibble), so a step loads a (BLOCK_N, BLOCK_K / 2) tile of bytes and x's BLOCK_K columns
(x is a few KB and stays in cache), splits x into its even and odd columns, and
multiplies the high nibbles' levels by the even columns and the low ones' by the odd.  BLOCK_K divides the
quantisation block and the row length is whole blocks (``supports``), so every row's
tile in a step lies in one block: one scale per row per step.  A CUDA-core candidate
may take several steps per loop iteration (``steps``), unrolled, so that more of their
independent loads are in flight at once: a step's loads are 8 bytes of codes a thread,
and these kernels wait on memory rather than on their instructions (docs/inference.md).

Two multipliers.  The candidates above run this file's kernel on the CUDA cores or
gemv_mma.py's on the tensor cores (16-bit levels, x padded to 16 rows: fewer
instructions per weight, the same at one row as at eight, for weights that dequantise
to bf16 or fp16).  bitsandbytes reads an NF4 weight for one row with its own GEMV and,
for more rows, dequantises it whole and multiplies; which of those and the candidates is
faster depends on the GPU and the shape, so the decode path times them once per shape
and keeps the fastest (slothkit.inference.gemv_choice).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slothkit_kernels import split_k
from slothkit_kernels.lora.gemv import (
    MAX_ROWS,
    check_low_rank,
    epilogue,
    epilogue_arguments,
    lora_gemv_reference,
)
from slothkit_kernels.nf4 import level_lookup
from slothkit_kernels.nf4.dequantize import checked, dequantize_nf4_reference, launch_arguments
from slothkit_kernels.nf4.gemv_mma import _nf4_lora_gemv_mma_kernel
from slothkit_kernels.nf4.scales import block_scale
from slothkit_kernels.nf4.weight import NF4Weight
from slothkit_kernels.utils import interpreter_enabled, use_triton, warn_reference_once

# (BLOCK_N, BLOCK_K, num_warps, programs per SM, multiplier) to try per shape; a step's
# BLOCK_K is capped at the quantisation block (64 in QLoRA's default) and a wider one on
# CUDA cores is that many columns per loop iteration in steps of a block (``tile``),
# programs per SM 0 = no split of K; the multiplier is "cuda cores" (this file's kernel:
# fp32 levels, a fused multiply-add per weight per row) or "tensor cores"
# (gemv_mma.py: 16-bit levels, x padded to 16 rows; 16-bit weights only).
CANDIDATES = (
    (32, 64, 4, 0, "cuda cores"),
    (32, 256, 4, 8, "cuda cores"),
    (64, 256, 4, 4, "cuda cores"),
    (16, 128, 4, 0, "cuda cores"),
    (32, 64, 4, 4, "cuda cores"),
    (64, 64, 4, 4, "cuda cores"),
    (16, 64, 2, 8, "cuda cores"),
    (32, 128, 4, 8, "cuda cores"),
    (128, 64, 4, 0, "tensor cores"),
    (64, 64, 4, 0, "tensor cores"),
    (256, 64, 8, 0, "tensor cores"),
    (64, 64, 4, 4, "tensor cores"),
    (128, 64, 4, 2, "tensor cores"),
)

_LOOKUP_CONSTRAINTS = tl.constexpr(level_lookup.constraints(32))


@triton.jit
def cuda_core_band(
    X,
    PACKED,
    ABSMAX,
    NESTED_ABSMAX,
    NESTED_CODE,
    OFFSET,
    LEVELS,
    K,
    k_start,
    k_stop,
    stride_xm,
    offs_m,
    offs_n,
    m_mask,
    n_mask,
    BLOCKSIZE: tl.constexpr,
    NESTED: tl.constexpr,
    NESTED_BLOCKSIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    INTERPRETER: tl.constexpr,
    LOOKUP_ASM: tl.constexpr,
    STEPS: tl.constexpr,
):
    """x W^T over one band of the NF4 weight's rows (offs_n) and the columns
    k_start..k_stop, in fp32: (BLOCK_M, BLOCK_N).  The arguments are the kernel's."""
    HALF: tl.constexpr = BLOCK_K // 2  # packed bytes per row per step
    offs_j = tl.arange(0, HALF)
    # Pointers at column 0, so that a step adds only its column: each row's packed bytes
    # and first block scale, and x's rows.
    row_blocks = offs_n.to(tl.int64) * (K // BLOCKSIZE)  # (BLOCK_N,)
    packed_rows = PACKED + offs_n.to(tl.int64)[:, None] * (K // 2) + offs_j[None, :]
    x_rows = X + offs_m.to(tl.int64)[:, None] * stride_xm + tl.arange(0, BLOCK_K)[None, :]
    offset = tl.load(OFFSET) if NESTED else 0.0
    if LOOKUP_ASM != "":
        # Half the lookup table, in registers for the whole program.  Each lane reads its
        # own copy: words ptxas knows to be the same in every thread it keeps in uniform
        # registers, which a PRMT cannot read, and copies out at every lookup.
        words = LEVELS + level_lookup.lane() * 8
        t0, t1, t2, t3 = tl.load(words), tl.load(words + 1), tl.load(words + 2), tl.load(words + 3)
        t4, t5, t6, t7 = tl.load(words + 4), tl.load(words + 5), tl.load(words + 6), tl.load(words + 7)
    if BLOCK_M == 1:  # x broadcast over the weight's tile: no third dimension to lay out
        acc2 = tl.zeros((BLOCK_N, HALF), dtype=tl.float32)
    else:
        acc3 = tl.zeros((BLOCK_M, BLOCK_N, HALF), dtype=tl.float32)
    # STEPS steps per iteration, unrolled: their loads do not depend on one another, so
    # they are all in flight at once (Triton pipelines none of these loads itself).
    for k_iteration in range(k_start, k_stop, BLOCK_K * STEPS):
        for step in tl.static_range(STEPS):
            k0 = k_iteration + step * BLOCK_K
            block = row_blocks + k0 // BLOCKSIZE  # (BLOCK_N,): the step's block of each row
            scale = block_scale(ABSMAX, NESTED_ABSMAX, NESTED_CODE, offset, block, n_mask, NESTED, NESTED_BLOCKSIZE,
                                INTERPRETER)  # fmt: skip
            packed = tl.load(packed_rows + k0 // 2, mask=n_mask[:, None], other=0)  # (BLOCK_N, HALF)
            if LOOKUP_ASM != "":  # levels of columns k0 + 2j (high) and k0 + 2j + 1 (low)
                high, low = tl.inline_asm_elementwise(
                    LOOKUP_ASM, _LOOKUP_CONSTRAINTS, [packed, t0, t1, t2, t3, t4, t5, t6, t7],
                    dtype=(tl.float32, tl.float32), is_pure=True, pack=4,
                )  # fmt: skip
            else:
                pairs = tl.load(LEVELS + packed.to(tl.int32))  # (BLOCK_N, HALF) int64
                high = pairs.to(tl.int32).to(tl.float32, bitcast=True)
                low = (pairs >> 32).to(tl.int32).to(tl.float32, bitcast=True)
            x = tl.load(x_rows + k0, mask=m_mask[:, None], other=0.0).to(tl.float32)  # (BLOCK_M, BLOCK_K)
            x_even, x_odd = tl.split(tl.reshape(x, (BLOCK_M, HALF, 2)))  # columns k0 + 2j, k0 + 2j + 1
            # Summed along K once after the loop: no reduction across threads per step.
            if BLOCK_M == 1:
                acc2 += (x_even * high + x_odd * low) * scale[:, None]
            else:  # the weights scaled once for all rows: two FMAs a pair a row, not three
                high_w, low_w = high * scale[:, None], low * scale[:, None]
                acc3 += x_even[:, None, :] * high_w[None, :, :]  # each a fused multiply-add
                acc3 += x_odd[:, None, :] * low_w[None, :, :]
    if BLOCK_M == 1:
        acc = tl.sum(acc2, axis=1)[None, :]  # (1, BLOCK_N)
    else:
        acc = tl.sum(acc3, axis=2)  # (BLOCK_M, BLOCK_N)
    return acc


@triton.jit
def _nf4_lora_gemv_kernel(
    X,  # (M, K), rows stride_xm apart, contiguous along K
    PACKED,  # (N * K / 2,) uint8 codes, row-major, high nibble first
    ABSMAX,  # fp32 block scales, or their uint8 codes when NESTED
    NESTED_ABSMAX,  # fp32 scales of the absmax codes (NESTED)
    NESTED_CODE,  # the 256 levels of the absmax codes (NESTED)
    OFFSET,  # fp32 scalar added to every nested scale (NESTED)
    LEVELS,  # LOOKUP_ASM's 8 int32 table words, 32 copies, else (256,) int64: byte b ->
    #   bits of NF4[b >> 4] | bits of NF4[b & 15] << 32 (level_source)
    K,  # a multiple of BLOCKSIZE
    k_per_slice,  # columns per slice of K, a multiple of BLOCK_K
    stride_xm,
    XA,  # from here on the epilogue's arguments (lora_gemv.epilogue_arguments)
    B,
    BIAS,
    Y,  # (M, N); its dtype is the weight's
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
    BLOCKSIZE: tl.constexpr,  # weights per block scale, a multiple of BLOCK_K
    NESTED: tl.constexpr,
    NESTED_BLOCKSIZE: tl.constexpr,
    HAS_LORA: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    INTERPRETER: tl.constexpr,  # no inline PTX
    LOOKUP_ASM: tl.constexpr,  # PTX turning packed bytes into levels (level_lookup), or ""
    STEPS: tl.constexpr = 1,  # BLOCK_K steps per loop iteration; K per slice a multiple
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    n_mask = offs_n < N
    m_mask = offs_m < M
    k_start = pid_k * k_per_slice
    k_stop = tl.minimum(k_start + k_per_slice, K)
    acc = cuda_core_band(X, PACKED, ABSMAX, NESTED_ABSMAX, NESTED_CODE, OFFSET, LEVELS, K, k_start, k_stop,
                         stride_xm, offs_m, offs_n, m_mask, n_mask, BLOCKSIZE, NESTED, NESTED_BLOCKSIZE,
                         BLOCK_M, BLOCK_N, BLOCK_K, INTERPRETER, LOOKUP_ASM, STEPS)  # fmt: skip
    epilogue(acc, offs_m, offs_n, m_mask, n_mask, pid_n, pid_k, XA, B, BIAS, Y, PARTIALS, COUNTERS, M, N, R,
             slices, stride_xam, stride_bn, stride_ym, scaling, SPLIT, HAS_LORA, HAS_BIAS, BLOCK_R)  # fmt: skip


def _level_pairs(weight: NF4Weight) -> torch.Tensor:
    """The (256,) int64 table the CUDA-core kernel's table lookup reads both levels of a
    packed byte from: the fp32 bits of NF4[b >> 4] (the high nibble, the even column) in
    the low word, those of NF4[b & 15] in the high one."""
    bits = weight.code.reshape(-1).float().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    byte = torch.arange(256, device=bits.device)
    return bits[byte >> 4] | (bits[byte & 15] << 32)


def host_levels(weight: NF4Weight) -> tuple[float, ...]:
    """The record's 16 levels on the host: read once (a synchronisation, so first outside
    CUDA graph capture) and kept with its level sources, which its copies share."""
    if weight.level_sources is None:
        weight.level_sources = {}
    if "levels" not in weight.level_sources:
        weight.level_sources["levels"] = tuple(weight.code.reshape(-1).float().tolist())
    return weight.level_sources["levels"]


def _ptx_lookup(weight: NF4Weight, lookup: str, width: int) -> tuple[str, torch.Tensor]:
    """The PTX turning packed bytes into levels of ``width`` bits (fp32, or the weight's
    16-bit dtype) in registers, and the int32 table words it takes in registers, lane by
    lane (level_lookup.lane says why each lane reads its own): "registers", byte permutes
    with half the table as immediates and the other half copied to every lane; "shuffle",
    each level fetched from the lane that holds it (lane l's first word is level l mod 16).
    Reads the levels to the host: a synchronisation."""
    levels = host_levels(weight)
    dtype = "float16" if weight.dtype == torch.float16 else "bfloat16"
    if lookup == "registers":
        asm = level_lookup.lookup_asm(levels, width, dtype)
        words = level_lookup.register_words(levels, width, dtype) * 32  # a copy a lane
    else:
        asm = level_lookup.shuffle_asm(width)
        words = level_lookup.shuffle_words(levels, width, dtype)  # each lane its own
    words = [w - (1 << 32) if w >= 1 << 31 else w for w in words]  # the same bits, signed
    return asm, torch.tensor(words, dtype=torch.int32, device=weight.device)


def level_source(weight: NF4Weight, lookup: str, width: int) -> tuple[str, torch.Tensor]:
    """(LOOKUP_ASM, LEVELS) of a kernel that turns the record's codes into ``width``-bit
    levels (32 on CUDA cores, 16 on tensor cores) by ``lookup``: "registers" and
    "shuffle" give the PTX and its table words, "table" no PTX and the table to load
    from (level pairs at 32 bits, the 16 levels in the weight's dtype at 16).  Made once
    per record (``weight.level_sources``) and shared by the copies ``with_packed`` makes;
    the PTX lookups read the levels to the host, so their first call must be outside
    CUDA graph capture (``has_level_source`` tells whether it was made)."""
    if weight.level_sources is None:
        weight.level_sources = {}
    key = (lookup, width)
    if key not in weight.level_sources:
        if lookup in ("registers", "shuffle"):
            weight.level_sources[key] = _ptx_lookup(weight, lookup, width)
        elif width == 32:
            weight.level_sources[key] = ("", _level_pairs(weight))
        else:
            weight.level_sources[key] = ("", weight.code.reshape(-1).to(weight.dtype))
    return weight.level_sources[key]


def has_level_source(weight: NF4Weight, lookup: str, width: int) -> bool:
    return (lookup, width) in (weight.level_sources or {})


# How a code becomes its level: byte permutes of a table in the instructions and
# registers, a warp shuffle from the lane holding it (both level_lookup.py), a load from a
# table in memory, or "auto": whichever of the first two is faster for the candidate's
# multiplier (``candidate_lookup``).
LOOKUPS = ("auto", "registers", "shuffle", "table")


def candidate_lookup(candidate: int, lookup: str) -> str:
    """The lookup ``candidate`` runs with when asked for ``lookup``: itself, or for "auto"
    the one the decode GEMV sweep timed faster for the candidate's multiplier on an H100
    (docs/inference.md): shuffles on CUDA cores (fp32 levels; at one row 26.7-26.9 us
    against the permutes' 39.4-41.6 at Llama-3-8B's MLP shapes), permutes on tensor cores
    (16-bit levels, where a shuffle also needs a permute per pair; at eight rows 17.1
    against 18.9 us at 4096 x 4096, 43.3 against 50.6 at 14336 x 4096)."""
    if lookup != "auto":
        return lookup
    return "registers" if CANDIDATES[candidate][4] == "tensor cores" else "shuffle"


def candidate_source_key(candidate: int, lookup: str) -> tuple[str, int]:
    """(lookup, width) of the level source ``candidate`` runs with when asked for
    ``lookup`` on a GPU: its lookup (``candidate_lookup``) at its width (16-bit levels on
    tensor cores, fp32 on CUDA cores)."""
    return candidate_lookup(candidate, lookup), 16 if CANDIDATES[candidate][4] == "tensor cores" else 32


def candidate_level_source(weight: NF4Weight, candidate: int, lookup: str) -> tuple[str, torch.Tensor]:
    """``level_source`` of what ``candidate`` launches with (``candidate_source_key``);
    the Triton interpreter runs no PTX and reads the table whichever lookup is asked for."""
    lookup, width = candidate_source_key(candidate, lookup)
    return level_source(weight, "table" if interpreter_enabled() else lookup, width)


def supports(weight: NF4Weight) -> bool:
    """Whether ``nf4_lora_gemv`` reads this weight: 2-D, rows of whole quantisation blocks."""
    return len(weight.shape) == 2 and weight.shape[1] % weight.blocksize == 0


def nf4_lora_gemv_reference(x, weight: NF4Weight, bias=None, xa=None, lora_b=None, scaling: float = 1.0):
    """The same from the dequantised weight (bitsandbytes' bits, rounded to the dtype), in
    fp32, rounded once: within the output's rounding of the kernel's result."""
    return lora_gemv_reference(x, dequantize_nf4_reference(weight), bias, xa, lora_b, scaling)


def _check(x, weight: NF4Weight, bias, xa, lora_b, candidate: int) -> None:
    checked(weight)
    if not supports(weight):
        raise ValueError(
            f"nf4_lora_gemv: weight of shape {tuple(weight.shape)} in blocks of {weight.blocksize}; "
            f"it takes a 2-D weight whose rows are whole blocks"
        )
    n, k = weight.shape
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(
            f"nf4_lora_gemv: x {tuple(x.shape)} for a weight of shape ({n}, {k}); expected (M, {k})"
        )
    if CANDIDATES[candidate][4] == "tensor cores" and weight.dtype == torch.float32:
        raise ValueError(
            f"nf4_lora_gemv: candidate {candidate} multiplies on tensor cores, in 16 bits; a weight "
            f"that dequantises to float32 takes a CUDA-core candidate"
        )
    if not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(
            f"nf4_lora_gemv: x has {x.shape[0]} rows; it takes 1 to {MAX_ROWS} (a decode step's)"
        )
    check_low_rank("nf4_lora_gemv", x, n, xa, lora_b)
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"nf4_lora_gemv: bias {tuple(bias.shape)}; expected ({n},)")
    tensors = [t for t in (x, bias, xa, lora_b) if t is not None]
    if {t.dtype for t in tensors} != {weight.dtype}:
        raise ValueError(
            f"nf4_lora_gemv: dtypes {[t.dtype for t in tensors]} for a weight that dequantises "
            f"to {weight.dtype}; give them in {weight.dtype}"
        )
    if {t.device for t in tensors} != {weight.device}:
        raise ValueError("nf4_lora_gemv: tensors on several devices")
    for name, t in (("x", x), ("xa", xa), ("lora_b", lora_b)):
        if t is not None and t.stride(-1) != 1:
            raise ValueError(f"nf4_lora_gemv: {name} needs a contiguous last dimension")


def tile(candidate: int, rows: int, blocksize: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K) a candidate launches with.  On CUDA cores: the rows
    padded to a power of two, BLOCK_K halved as they double (down to 32) so that the
    (rows, BLOCK_N, BLOCK_K / 2) tile accumulated in registers stays the same size, and
    within a block.  On tensor cores: the rows padded to 16, BLOCK_K within a block."""
    block_n, block_k, _, _, multiplier = CANDIDATES[candidate]
    if multiplier == "tensor cores":
        return 16, block_n, min(blocksize, block_k)
    block_m = triton.next_power_of_2(rows)
    return block_m, block_n, min(blocksize, max(32, block_k // block_m))


def steps(candidate: int, rows: int, blocksize: int, k: int) -> int:
    """BLOCK_K steps per loop iteration of a candidate on CUDA cores: the columns it asks
    for (halved as ``tile`` halves them for more rows) over its step, halved until a
    whole number of iterations fills K; 1 on tensor cores, whose loop Triton pipelines
    itself (its loads are asynchronous copies)."""
    _, block_k, _, _, multiplier = CANDIDATES[candidate]
    if multiplier == "tensor cores":
        return 1
    block_m, _, step = tile(candidate, rows, blocksize)
    count = max(1, max(32, block_k // block_m) // step)
    while count > 1 and k % (step * count):
        count //= 2
    return count


def launch(x, weight: NF4Weight, bias, xa, lora_b, scaling, out, candidate: int, lookup: str):
    """(kernel, grid, arguments, constexprs and launch options) of a checked call: what
    ``nf4_lora_gemv`` launches, and what scripts/cuda_sass.py compiles for a GPU it does
    not have."""
    rows, (n, k) = x.shape[0], weight.shape
    block_m, block_n, block_k = tile(candidate, rows, weight.blocksize)
    _, _, warps, programs_per_sm, multiplier = CANDIDATES[candidate]
    tensor_cores = multiplier == "tensor cores"
    steps_per_iteration = steps(candidate, rows, weight.blocksize, k)
    bands, slices, k_per_slice, partials, counters = split_k.plan(
        x.device, rows, n, k, block_n, block_k * steps_per_iteration, programs_per_sm
    )
    epilogue_args, constants = epilogue_arguments(
        x, n, bias, xa, lora_b, scaling, out, partials, counters, slices
    )
    nested = weight.is_nested
    interpreter = interpreter_enabled()
    packed, absmax, _, nested_absmax, nested_code, offset = launch_arguments(weight)
    asm, levels = candidate_level_source(weight, candidate, lookup)
    arguments = (
        x,
        packed,
        absmax,
        nested_absmax,
        nested_code,
        offset,
        levels,
        k,
        k_per_slice,
        x.stride(0),
        *epilogue_args,
    )
    constants.update(
        BLOCKSIZE=weight.blocksize,
        NESTED=nested,
        NESTED_BLOCKSIZE=weight.nested_blocksize if nested else 1,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        INTERPRETER=interpreter,
        LOOKUP_ASM=asm,
        num_warps=warps,
    )
    if not tensor_cores:
        constants["STEPS"] = steps_per_iteration
    kernel = _nf4_lora_gemv_mma_kernel if tensor_cores else _nf4_lora_gemv_kernel
    return kernel, (bands, slices), arguments, constants


def nf4_lora_gemv(
    x: torch.Tensor,
    weight: NF4Weight,
    bias: torch.Tensor | None = None,
    xa: torch.Tensor | None = None,
    lora_b: torch.Tensor | None = None,
    scaling: float = 1.0,
    *,
    out: torch.Tensor | None = None,
    candidate: int = 0,
    lookup: str = "auto",
) -> torch.Tensor:
    """``x W^T + scaling xa B^T + bias`` for x of 1 to 8 rows and an NF4 weight W, in one
    launch, W dequantised in registers.

    Args:
        x: (M, K) in the weight's dtype.  weight: (N, K), rows of whole blocks (``supports``).
        bias: (N,) or None.  xa: (M, R), x times LoRA A transposed, or None.  lora_b: (N, R).
        scaling: the adapter's scale.  out: (M, N) to write into; a new tensor if None.
        candidate: which of ``CANDIDATES`` to launch with.
        lookup: how a code becomes its level: "registers" (byte permutes of immediates,
            level_lookup), "shuffle" (from the lane holding it, level_lookup), "table" (a
            load from ``level_source``'s table) or "auto" (shuffles on CUDA cores,
            permutes on tensor cores: ``candidate_lookup``).  The Triton interpreter runs
            no PTX and always reads the table.
    """
    if lookup not in LOOKUPS:
        raise ValueError(f"nf4_lora_gemv: lookup={lookup!r}; expected one of {LOOKUPS}")
    if not 0 <= candidate < len(CANDIDATES):
        raise ValueError(f"nf4_lora_gemv: candidate {candidate}; there are {len(CANDIDATES)} (CANDIDATES)")
    _check(x, weight, bias, xa, lora_b, candidate)
    if out is None:
        out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    if not use_triton(x):
        warn_reference_once("nf4_lora_gemv", x.device.type)
        return out.copy_(nf4_lora_gemv_reference(x, weight, bias, xa, lora_b, scaling))
    kernel, grid, arguments, constants = launch(x, weight, bias, xa, lora_b, scaling, out, candidate, lookup)
    kernel[grid](*arguments, **constants)
    return out
