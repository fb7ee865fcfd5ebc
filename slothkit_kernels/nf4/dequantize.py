"""Dequantisation of bitsandbytes NF4 weights (QLoRA's frozen base weights).

A weight of ``numel`` elements is cut, in row-major order, into blocks of
``blocksize`` elements (the last one may be short).  Element ``j`` is a 4-bit
code in byte ``j // 2`` of ``packed`` (even ``j`` in the high nibble) and

    w[j] = fp32(NF4[code_j] * absmax[j // blocksize])   rounded once to the output dtype.

With double quantisation ("compress_statistics") the block scales are stored as
uint8 codes ``q`` into a 256-entry table, one fp32 scale per ``nested_blocksize``
codes, and a scalar ``offset`` (the mean absmax, subtracted before quantising):

    absmax[b] = fp32(fp32(nested_code[q_b] * nested_absmax[b // nested_blocksize]) + offset)

This is the order of operations of bitsandbytes 0.50.2, which the results here
match bit for bit: ``dequantize_4bit`` first runs ``dequantize_blockwise`` on the
codes (one fp32 product), then ``absmax += offset`` (one fp32 add), then the 4-bit
kernel forms the fp32 product of level and scale and converts it to the output
dtype with round-to-nearest-even.  Two consequences for the kernel:

* the multiply-add of the nested scale must not be contracted into an FMA (one
  rounding instead of two), so the kernel is launched with
  ``enable_fp_fusion=False``;
* the fp32 product must be formed before the conversion to fp16/bf16, never in
  the narrow dtype.

One launch does everything: each program owns ``BLOCKS_PER_PROGRAM`` whole
quantisation blocks, dequantises their (possibly nested) scales once per block,
loads the blocks' packed bytes as a [blocks, blocksize / 2] tile, looks both
nibbles of every byte up in the 16-entry level table (a 64-byte gather that stays
in L1) and writes the two results as one 32-bit word (64-bit for fp32 output).
Loads and stores thus share one register layout: per thread 4 packed bytes in
and one 16-byte store out (2 bytes in for fp32), coalesced across the warp, with
no shuffle through shared memory (checked in the sm_90 PTX: ld.global.b32 and
st.global.v4.b32, no shared memory, no fma).  Dequantising the nested scales in
a separate launch would write and re-read 4 bytes per block (under 1% of the
traffic) and add a launch; fusing it costs three cached gathers per block.

Memory traffic per element: 0.5 byte of packed codes read, plus the output write
(2 bytes for fp16/bf16, 4 for fp32); the scales add 1/blocksize byte (nested) or
4/blocksize bytes.  A 14336 x 4096 bf16 weight (Llama-3-8B MLP) moves 29.4 MB
in and 117.4 MB out, 147.7 MB in all: about 31 us at the H200's 4.8 TB/s.

Under the Triton interpreter fp32 -> bf16 casts truncate, so there (only) the
kernel rounds to bf16 with integer arithmetic; on the GPU it uses the native
round-to-nearest-even conversion.

A column slab ``columns=(start, stop)`` dequantises ``w[:, start:stop]`` only, into a
dense (rows, stop - start) tensor: blocks run along rows, so when the row length and
both bounds are multiples of the block size every row's slab is whole blocks, and
output block ``b`` is source block ``(b // slab_blocks) * row_blocks + first_block +
b % slab_blocks``.  Backward uses it to dequantise a large weight a slab at a time
(lora/gemms.py, ``_input_gradient``).

There is no backward: the packed codes are frozen and not differentiable.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from slothkit_kernels.nf4.weight import NF4Weight
from slothkit_kernels.utils import (
    SUPPORTED_FLOAT_DTYPES,
    interpreter_enabled,
    use_triton,
    warn_reference_once,
)

# Block sizes bitsandbytes accepts for 4-bit quantisation.
VALID_BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)

# Weight elements dequantised by one program (a whole number of blocks), and the warps
# that share them: 64 elements per thread.  Swept on an H200 (scripts/tune_kernels.py nf4,
# results/kernels/h200-2026-12-01-nf4-launch-sweep.txt), a graphed dequantisation of a
# 14336 x 4096 bf16 weight takes 39.9 us at (4096, 2 warps), 40.2 at (8192, 4) and
# 49.2 at the earlier (8192, 8): 89% of the time of a plain fill of the output, which
# is the bound (2.5 bytes moved per element, 2 of them written).  The same setting is
# fastest or within 0.2 us of it on every weight shape of the benchmark models.
ELEMENTS_PER_PROGRAM = 4096
NUM_WARPS = 2


# --------------------------------------------------------------------------- reference


def _block_scales_reference(weight: NF4Weight) -> torch.Tensor:
    """The fp32 scale of every block, undoing double quantisation if present."""
    if not weight.is_nested:
        return weight.absmax.reshape(-1).float()
    codes = weight.absmax.reshape(-1).long()
    block = torch.arange(codes.numel(), device=codes.device) // weight.nested_blocksize
    nested_scale = weight.nested_absmax.reshape(-1).float()[block]
    # Two separate roundings, as bitsandbytes does: the product, then the offset.
    scales = weight.nested_code.float()[codes] * nested_scale
    return scales + _offset_tensor(weight.offset, codes.device)


def dequantize_nf4_reference(weight: NF4Weight) -> torch.Tensor:
    """Plain-torch dequantisation, bit-identical to bitsandbytes' ``dequantize_4bit``."""
    _check_weight(weight)
    numel = math.prod(weight.shape)
    packed = weight.packed.reshape(-1)
    codes = torch.stack((packed >> 4, packed & 0xF), dim=-1).reshape(-1)[:numel]  # (numel,)
    levels = weight.code.float()[codes.long()]
    block = torch.arange(numel, device=packed.device) // weight.blocksize
    values = levels * _block_scales_reference(weight)[block]  # fp32 product
    return values.to(weight.dtype).reshape(weight.shape)


