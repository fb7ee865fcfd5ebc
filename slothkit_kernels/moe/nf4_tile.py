"""A tile of one expert's NF4 weight, dequantised in registers inside a GEMM's K loop.

Element (n, k) of the tile is element j = n * sn + k * sk of the expert's stored matrix
(``NF4Experts.element_strides``), so one code path reads (out, in) and (in, out) storage
and the transposed weight of the backward.  Each element gathers its byte, its block's
scale code, its group's scale and the expert's offset; the scales are formed as
bitsandbytes forms them (nf4_experts.py): fp32(fp32(nested_code[q] * group_scale) +
offset), the launch keeping the product and the sum apart (``enable_fp_fusion=False``),
then the fp32 product with the level, rounded once to the record's dtype.  The gathers
of a tile's scales hit a few cached bytes: a tile of BLOCK_K x BLOCK_N elements spans
BLOCK_K * BLOCK_N / 64 blocks when K is contiguous.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def nf4_weight_tile(
    PACKED,  # pointer to the expert's packed codes, uint8, two per byte, high nibble first
    ABSMAX,  # pointer to the expert's uint8 codes of its block scales
    NESTED_ABSMAX,  # pointer to the expert's fp32 scales of those codes, one per group
    NESTED_CODE,  # pointer to the 256 levels of the scale codes, fp32
    CODE,  # pointer to the 16 NF4 levels, fp32
    offset,  # the expert's fp32 offset of its block scales
    flat,  # int64 tile: the flat index of each element in the expert's stored matrix
    mask,  # the tile's elements that exist
    BLOCKSIZE: tl.constexpr,  # elements per block scale
    NESTED_BLOCKSIZE: tl.constexpr,  # block scales per group scale
    DTYPE: tl.constexpr,  # the record's dtype, which each value is rounded to
):
    """The tile's weights in DTYPE, 0 where masked."""
    byte = tl.load(PACKED + (flat >> 1), mask=mask, other=0)
    nibble = tl.where((flat & 1) == 0, byte >> 4, byte & 0xF).to(tl.int32)
    level = tl.load(CODE + nibble)
    block = flat // BLOCKSIZE
    q = tl.load(ABSMAX + block, mask=mask, other=0).to(tl.int32)
    group_scale = tl.load(NESTED_ABSMAX + block // NESTED_BLOCKSIZE, mask=mask, other=0.0)
    scale = tl.load(NESTED_CODE + q) * group_scale + offset  # rounded twice: see the launch
    return tl.where(mask, level * scale, 0.0).to(DTYPE)
