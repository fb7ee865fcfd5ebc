"""A run of an NF4Experts record's experts dequantised to a dense 16-bit stack in one launch.

The grouped GEMMs of 4-bit experts (grouped_gemm.py) multiply a dense copy of a few
experts' weights at a time, made here: every expert's tile is read by each of the row
tiles routed to it (about M / (E * BLOCK_M) of them, 4 for Qwen3-30B-A3B's 128 experts at
4,096 tokens), so decoding in the GEMM would redo the gathers that many times and keep
them out of the software pipeline, while this pass decodes each element once at the
memory bandwidth (0.5 byte read and 2 written per bf16 element).

Experts ``first .. stop - 1`` of the record are one flat run of packed bytes and block
codes (the record's tensors are stacked along their first dimension), so the launch is
slothkit_kernels.nf4's dequantisation kernel over that run with ``PER_EXPERT``: block b
belongs to expert b // expert_blocks, whose group scales start at expert * groups and
whose offset is its own.  That needs each expert's element count to be whole blocks, as
every expert shape of the released models is (their rows and columns are multiples of
64); other records are dequantised an expert at a time in plain torch.
"""

from __future__ import annotations

import functools
import warnings

import torch
import triton

from slothkit_kernels.moe.nf4_experts import NF4Experts
from slothkit_kernels.nf4.dequantize import ELEMENTS_PER_PROGRAM, NUM_WARPS, _dequantize_nf4_kernel
from slothkit_kernels.utils import interpreter_enabled, use_triton, warn_reference_once


@functools.cache
def _warn_partial_blocks_once(rows: int, cols: int, blocksize: int) -> None:
    warnings.warn(
        f"slothkit_kernels.dequantize_nf4_experts: an expert of ({rows}, {cols}) is not whole "
        f"blocks of {blocksize}, so its experts are dequantised one at a time in plain torch "
        f"(slower, the same values)",
        stacklevel=3,
    )


def dequantize_nf4_experts(
    record: NF4Experts, first: int = 0, stop: int | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Experts ``first .. stop - 1`` as a contiguous (stop - first, rows, cols) tensor of
    ``record.dtype`` in the stored layout (``record.transposed`` not applied), each
    expert bit for bit ``record.dequantize_expert(e)``.  ``out``, if given, is a
    contiguous tensor of at least that many elements of that dtype, reused as the result."""
    experts, rows, cols = record.stored_shape
    stop = experts if stop is None else stop
    if not 0 <= first < stop <= experts:
        raise ValueError(f"dequantize_nf4_experts: experts {first}..{stop} outside the record's {experts}")
    count, numel = stop - first, rows * cols
    shape = (count, rows, cols)
    if out is None:
        out = torch.empty(shape, dtype=record.dtype, device=record.device)
    elif out.dtype != record.dtype or not out.is_contiguous() or out.numel() < count * numel:
        raise ValueError(
            f"dequantize_nf4_experts: out is {out.dtype} with {out.numel()} elements; "
            f"expected a contiguous {record.dtype} tensor of at least {count * numel}"
        )
    else:
        out = out.view(-1)[: count * numel].view(shape)
    if numel % record.blocksize or not use_triton(record.packed):
        if not use_triton(record.packed):
            warn_reference_once("dequantize_nf4_experts", record.device.type)
        else:
            _warn_partial_blocks_once(rows, cols, record.blocksize)
        for i in range(count):
            out[i] = record.dequantize_expert(first + i)
        return out

    expert_blocks = numel // record.blocksize
    n_blocks = count * expert_blocks
    pair_dtype = torch.int64 if record.dtype == torch.float32 else torch.int32
    flat_out = out.view(-1)
    blocks_per_program = max(1, ELEMENTS_PER_PROGRAM // record.blocksize)
    _dequantize_nf4_kernel[(triton.cdiv(n_blocks, blocks_per_program),)](
        record.packed[first:stop].contiguous(),
        record.absmax[first:stop].contiguous(),
        record.code,
        record.nested_absmax[first:stop].contiguous(),
        record.nested_code,
        record.offset[first:stop].contiguous(),
        flat_out.view(pair_dtype),
        flat_out,
        count * numel // 2,
        count * numel // 2,
        n_blocks,
        0,
        0,
        0,
        expert_blocks,
        record.nested_absmax.shape[1],
        BLOCKSIZE=record.blocksize,
        BLOCKS_PER_PROGRAM=blocks_per_program,
        NESTED=True,
        NESTED_BLOCKSIZE=record.nested_blocksize,
        ODD_NUMEL=False,
        STORE_PAIRS=16 // pair_dtype.itemsize,
        SOFTWARE_BF16_ROUNDING=record.dtype == torch.bfloat16 and interpreter_enabled(),
        COLUMN_SLAB=False,
        PER_EXPERT=True,
        num_warps=NUM_WARPS,
        # bitsandbytes rounds a block scale's product before adding the offset (nf4_experts.py).
        enable_fp_fusion=False,
    )
    return out
