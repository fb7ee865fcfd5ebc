"""NF4Experts: the frozen weights of E experts' projections, each in bitsandbytes' NF4.

Each expert's matrix (rows, cols), as the 3-D parameter stores it, is quantised on its own
exactly as bitsandbytes quantises a Linear4bit weight (``quantize_4bit(w_e,
quant_type="nf4", compress_statistics=True, blocksize=64)``), and the E results are
stacked:

  * ``packed[e]``: rows * cols codes, two per byte, the even flat index in the high
    nibble (an odd count leaves the last low nibble unused);
  * ``absmax[e, b]``: the uint8 code of block b's scale (blocks of ``blocksize`` elements
    in row-major order, the last one possibly short);
  * ``nested_absmax[e, g]``: the fp32 scale of the codes of blocks g * 256 .. g * 256 + 255;
  * ``offset[e]``: the fp32 mean of expert e's block scales, subtracted before they were
    quantised;
  * ``code``: the 16 NF4 levels; ``nested_code``: the 256 levels of the scales' codes.

Element j of expert e (flat index into its (rows, cols) matrix) is then, as bitsandbytes
dequantises it (two fp32 roundings for the scale, never one FMA, then the product):

    scale = fp32(fp32(nested_code[absmax[e, b]] * nested_absmax[e, b // 256]) + offset[e])
    w[e, j] = dtype(fp32(code[nibble_j] * scale))                 b = j // blocksize

The record may describe its matrices transposed (``mT``, as a tensor's): the GEMMs read
element (n, k) of the logical (E, N, K) weight at the flat index n * sn + k * sk of the
stored matrix (``element_strides``), so gpt-oss's (in, out) storage and the backward's
W^T are strides, never copies.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


@dataclass
class NF4Experts:
    packed: torch.Tensor  # (E, ceil(rows * cols / 2)) uint8
    absmax: torch.Tensor  # (E, ceil(rows * cols / blocksize)) uint8 codes of the block scales
    nested_absmax: torch.Tensor  # (E, ceil(blocks / nested_blocksize)) fp32
    offset: torch.Tensor  # (E,) fp32
    code: torch.Tensor  # (16,) fp32 NF4 levels
    nested_code: torch.Tensor  # (256,) fp32 levels of the absmax codes
    stored_shape: torch.Size  # (E, rows, cols): each expert's matrix as it was quantised
    dtype: torch.dtype  # what the weights dequantise to
    blocksize: int = 64
    nested_blocksize: int = 256
    transposed: bool = False  # read as (E, cols, rows)

    @property
    def shape(self) -> torch.Size:
        """The logical (E, N, K) shape the record is read as."""
        e, rows, cols = self.stored_shape
        return torch.Size((e, cols, rows) if self.transposed else (e, rows, cols))

    @property
    def mT(self) -> NF4Experts:  # noqa: N802 (the name of torch.Tensor's batched transpose)
        """The same weights read transposed: (E, N, K) -> (E, K, N), sharing every tensor."""
        return dataclasses.replace(self, transposed=not self.transposed)

    @property
    def device(self) -> torch.device:
        return self.packed.device

    @property
    def num_experts(self) -> int:
        return self.stored_shape[0]

    def element_strides(self) -> tuple[int, int]:
        """(sn, sk): element (n, k) of an expert's logical (N, K) matrix is element
        n * sn + k * sk of its stored, row-major (rows, cols) matrix."""
        cols = self.stored_shape[2]
        return (1, cols) if self.transposed else (cols, 1)

    def nbytes(self) -> int:
        """Bytes of the record's tensors (the shared tables included)."""
        tensors = (self.packed, self.absmax, self.nested_absmax, self.offset, self.code, self.nested_code)
        return sum(t.numel() * t.element_size() for t in tensors)

    def select(self, experts: torch.Tensor) -> NF4Experts:
        """The experts ``experts`` (a 1-D index tensor, repeats allowed) as a record of
        their own, in that order: each tensor's rows gathered on the device, so that a
        decode step dequantises only the experts its tokens chose (len(experts) of E)."""
        _, rows, cols = self.stored_shape
        return dataclasses.replace(
            self,
            packed=self.packed.index_select(0, experts),
            absmax=self.absmax.index_select(0, experts),
            nested_absmax=self.nested_absmax.index_select(0, experts),
            offset=self.offset.index_select(0, experts),
            stored_shape=torch.Size((experts.shape[0], rows, cols)),
        )

    def dequantize_expert(self, e: int) -> torch.Tensor:
        """Expert e's stored (rows, cols) matrix in ``dtype``, bit for bit as bitsandbytes'
        ``dequantize_4bit`` gives it, in plain torch."""
        _, rows, cols = self.stored_shape
        numel = rows * cols
        packed = self.packed[e]
        codes = torch.stack((packed >> 4, packed & 0xF), dim=-1).reshape(-1)[:numel]
        # Two roundings, the product then the offset, as bitsandbytes forms the scales.
        group_scale = self.nested_absmax[e].repeat_interleave(self.nested_blocksize)[: self.absmax.shape[1]]
        scales = self.nested_code[self.absmax[e].long()] * group_scale
        scales = scales + self.offset[e]
        block = torch.arange(numel, device=packed.device) // self.blocksize
        values = self.code[codes.long()] * scales[block]  # fp32 product, rounded once below
        return values.to(self.dtype).reshape(rows, cols)

    def dequantize(self) -> torch.Tensor:
        """All experts as a (E, N, K) tensor of the logical shape (a transposed view of the
        stored matrices when ``transposed``): the 16-bit weights the record stands for."""
        stored = torch.stack([self.dequantize_expert(e) for e in range(self.num_experts)])
        return stored.mT if self.transposed else stored
