"""A LoRA projection of a few rows on an NF4 weight, dequantised in registers:

    y = x W^T + s (x A^T) B^T + bias          x: (M, K), M <= 8;  W: (N, K) in NF4

W is never written out: each program reads a band of BLOCK_N rows of the packed codes
(half a byte per weight) and their block scales once and accumulates, for every row of x,

    y[m, n] = sum over the blocks b of row n:  scale_b * sum_{k in b} x[m, k] * NF4[code(n, k)]

in fp32, the nested scale's product and sum rounded separately as bitsandbytes rounds
them.  The epilogue adds the adapter's second product ``s xa B^T`` and the bias and
rounds once (lora_gemv.py's ``epilogue``), and K may be cut into slices (split_k.py), as
in the 16-bit lora_gemv.  This moves about a quarter of a 16-bit weight's bytes.

Numbers.  The weights are the exact products level x scale, not rounded to the 16-bit
dtype as ``dequantize_nf4`` (and bitsandbytes' dequantisation) rounds them before a
matmul: the result differs from ``F.linear(x, dequantize_nf4(W))`` by that rounding of
the weights (relative 2^-9 in bf16, random in sign, so far less in a sum over K) and the
order of the fp32 additions, below the output's own rounding.  bitsandbytes' 4-bit GEMV
multiplies in the 16-bit dtype and differs more.

Instructions, not bytes, bound a dequantising GEMV at one row: an H200 must turn about
ten trillion codes a second (4.8 TB/s at half a byte each) into products to keep up with
its memory.  So a packed byte's two weights cost a multiply and two fused multiply-adds
(x_even * level_high + x_odd * level_low, times the row's scale, into the accumulator),
nothing rounded to 16 bits, and its two levels come from one 8-byte load from a
256-entry table of level pairs (2 KB, held in L1; ``level_pairs``) rather than two
lookups.  That load is a gather across a warp, and on the H200 it bounds the kernel
below bitsandbytes' GEMV (docs/inference.md has the figures).

Layout.  Byte j of a row's packed codes holds columns 2j (high nibble) and 2j + 1 (low
nibble), so a step loads a (BLOCK_N, BLOCK_K / 2) tile of bytes and x's even and odd
columns separately (x is a few KB and stays in cache), and multiplies the high nibbles'
levels by the even columns and the low ones' by the odd.  BLOCK_K divides the
quantisation block and the row length is whole blocks (``supports``), so every row's
tile in a step lies in one block: one scale per row per step.

bitsandbytes reads an NF4 weight for one row with its own GEMV and, for more rows,
dequantises it whole and multiplies; which of those and this kernel's candidates is
faster depends on the GPU and the shape, so the decode path times them once per shape
and keeps the fastest (slothkit.inference.gemv_choice).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slothkit_kernels import split_k
from slothkit_kernels.lora_gemv import (
    MAX_ROWS,
    check_low_rank,
    epilogue,
    epilogue_arguments,
    lora_gemv_reference,
)
from slothkit_kernels.nf4 import checked, dequantize_nf4_reference, launch_arguments
from slothkit_kernels.nf4_weight import NF4Weight
from slothkit_kernels.utils import interpreter_enabled, use_triton, warn_reference_once

# (BLOCK_N, BLOCK_K, num_warps, programs per SM) to try per shape; BLOCK_K is capped at
# the quantisation block (64 in QLoRA's default), programs per SM 0 = no split of K.
CANDIDATES = (
    (32, 64, 4, 0),
    (64, 64, 4, 0),
    (128, 64, 8, 0),
    (16, 128, 4, 0),
    (32, 64, 4, 4),
    (64, 64, 4, 4),
    (16, 64, 2, 8),
    (32, 128, 4, 8),
)


@triton.jit
def _product_then_sum(a, b, c):
    """fp32(fp32(a * b) + c), never one FMA: explicit .rn operations are not contracted
    (and, unlike libdevice's, keep denormals)."""
    return tl.inline_asm_elementwise(
        "{ .reg .f32 t; mul.rn.f32 t, $1, $2; add.rn.f32 $0, t, $3; }",
        "=f,f,f,f",
        [a, b, c + tl.zeros_like(a)],
        dtype=tl.float32,
        is_pure=True,
        pack=1,
    )


@triton.jit
def _nf4_lora_gemv_kernel(
    X,  # (M, K), rows stride_xm apart, contiguous along K
    PACKED,  # (N * K / 2,) uint8 codes, row-major, high nibble first
    ABSMAX,  # fp32 block scales, or their uint8 codes when NESTED
    CODE,  # the 16 NF4 levels, fp32 (unused: LEVEL_PAIRS holds them)
    NESTED_ABSMAX,  # fp32 scales of the absmax codes (NESTED)
    NESTED_CODE,  # the 256 levels of the absmax codes (NESTED)
    OFFSET,  # fp32 scalar added to every nested scale (NESTED)
    LEVEL_PAIRS,  # (256,) int64: byte b -> bits of NF4[b >> 4] | bits of NF4[b & 15] << 32
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
):
    HALF: tl.constexpr = BLOCK_K // 2  # packed bytes per row per step
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_j = tl.arange(0, HALF)
    n_mask = offs_n < N
    m_mask = offs_m < M
    row_start = offs_n.to(tl.int64) * K  # each row's first weight in the flat order
    rows_x = X + offs_m.to(tl.int64)[:, None] * stride_xm
    if NESTED:
        offset = tl.load(OFFSET)
    k_start = pid_k * k_per_slice
    k_stop = tl.minimum(k_start + k_per_slice, K)
    acc3 = tl.zeros((BLOCK_M, BLOCK_N, HALF), dtype=tl.float32)
    for k0 in range(k_start, k_stop, BLOCK_K):
        block = (row_start + k0) // BLOCKSIZE  # (BLOCK_N,): the step's block of each row
        if NESTED:
            level = tl.load(NESTED_CODE + tl.load(ABSMAX + block, mask=n_mask, other=0).to(tl.int32))
            nested_scale = tl.load(NESTED_ABSMAX + block // NESTED_BLOCKSIZE, mask=n_mask, other=0.0)
            if INTERPRETER:  # which never contracts the two
                scale = level * nested_scale + offset
            else:  # product and sum rounded separately, as bitsandbytes does
                scale = _product_then_sum(level, nested_scale, offset)
        else:
            scale = tl.load(ABSMAX + block, mask=n_mask, other=0.0).to(tl.float32)
        packed = tl.load(
            PACKED + (row_start[:, None] + k0) // 2 + offs_j[None, :], mask=n_mask[:, None], other=0
        )
        pairs = tl.load(LEVEL_PAIRS + packed.to(tl.int32))  # (BLOCK_N, HALF) int64
        high = pairs.to(tl.int32).to(tl.float32, bitcast=True)  # levels of columns k0 + 2j
        low = (pairs >> 32).to(tl.int32).to(tl.float32, bitcast=True)  # and of k0 + 2j + 1
        columns = k0 + 2 * offs_j
        x_even = tl.load(rows_x + columns[None, :], mask=m_mask[:, None], other=0.0).to(tl.float32)
        x_odd = tl.load(rows_x + columns[None, :] + 1, mask=m_mask[:, None], other=0.0).to(tl.float32)
        # Summed along K once after the loop: no reduction across threads per step.
        pair_sums = x_even[:, None, :] * high[None, :, :] + x_odd[:, None, :] * low[None, :, :]
        acc3 += pair_sums * scale[None, :, None]
    acc = tl.sum(acc3, axis=2)  # (BLOCK_M, BLOCK_N)
    epilogue(acc, offs_m, offs_n, m_mask, n_mask, pid_n, pid_k, XA, B, BIAS, Y, PARTIALS, COUNTERS, M, N, R,
             slices, stride_xam, stride_bn, stride_ym, scaling, SPLIT, HAS_LORA, HAS_BIAS, BLOCK_R)  # fmt: skip


def level_pairs(weight: NF4Weight) -> torch.Tensor:
    """The (256,) int64 table the kernel reads both levels of a packed byte from: the fp32
    bits of NF4[b >> 4] (the high nibble, the even column) in the low word, those of
    NF4[b & 15] in the high one.  Made once per record; copies made by ``with_packed``
    share it."""
    if weight.level_pairs is None:
        bits = weight.code.reshape(-1).float().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        byte = torch.arange(256, device=bits.device)
        weight.level_pairs = bits[byte >> 4] | (bits[byte & 15] << 32)
    return weight.level_pairs


def supports(weight: NF4Weight) -> bool:
    """Whether ``nf4_lora_gemv`` reads this weight: 2-D, rows of whole quantisation blocks."""
    return len(weight.shape) == 2 and weight.shape[1] % weight.blocksize == 0


def nf4_lora_gemv_reference(x, weight: NF4Weight, bias=None, xa=None, lora_b=None, scaling: float = 1.0):
    """The same from the dequantised weight (bitsandbytes' bits, rounded to the dtype), in
    fp32, rounded once: within the output's rounding of the kernel's result."""
    return lora_gemv_reference(x, dequantize_nf4_reference(weight), bias, xa, lora_b, scaling)


def _check(x, weight: NF4Weight, bias, xa, lora_b) -> None:
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
    """(BLOCK_M, BLOCK_N, BLOCK_K) a candidate launches with: the rows padded to a power
    of two, BLOCK_K halved as they double (down to 32) so that the (rows, BLOCK_N,
    BLOCK_K / 2) tile accumulated in registers stays the same size, and within a block."""
    block_n, block_k, _, _ = CANDIDATES[candidate]
    block_m = triton.next_power_of_2(rows)
    return block_m, block_n, min(blocksize, max(32, block_k // block_m))


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
) -> torch.Tensor:
    """``x W^T + scaling xa B^T + bias`` for x of 1 to 8 rows and an NF4 weight W, in one
    launch, W dequantised in registers.

    Args:
        x: (M, K) in the weight's dtype.  weight: (N, K), rows of whole blocks (``supports``).
        bias: (N,) or None.  xa: (M, R), x times LoRA A transposed, or None.  lora_b: (N, R).
        scaling: the adapter's scale.  out: (M, N) to write into; a new tensor if None.
        candidate: which of ``CANDIDATES`` to launch with.
    """
    _check(x, weight, bias, xa, lora_b)
    rows, (n, k) = x.shape[0], weight.shape
    if out is None:
        out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if not use_triton(x):
        warn_reference_once("nf4_lora_gemv", x.device.type)
        return out.copy_(nf4_lora_gemv_reference(x, weight, bias, xa, lora_b, scaling))
    block_m, block_n, block_k = tile(candidate, rows, weight.blocksize)
    _, _, warps, programs_per_sm = CANDIDATES[candidate]
    bands, slices, k_per_slice, partials, counters = split_k.plan(
        x.device, rows, n, k, block_n, block_k, programs_per_sm
    )
    arguments, constants = epilogue_arguments(
        x, n, bias, xa, lora_b, scaling, out, partials, counters, slices
    )
    nested = weight.is_nested
    _nf4_lora_gemv_kernel[(bands, slices)](
        x,
        *launch_arguments(weight),
        level_pairs(weight),
        k,
        k_per_slice,
        x.stride(0),
        *arguments,
        **constants,
        BLOCKSIZE=weight.blocksize,
        NESTED=nested,
        NESTED_BLOCKSIZE=weight.nested_blocksize if nested else 1,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        INTERPRETER=interpreter_enabled(),
        num_warps=warps,
    )
    return out