# --------------------------------------------------------------------------- kernel


@triton.jit
def round_to_bf16(x):
    """fp32 -> bf16, round to nearest even, in integer arithmetic.

    The Triton interpreter truncates on fp32 -> bf16 casts, so under it this
    stands in for the GPU's native conversion (``cvt.rn.bf16.f32``).
    """
    bits = x.to(tl.uint32, bitcast=True)
    rounded = bits + 0x7FFF + ((bits >> 16) & 1)
    rounded = tl.where(x != x, 0x7FC00000, rounded)  # noqa: PLR0124 (keep NaN a NaN)
    return (rounded >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _to_bits(x, DTYPE: tl.constexpr, SOFTWARE_BF16_ROUNDING: tl.constexpr):
    """fp32 values rounded to DTYPE, returned as their bit patterns (uint32 / uint64)."""
    if DTYPE == tl.float32:
        bits = x.to(tl.uint32, bitcast=True).to(tl.uint64)
    elif SOFTWARE_BF16_ROUNDING:
        bits = round_to_bf16(x).to(tl.uint16, bitcast=True).to(tl.uint32)
    else:
        bits = x.to(DTYPE).to(tl.uint16, bitcast=True).to(tl.uint32)
    return bits


@triton.jit
def _dequantize_nf4_kernel(
    PACKED,  # pointer to the packed codes, uint8, two per byte, high nibble first
    ABSMAX,  # pointer to the block scales (float), or their uint8 codes when NESTED
    CODE,  # pointer to the 16 NF4 levels, fp32
    NESTED_ABSMAX,  # pointer to the fp32 scales of the absmax codes (read when NESTED)
    NESTED_CODE,  # pointer to the 256-entry table of the absmax codes (read when NESTED)
    OFFSET,  # pointer to the fp32 scalar added to every nested absmax (read when NESTED)
    OUT_PAIRS,  # pointer to the output's first 2 * n_pairs elements as int32 (int64 for fp32) pairs
    OUT,  # pointer to the output's elements, written only for the last one of an odd count
    n_bytes,  # packed bytes, ceil(numel / 2)
    n_pairs,  # complete output pairs, numel // 2
    n_blocks,  # quantisation blocks written, ceil(numel / BLOCKSIZE) of the output
    row_blocks,  # with COLUMN_SLAB: blocks per row of the whole weight
    slab_blocks,  # with COLUMN_SLAB: blocks per row of the slab
    first_block,  # with COLUMN_SLAB: the slab's first block within a row
    expert_blocks,  # with PER_EXPERT: blocks per expert (each expert's elements are whole blocks)
    expert_groups,  # with PER_EXPERT: nested scales per expert, ceil(expert_blocks / NESTED_BLOCKSIZE)
    BLOCKSIZE: tl.constexpr,  # weight elements per block scale (a power of two)
    BLOCKS_PER_PROGRAM: tl.constexpr,  # quantisation blocks handled by one program
    NESTED: tl.constexpr,  # whether the block scales are double-quantised
    NESTED_BLOCKSIZE: tl.constexpr,  # absmax codes per nested scale
    ODD_NUMEL: tl.constexpr,  # whether the last byte holds a single code
    STORE_PAIRS: tl.constexpr,  # output pairs per 16-byte store: 4 (fp16/bf16) or 2 (fp32)
    SOFTWARE_BF16_ROUNDING: tl.constexpr,  # round fp32 -> bf16 with integer ops (interpreter)
    COLUMN_SLAB: tl.constexpr,  # whether the output is a column slab of the weight
    PER_EXPERT: tl.constexpr,  # a stack of weights, each with its own nested scales and offset
):
    HALF: tl.constexpr = BLOCKSIZE // 2  # packed bytes per block
    DTYPE: tl.constexpr = OUT.dtype.element_ty
    pid = tl.program_id(0).to(tl.int64)
    out_blocks = pid * BLOCKS_PER_PROGRAM + tl.arange(0, BLOCKS_PER_PROGRAM)  # int64
    block_mask = out_blocks < n_blocks
    if COLUMN_SLAB:  # the source block of each output block (see the module docstring)
        blocks = (out_blocks // slab_blocks) * row_blocks + first_block + out_blocks % slab_blocks
    else:
        blocks = out_blocks

    if NESTED:
        q = tl.load(ABSMAX + blocks, mask=block_mask, other=0).to(tl.int32)
        level = tl.load(NESTED_CODE + q).to(tl.float32)
        if PER_EXPERT:  # expert e's groups start at e * expert_groups, its offset is OFFSET[e]
            expert = blocks // expert_blocks
            group = expert * expert_groups + (blocks - expert * expert_blocks) // NESTED_BLOCKSIZE
            offset = tl.load(OFFSET + expert, mask=block_mask, other=0.0).to(tl.float32)
        else:
            group = blocks // NESTED_BLOCKSIZE
            offset = tl.load(OFFSET).to(tl.float32)
        nested_scale = tl.load(NESTED_ABSMAX + group, mask=block_mask, other=0.0).to(tl.float32)
        # Rounded after the product and after the sum (no FMA: see the launch).
        scale = level * nested_scale + offset
    else:
        scale = tl.load(ABSMAX + blocks, mask=block_mask, other=0.0).to(tl.float32)

    # Byte i of the tile holds output elements 2i (high nibble) and 2i + 1 (low
    # nibble); both are written as one 2-element word at pair index i, so loads
    # and stores share one layout and both vectorise.
    byte_offsets = out_blocks[:, None] * HALF + tl.arange(0, HALF)[None, :]  # (BLOCKS, HALF)
    # Hint the load to STORE_PAIRS bytes per thread: the 16-byte stores of the
    # pairs then use the load's layout, with no shuffle through shared memory.
    byte_offsets = tl.max_contiguous(byte_offsets, [1, STORE_PAIRS])
    if COLUMN_SLAB:  # read from the source blocks, write densely
        source_offsets = blocks[:, None] * HALF + tl.arange(0, HALF)[None, :]
        source_offsets = tl.max_contiguous(source_offsets, [1, STORE_PAIRS])
        packed = tl.load(PACKED + source_offsets, mask=block_mask[:, None], other=0)
    else:
        packed = tl.load(PACKED + byte_offsets, mask=byte_offsets < n_bytes, other=0)
    high = tl.load(CODE + (packed >> 4).to(tl.int32)).to(tl.float32) * scale[:, None]
    low = tl.load(CODE + (packed & 0xF).to(tl.int32)).to(tl.float32) * scale[:, None]

    high_bits = _to_bits(high, DTYPE, SOFTWARE_BF16_ROUNDING)
    low_bits = _to_bits(low, DTYPE, SOFTWARE_BF16_ROUNDING)
    if DTYPE == tl.float32:
        pairs = (high_bits | (low_bits << 32)).to(tl.int64, bitcast=True)
    else:
        pairs = (high_bits | (low_bits << 16)).to(tl.int32, bitcast=True)
    tl.store(OUT_PAIRS + byte_offsets, pairs, mask=byte_offsets < n_pairs)

    if ODD_NUMEL:  # the final byte's high nibble is the last element, unpaired
        if DTYPE == tl.float32:
            lone = high_bits.to(tl.uint32).to(tl.float32, bitcast=True)
        else:
            lone = high_bits.to(tl.uint16).to(DTYPE, bitcast=True)
        tl.store(OUT + 2 * byte_offsets, lone, mask=byte_offsets == n_pairs)


# --------------------------------------------------------------------------- checks


def _offset_tensor(offset, device: torch.device) -> torch.Tensor:
    """The nested offset as a one-element fp32 tensor on ``device``, never read on the host."""
    return torch.as_tensor(offset, dtype=torch.float32, device=device).reshape(1)


def _check_weight(weight: NF4Weight) -> None:
    if not isinstance(weight, NF4Weight):
        raise TypeError(f"weight must be an NF4Weight, got {type(weight).__name__}")
    packed = weight.packed
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8:
        got = packed.dtype if isinstance(packed, torch.Tensor) else type(packed).__name__
        raise TypeError(
            f"weight.packed must be a uint8 tensor, got {got}; a weight quantised with "
            f"another quant_storage can be passed as packed.view(torch.uint8)"
        )
    if weight.dtype not in SUPPORTED_FLOAT_DTYPES:
        raise TypeError(f"weight.dtype is {weight.dtype}; supported: float32, float16, bfloat16")
    if weight.blocksize not in VALID_BLOCKSIZES:
        raise ValueError(f"weight.blocksize is {weight.blocksize}; supported: {VALID_BLOCKSIZES}")
    numel = math.prod(weight.shape)
    if numel == 0:
        raise ValueError(f"weight.shape {tuple(weight.shape)} is empty")
    if packed.numel() != (numel + 1) // 2:
        raise ValueError(
            f"weight.packed has {packed.numel()} bytes but shape {tuple(weight.shape)} "
            f"needs {(numel + 1) // 2} (two 4-bit codes per byte)"
        )
    code = weight.code
    if not isinstance(code, torch.Tensor) or code.numel() != 16 or not code.is_floating_point():
        raise ValueError("weight.code must be a float tensor holding the 16 NF4 levels")

    n_blocks = -(-numel // weight.blocksize)
    if weight.absmax.numel() != n_blocks:
        raise ValueError(
            f"weight.absmax has {weight.absmax.numel()} entries but {numel} elements in "
            f"blocks of {weight.blocksize} need {n_blocks}"
        )
    tensors = {"packed": packed, "absmax": weight.absmax, "code": code}
    if weight.is_nested:
        _check_nested(weight, n_blocks)
        tensors["nested_absmax"] = weight.nested_absmax
        tensors["nested_code"] = weight.nested_code
    else:
        if not weight.absmax.is_floating_point():
            raise TypeError(
                f"weight.absmax has dtype {weight.absmax.dtype}; without double "
                f"quantisation (nested_absmax is None) it must hold float scales"
            )
        if weight.nested_code is not None:
            raise ValueError("weight.nested_code is set but weight.nested_absmax is None")
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        listing = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise ValueError(f"the tensors of weight must be on one device, got {listing}")


def _check_nested(weight: NF4Weight, n_blocks: int) -> None:
    if weight.absmax.dtype != torch.uint8:
        raise TypeError(
            f"weight.absmax has dtype {weight.absmax.dtype}; with double quantisation "
            f"it must hold uint8 codes"
        )
    if weight.nested_code is None or weight.nested_code.numel() != 256:
        raise ValueError("weight.nested_code must hold the 256 levels of the absmax codes")
    if not weight.nested_code.is_floating_point() or not weight.nested_absmax.is_floating_point():
        raise TypeError("weight.nested_code and weight.nested_absmax must be float tensors")
    if weight.offset is None:
        raise ValueError("weight.offset is required with double quantisation")
    nested_blocksize = weight.nested_blocksize
    if not isinstance(nested_blocksize, int) or nested_blocksize <= 0:
        raise ValueError(f"weight.nested_blocksize must be a positive int, got {nested_blocksize!r}")
    n_nested = -(-n_blocks // nested_blocksize)
    if weight.nested_absmax.numel() != n_nested:
        raise ValueError(
            f"weight.nested_absmax has {weight.nested_absmax.numel()} entries but "
            f"{n_blocks} absmax codes in blocks of {nested_blocksize} need {n_nested}"
        )


def _check_out(out: torch.Tensor, weight: NF4Weight, shape: torch.Size) -> None:
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a tensor, got {type(out).__name__}")
    if out.shape != shape or out.dtype != weight.dtype:
        raise ValueError(
            f"out has shape {tuple(out.shape)} and dtype {out.dtype}; expected shape "
            f"{tuple(shape)} and dtype {weight.dtype}"
        )
    if out.device != weight.device:
        raise ValueError(f"out is on {out.device} but weight is on {weight.device}")
    if not out.is_contiguous():
        raise ValueError("out must be contiguous")
    if out.storage_offset() % 2:
        # The kernel writes element pairs as single words, so they must be aligned.
        raise ValueError(f"out starts at storage offset {out.storage_offset()}; it must be even")


def _check_columns(weight: NF4Weight, columns) -> None:
    cols = math.prod(weight.shape[1:])
    if len(weight.shape) != 2 or cols % weight.blocksize:
        raise ValueError(
            f"a column slab needs a 2-D weight whose rows are whole blocks; this one has "
            f"shape {tuple(weight.shape)} and blocks of {weight.blocksize}"
        )
    start, stop = columns
    if not (0 <= start < stop <= cols) or start % weight.blocksize or stop % weight.blocksize:
        raise ValueError(
            f"columns={tuple(columns)} must satisfy 0 <= start < stop <= {cols} with both "
            f"multiples of the block size {weight.blocksize}"
        )


def checked(weight: NF4Weight) -> NF4Weight:
    """``weight``, checked: once per record (a record describes frozen tensors, and the
    check is done when its kernel arguments are built), so not at every call."""
    if getattr(weight, "launch_cache", None) is None:
        _check_weight(weight)
        launch_arguments(weight)
    return weight


def launch_arguments(weight: NF4Weight) -> tuple[torch.Tensor, ...]:
    """The record's tensors as flat kernel arguments: packed, absmax, code, nested_absmax,
    nested_code, offset.  Built once per record (``weight.launch_cache``); the record must
    have been checked.  Unused pointers still need a tensor: without double quantisation
    the last three are absmax, which the kernels then never read through them."""
    if weight.launch_cache is None:
        nested = weight.is_nested
        absmax = weight.absmax.reshape(-1).contiguous()
        weight.launch_cache = (
            weight.packed.reshape(-1).contiguous(),
            absmax,
            weight.code.reshape(-1).float().contiguous(),
            weight.nested_absmax.reshape(-1).contiguous() if nested else absmax,
            weight.nested_code.reshape(-1).contiguous() if nested else absmax,
            _offset_tensor(weight.offset, weight.device) if nested else absmax,
        )
    return weight.launch_cache


# --------------------------------------------------------------------------- public


def dequantize_nf4(
    weight: NF4Weight, out: torch.Tensor | None = None, columns: tuple[int, int] | None = None
) -> torch.Tensor:
    """Dequantise an NF4 weight to a tensor of ``weight.shape`` and ``weight.dtype``.

    Bit-identical to ``bitsandbytes.functional.dequantize_4bit(packed, quant_state)``.
    ``out``, if given, must be a contiguous tensor of that shape, dtype and device;
    it is filled and returned, so a buffer can be reused across layers.
    ``columns=(start, stop)`` dequantises the column slab ``w[:, start:stop]`` only, as
    a contiguous (rows, stop - start) tensor; the row length and both bounds must be
    multiples of ``weight.blocksize`` (``NF4Weight.column_slabs`` picks such ranges).
    """
    checked(weight)
    rows, cols = weight.shape[0], math.prod(weight.shape[1:])
    if columns is not None:
        _check_columns(weight, columns)
        if columns == (0, cols):
            columns = None
    shape = weight.shape if columns is None else torch.Size((rows, columns[1] - columns[0]))
    if out is not None:
        _check_out(out, weight, shape)
    if not use_triton(weight.packed):
        warn_reference_once("dequantize_nf4", weight.device.type)
        result = dequantize_nf4_reference(weight)
        if columns is not None:
            result = result.reshape(rows, cols)[:, columns[0] : columns[1]].contiguous()
        return result if out is None else out.copy_(result)

    device = weight.device
    if out is None:
        out = torch.empty(shape, dtype=weight.dtype, device=device)
    numel = out.numel()
    n_pairs = numel // 2
    n_blocks = -(-numel // weight.blocksize)
    blocks_per_program = max(1, ELEMENTS_PER_PROGRAM // weight.blocksize)
    nested = weight.is_nested
    flat_out = out.view(-1)
    pair_dtype = torch.int64 if weight.dtype == torch.float32 else torch.int32
    out_pairs = flat_out[: 2 * n_pairs].view(pair_dtype)  # (n_pairs,) element pairs
    grid = (triton.cdiv(n_blocks, blocks_per_program),)
    _dequantize_nf4_kernel[grid](
        *launch_arguments(weight),
        out_pairs,
        flat_out,
        (numel + 1) // 2,
        n_pairs,
        n_blocks,
        cols // weight.blocksize,
        0 if columns is None else (columns[1] - columns[0]) // weight.blocksize,
        0 if columns is None else columns[0] // weight.blocksize,
        1,
        1,
        BLOCKSIZE=weight.blocksize,
        BLOCKS_PER_PROGRAM=blocks_per_program,
        NESTED=nested,
        NESTED_BLOCKSIZE=weight.nested_blocksize if nested else 1,
        ODD_NUMEL=numel % 2 == 1,
        STORE_PAIRS=16 // pair_dtype.itemsize,
        SOFTWARE_BF16_ROUNDING=weight.dtype == torch.bfloat16 and interpreter_enabled(),
        COLUMN_SLAB=columns is not None,
        PER_EXPERT=False,
        num_warps=NUM_WARPS,
        # bitsandbytes rounds the nested product before adding the offset; an FMA
        # would round once and change the last bit of some scales.
        enable_fp_fusion=False,
    )
    return out
