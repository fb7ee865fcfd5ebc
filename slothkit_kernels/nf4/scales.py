"""An NF4 weight's block scales inside a kernel, as bitsandbytes computes them.

A block's scale is its absmax, fp32; with double quantisation the absmax is itself a
uint8 code of a 256-entry table with an fp32 scale per group of NESTED_BLOCKSIZE blocks
and an offset:

    scale = fp32(fp32(NESTED_CODE[absmax_code] * nested_absmax[block // NESTED_BLOCKSIZE]) + offset)

rounded after the product and after the sum, never fused into one FMA, as bitsandbytes
rounds them (weight.py).  The decode GEMVs (gemv.py, gemv_mma.py) read one
scale per row per step.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def product_then_sum(a, b, c):
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
def block_scale(
    ABSMAX,  # fp32 block scales, or their uint8 codes when NESTED
    NESTED_ABSMAX,  # fp32 scales of the absmax codes (NESTED)
    NESTED_CODE,  # the 256 levels of the absmax codes (NESTED)
    offset,  # fp32 added to every nested scale (NESTED)
    block,  # (BLOCK_N,) int64: the block of each row
    n_mask,
    NESTED: tl.constexpr,
    NESTED_BLOCKSIZE: tl.constexpr,
    INTERPRETER: tl.constexpr,  # no inline PTX; it never contracts a product and a sum
):
    """The fp32 scale of each row's block (0 where masked)."""
    if NESTED:
        level = tl.load(NESTED_CODE + tl.load(ABSMAX + block, mask=n_mask, other=0).to(tl.int32))
        nested_scale = tl.load(NESTED_ABSMAX + block // NESTED_BLOCKSIZE, mask=n_mask, other=0.0)
        if INTERPRETER:
            scale = level * nested_scale + offset
        else:
            scale = product_then_sum(level, nested_scale, offset)
    else:
        scale = tl.load(ABSMAX + block, mask=n_mask, other=0.0).to(tl.float32)
    return scale
