"""NF4Experts and quantize_nf4_experts against bitsandbytes' own 4-bit quantisation."""

import pytest
import torch

from slothkit_kernels import NF4Weight, dequantize_nf4_reference
from slothkit_kernels.moe import NF4Experts, quantize_nf4_experts
from slothkit_kernels.moe.nf4_quantize import dynamic_map, nf4_levels

bnb_functional = pytest.importorskip("bitsandbytes.functional")

SHAPES = [(3, 37, 29), (2, 128, 96), (2, 96, 200)]  # odd element count; rows cut blocks


def test_tables_are_bitsandbytes_tables():
    assert torch.equal(nf4_levels(), bnb_functional.get_4bit_type("nf4", device="cpu"))
    assert torch.equal(dynamic_map(), bnb_functional.create_dynamic_map())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES, ids=["x".join(map(str, s)) for s in SHAPES])
def test_quantize_nf4_experts_matches_bitsandbytes(shape, dtype):
    """Per expert: the packed codes, the group scales and the offset are bitsandbytes'
    bit for bit.  The block scales' 8-bit codes are the nearest codes of the dynamic map,
    which bitsandbytes' CPU search misses for a few blocks (nf4_quantize.py): they agree on
    at least 98% of blocks, and where not ours is at least as near.  Where they agree the
    dequantised weights are bitsandbytes' bit for bit (slothkit's dequantisation of its
    record, itself bit-identical to dequantize_4bit, whose CPU kernel misplaces the scales
    of rows that are not whole blocks)."""
    gen = torch.Generator().manual_seed(sum(shape) + dtype.itemsize)
    weight = (torch.randn(shape, generator=gen) * 0.05).to(dtype)
    record = quantize_nf4_experts(weight)
    assert record.shape == weight.shape and record.dtype == dtype
    table = dynamic_map()
    for e in range(shape[0]):
        packed, state = bnb_functional.quantize_4bit(
            weight[e], quant_type="nf4", compress_statistics=True, blocksize=64
        )
        assert torch.equal(record.packed[e], packed.reshape(-1))
        assert torch.equal(record.nested_absmax[e], state.state2.absmax)
        assert torch.equal(record.offset[e], state.offset.reshape(()))
        ours, theirs = record.absmax[e], state.absmax
        same = ours == theirs
        assert same.float().mean() >= 0.98
        # The centred block scales, normalised by their group's scale, as both quantised them.
        _, plain = bnb_functional.quantize_4bit(weight[e], quant_type="nf4", blocksize=64)
        centred = plain.absmax - state.offset
        normed = centred / state.state2.absmax.repeat_interleave(256)[: centred.numel()]
        assert ((normed - table[ours.long()]).abs() <= (normed - table[theirs.long()]).abs()).all()
        gold = dequantize_nf4_reference(NF4Weight.from_bitsandbytes(packed, state))
        mine = record.dequantize_expert(e)
        blocks = torch.arange(mine.numel()) // 64
        agree = same[blocks].reshape(mine.shape)
        assert torch.equal(mine[agree], gold[agree])


def test_dequantize_reads_transposed_views():
    weight = torch.randn(3, 10, 7, generator=torch.Generator().manual_seed(1))
    record = quantize_nf4_experts(weight)
    dense = record.dequantize()
    assert record.mT.shape == (3, 7, 10)
    assert torch.equal(record.mT.dequantize(), dense.mT)
    # The flat index n * sn + k * sk of element (n, k) in both readings.
    for view, matrix in ((record, dense[1]), (record.mT, dense[1].t())):
        sn, sk = view.element_strides()
        flat = dense[1].reshape(-1)
        n, k = torch.meshgrid(torch.arange(matrix.shape[0]), torch.arange(matrix.shape[1]), indexing="ij")
        assert torch.equal(flat[n * sn + k * sk], matrix)
    assert torch.equal(record.mT.mT.dequantize(), dense)


def test_quantize_nf4_experts_is_close_to_the_weight():
    """NF4's levels are at most 0.32 of a block's absmax apart (between -1 and -0.696), so
    no value moves by more than 0.16 of its block's absmax, plus the scale's own error of
    one 8-bit dynamic code, a few percent of absmax."""
    weight = torch.randn(2, 64, 64, generator=torch.Generator().manual_seed(2))
    record = quantize_nf4_experts(weight)
    blocks = weight.reshape(2, -1, 64)
    error = (record.dequantize().reshape(2, -1, 64) - blocks).abs().amax(dim=2)
    assert (error <= 0.2 * blocks.abs().amax(dim=2)).all()
    # Per expert 4096 codes in 2048 bytes, 64 scale codes, one group scale and an offset;
    # then the two tables.
    assert record.nbytes() == 2 * (2048 + 64 + 4 + 4) + 4 * (16 + 256)


def test_quantize_nf4_experts_refuses_what_it_cannot_quantise():
    with pytest.raises(ValueError, match="experts, rows, cols"):
        quantize_nf4_experts(torch.zeros(4, 4))
    with pytest.raises(TypeError, match="float64"):
        quantize_nf4_experts(torch.zeros(2, 4, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="blocksize"):
        quantize_nf4_experts(torch.zeros(2, 4, 4), blocksize=48)
    zeros = quantize_nf4_experts(torch.zeros(1, 2, 3))
    assert isinstance(zeros, NF4Experts) and torch.equal(zeros.dequantize(), torch.zeros(1, 2, 3))
