"""NF4Weight: a frozen weight stored in bitsandbytes' NF4 format, as plain tensors.

The kernel library never imports bitsandbytes.  Glue code turns a bitsandbytes
``Params4bit`` (its ``.data`` plus ``.quant_state``) into this record with
:meth:`NF4Weight.from_bitsandbytes`, which only reads attributes.

Layout (bitsandbytes' "nf4" with optional double quantisation, as of 0.50):
  * ``packed``: uint8, two 4-bit codes per byte, the element with the even index in
    the high nibble; flattening order is the row-major order of ``shape``; an odd
    element count leaves the low nibble of the last byte unused.
  * each run of ``blocksize`` elements (the last run may be shorter) shares one
    scale ``absmax[b]``; the product is formed in fp32 and rounded once to ``dtype``:
        w[j] = dtype(fp32(NF4_CODE[nibble_j] * absmax[j // blocksize]))
  * double quantisation stores ``absmax`` itself as uint8 codes into a 256-entry
    table ``nested_code`` with fp32 scales ``nested_absmax`` per
    ``nested_blocksize`` entries (256 in bitsandbytes), plus a scalar ``offset``.
    The product and the sum are rounded separately in fp32 (never one FMA):
        scale = fp32(nested_code[absmax_q[b]] * nested_absmax[b // nested_blocksize])
        absmax[b] = fp32(scale + offset)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch


@dataclass
class NF4Weight:
    packed: torch.Tensor  # uint8, numel = ceil(prod(shape) / 2)
    absmax: torch.Tensor  # fp32 per-block scales, or uint8 codes when nested
    code: torch.Tensor  # fp32, the 16 NF4 levels
    blocksize: int  # elements per scale
    shape: torch.Size  # (out_features, in_features) of the dequantised weight
    dtype: torch.dtype  # dtype the weight dequantises to
    nested_absmax: torch.Tensor | None = None  # fp32 scales of the absmax codes
    nested_code: torch.Tensor | None = None  # fp32, 256-entry table for absmax codes
    nested_blocksize: int | None = None  # absmax codes per nested scale
    offset: torch.Tensor | float | None = None  # added to every dequantised absmax
    # Checked, flattened kernel arguments, filled by the first dequantize_nf4 call: a record
    # describes frozen tensors, so the checks need not run at every call.
    launch_cache: tuple | None = field(default=None, init=False, repr=False, compare=False)
    # How nf4_gemv's kernels turn codes into levels, by (lookup, width): the PTX and the
    # table they read (nf4_gemv.level_source).
    level_sources: dict | None = field(default=None, init=False, repr=False, compare=False)

    def column_slabs(self, max_bytes: int) -> list[tuple[int, int]] | None:
        """Column ranges that split the weight into slabs of at most about ``max_bytes``
        once dequantised (equal widths, whole blocks; ``dequantize_nf4(columns=...)``), or
        None where it is small enough to dequantise whole, or its rows are not whole
        blocks (then a slab would cut blocks)."""
        if len(self.shape) != 2:
            return None
        rows, cols = self.shape
        size = rows * cols * self.dtype.itemsize
        if size <= max_bytes or cols % self.blocksize:
            return None
        blocks = cols // self.blocksize
        pieces = min(blocks, -(-size // max_bytes))
        width = -(-blocks // pieces) * self.blocksize
        return [(start, min(start + width, cols)) for start in range(0, cols, width)]

    def rows(self, start: int, stop: int) -> NF4Weight | None:
        """Rows [start, stop) of a 2-D weight as a record of its own, sharing the packed
        bytes and scales (views, no copy), or None where row ``start`` does not begin a
        block (a block would then straddle two slices).

        Rows are contiguous in the flattened weight, so the slice is the element range
        [start * cols, stop * cols): whole blocks from its start, and a last block that
        may end inside a block of the full weight, which keeps that block's scale. With
        double quantisation the absmax codes are grouped too: a slice starting inside a
        group gets its block scales dequantised to fp32 instead (a non-nested record; the
        same values, 4 bytes per block instead of 1).
        """
        rows, cols = self.shape
        if not 0 <= start < stop <= rows:
            raise ValueError(f"rows [{start}, {stop}) are not within the weight's {rows} rows")
        first, end = start * cols, stop * cols  # element range in the flattened weight
        if first % self.blocksize:
            return None
        block0, block1 = first // self.blocksize, -(-end // self.blocksize)
        packed = self.packed.reshape(-1)[first // 2 : (end + 1) // 2]
        absmax = self.absmax.reshape(-1)[block0:block1]
        shape = torch.Size((stop - start, cols))
        if not self.is_nested:
            return NF4Weight(packed, absmax, self.code, self.blocksize, shape, self.dtype)
        if block0 % self.nested_blocksize == 0:
            group0, group1 = block0 // self.nested_blocksize, -(-block1 // self.nested_blocksize)
            return NF4Weight(
                packed, absmax, self.code, self.blocksize, shape, self.dtype,
                nested_absmax=self.nested_absmax.reshape(-1)[group0:group1],
                nested_code=self.nested_code,
                nested_blocksize=self.nested_blocksize,
                offset=self.offset,
            )  # fmt: skip
        groups = torch.arange(block0, block1, device=absmax.device) // self.nested_blocksize
        # Two roundings, the product then the offset, as bitsandbytes dequantises them.
        scales = self.nested_code.float()[absmax.long()] * self.nested_absmax.reshape(-1).float()[groups]
        scales = scales + torch.as_tensor(self.offset, dtype=torch.float32, device=absmax.device)
        return NF4Weight(packed, scales, self.code, self.blocksize, shape, self.dtype)

    def with_packed(self, packed: torch.Tensor) -> NF4Weight:
        """The same weight read from other packed codes (a copy of them, of the same shape
        and dtype), sharing the scales and this record's checked kernel arguments."""
        copy = dataclasses.replace(self, packed=packed)
        # One dict for the record and all its copies, made now if no lookup exists yet: a
        # lookup made later for one of them (the register lookup reads the levels to the
        # host, which CUDA graph capture forbids) is then there for the others too.
        if self.level_sources is None:
            self.level_sources = {}
        copy.level_sources = self.level_sources
        if self.launch_cache is not None:
            copy.launch_cache = (packed.reshape(-1).view(torch.uint8), *self.launch_cache[1:])
        return copy

    @property
    def is_nested(self) -> bool:
        return self.nested_absmax is not None

    @property
    def device(self) -> torch.device:
        return self.packed.device

    @classmethod
    def from_bitsandbytes(cls, packed: torch.Tensor, quant_state) -> NF4Weight:
        """Wrap a bitsandbytes 4-bit weight (``param.data``, ``param.quant_state``)."""
        if getattr(quant_state, "quant_type", "nf4") != "nf4":
            raise ValueError(f"only NF4 weights are supported, got quant_type={quant_state.quant_type!r}")
        if getattr(quant_state, "packing_format_for_cpu", False):
            # Repacking regroups the codes in tiles of output rows and rounds the block
            # scales to bf16; bitsandbytes' inverse quantises the rounded scales again, so
            # neither layout dequantises to the values the weight was quantised to.
            raise ValueError(
                "this weight was repacked for bitsandbytes' CPU kernels "
                "(quant_state.packing_format_for_cpu), which rounds its block scales to "
                "bfloat16, so it no longer dequantises to its NF4 values; wrap the weight "
                "before bitsandbytes repacks it (at its first eval-mode forward whose input "
                "needs no gradient, on a CPU with AVX512-BF16)"
            )
        if packed.dtype != torch.uint8:
            # quant_storage other than uint8 (e.g. bf16 for FSDP) holds the same bytes.
            packed = packed.contiguous().view(torch.uint8)
        nested = getattr(quant_state, "nested", False)
        state2 = quant_state.state2 if nested else None
        return cls(
            packed=packed,
            absmax=quant_state.absmax,
            code=quant_state.code,
            blocksize=int(quant_state.blocksize),
            shape=torch.Size(quant_state.shape),
            dtype=quant_state.dtype,
            nested_absmax=state2.absmax if nested else None,
            nested_code=state2.code if nested else None,
            nested_blocksize=int(state2.blocksize) if nested else None,
            offset=quant_state.offset if nested else None,
        )
