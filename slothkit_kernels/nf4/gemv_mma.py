"""nf4_lora_gemv's tensor-core kernel: the NF4 weight's levels looked up in 16 bits and
multiplied by x on the tensor cores, one to eight rows padded to sixteen.

The CUDA-core kernel (gemv.py) spends a fused multiply-add per weight per row of x
and about six integer instructions per weight to make an exact fp32 level; at eight rows
the multiply-adds alone are two per weight per row.  Here each step looks a tile of
codes up as bf16 (or fp16) levels, 22 integer instructions per eight codes
(level_lookup.py at 16 bits), and hands the products to the tensor cores:

    part = levels_high (BLOCK_N, BLOCK_K/2) @ x_even^T (BLOCK_K/2, 16)
         + levels_low  (BLOCK_N, BLOCK_K/2) @ x_odd^T  (BLOCK_K/2, 16)     fp32
    acc += part * scale                 (the step lies in one quantisation block)

so the high nibbles (the even columns) and the low ones (the odd) are two products and
the codes are never reordered.  x's rows beyond M are zeros (masked loads) and its
padded rows' outputs are never stored; the tensor cores do 16 rows' work for M of them,
which costs nothing they are short of.  acc is (BLOCK_N, 16); its transpose is the
(BLOCK_M, BLOCK_N) tile lora_gemv's epilogue takes (adapter, bias, split-K, one rounding).

Numbers.  The weight is bf16(level) x scale: the level rounded once to the 16-bit dtype
(relative 2^-9 in bf16, 2^-11 in fp16), where bitsandbytes rounds level x scale, a
rounding of the same size; products and sums are fp32.  A weight that dequantises to
fp32 has no 16-bit MMA here: nf4_gemv's CUDA-core kernel serves it.

Under the Triton interpreter (no PTX) the levels come from a 16-entry table of their
16-bit values, and the products are made in fp32 (the interpreter's 16-bit arithmetic is
not the GPU's): the same numbers, the 16-bit products being exact in fp32.
"""

from __future__ import annotations

import triton
import triton.language as tl

from slothkit_kernels.lora.gemv import epilogue
from slothkit_kernels.nf4 import level_lookup
from slothkit_kernels.nf4.scales import block_scale

_LOOKUP_CONSTRAINTS = tl.constexpr(level_lookup.constraints(16))


@triton.jit
def tensor_core_band(
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
):
    """x W^T over one band of the NF4 weight's rows (offs_n) and the columns
    k_start..k_stop, in fp32: (BLOCK_M, BLOCK_N).  The arguments are the kernel's; the
    levels are in x's dtype (the weight's)."""
    HALF: tl.constexpr = BLOCK_K // 2  # packed bytes per row per step
    level_dtype = X.dtype.element_ty
    # Pointers at column 0: a step adds only its column.
    row_blocks = offs_n.to(tl.int64) * (K // BLOCKSIZE)
    packed_rows = PACKED + offs_n.to(tl.int64)[:, None] * (K // 2) + tl.arange(0, HALF)[None, :]
    x_rows = X + offs_m.to(tl.int64)[:, None] * stride_xm + tl.arange(0, BLOCK_K)[None, :]
    offset = tl.load(OFFSET) if NESTED else 0.0
    if LOOKUP_ASM != "":  # half the table in registers for the whole program
        words = LEVELS + level_lookup.lane() * 4
        t0, t1, t2, t3 = tl.load(words), tl.load(words + 1), tl.load(words + 2), tl.load(words + 3)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(k_start, k_stop, BLOCK_K):
        block = row_blocks + k0 // BLOCKSIZE  # (BLOCK_N,): the step's block of each row
        scale = block_scale(ABSMAX, NESTED_ABSMAX, NESTED_CODE, offset, block, n_mask, NESTED, NESTED_BLOCKSIZE,
                            INTERPRETER)  # fmt: skip
        packed = tl.load(packed_rows + k0 // 2, mask=n_mask[:, None], other=0)  # (BLOCK_N, HALF)
        x = tl.load(x_rows + k0, mask=m_mask[:, None], other=0.0)  # (BLOCK_M, BLOCK_K)
        x_even, x_odd = tl.split(tl.reshape(x, (BLOCK_M, HALF, 2)))  # columns k0 + 2j, + 1
        if LOOKUP_ASM != "":  # levels of columns k0 + 2j (high) and k0 + 2j + 1 (low)
            high, low = tl.inline_asm_elementwise(
                LOOKUP_ASM, _LOOKUP_CONSTRAINTS, [packed, t0, t1, t2, t3],
                dtype=(level_dtype, level_dtype), is_pure=True, pack=4,
            )  # fmt: skip
        else:
            high = tl.load(LEVELS + (packed >> 4).to(tl.int32))
            low = tl.load(LEVELS + (packed & 15).to(tl.int32))
        if INTERPRETER:  # fp32 products of the same 16-bit values: exact, as the tensor cores' are
            part = tl.dot(high.to(tl.float32), tl.trans(x_even.to(tl.float32)), input_precision="ieee")
            part = tl.dot(low.to(tl.float32), tl.trans(x_odd.to(tl.float32)), part, input_precision="ieee")
        else:
            part = tl.dot(high, tl.trans(x_even))
            part = tl.dot(low, tl.trans(x_odd), part)
        acc += part * scale[:, None]
    return tl.trans(acc)


@triton.jit
def _nf4_lora_gemv_mma_kernel(
    X,  # (M, K), rows stride_xm apart, contiguous along K
    PACKED,  # (N * K / 2,) uint8 codes, row-major, high nibble first
    ABSMAX,  # fp32 block scales, or their uint8 codes when NESTED
    NESTED_ABSMAX,  # fp32 scales of the absmax codes (NESTED)
    NESTED_CODE,  # the 256 levels of the absmax codes (NESTED)
    OFFSET,  # fp32 scalar added to every nested scale (NESTED)
    LEVELS,  # LOOKUP_ASM's 4 int32 table words, a copy per lane; else the 16 levels, 16-bit
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
    BLOCK_M: tl.constexpr,  # 16: the rows of x, padded
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    INTERPRETER: tl.constexpr,  # no inline PTX
    LOOKUP_ASM: tl.constexpr,  # PTX turning packed bytes into 16-bit levels, or "" (table)
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    n_mask = offs_n < N
    m_mask = offs_m < M
    k_start = pid_k * k_per_slice
    k_stop = tl.minimum(k_start + k_per_slice, K)
    acc = tensor_core_band(X, PACKED, ABSMAX, NESTED_ABSMAX, NESTED_CODE, OFFSET, LEVELS, K, k_start, k_stop,
                           stride_xm, offs_m, offs_n, m_mask, n_mask, BLOCKSIZE, NESTED, NESTED_BLOCKSIZE,
                           BLOCK_M, BLOCK_N, BLOCK_K, INTERPRETER, LOOKUP_ASM)  # fmt: skip
    epilogue(acc, offs_m, offs_n, m_mask, n_mask, pid_n, pid_k, XA, B, BIAS, Y, PARTIALS, COUNTERS,
             M, N, R, slices, stride_xam, stride_bn, stride_ym, scaling, SPLIT, HAS_LORA, HAS_BIAS, BLOCK_R)  # fmt: skip
