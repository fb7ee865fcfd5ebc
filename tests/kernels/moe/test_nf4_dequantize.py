"""dequantize_nf4_experts against NF4Experts.dequantize_expert, bit for bit."""

import pytest
import torch

from slothkit_kernels.moe import dequantize_nf4_experts, quantize_nf4_experts

# Experts of whole blocks of 64 (one launch); one expert spans several groups of 256
# block scales so the per-expert group index is exercised, the last group short.
WHOLE_BLOCKS = (5, 96, 176)  # 16,896 elements: 264 blocks, groups of 256 and 8


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("run", [(0, 5), (1, 4), (4, 5)])
def test_a_run_of_experts_dequantises_bit_for_bit(dtype, run, device):
    gen = torch.Generator().manual_seed(7 + run[0])
    weight = (torch.randn(WHOLE_BLOCKS, generator=gen) * torch.rand(5, 1, 1, generator=gen)).to(device, dtype)
    record = quantize_nf4_experts(weight)
    ours = dequantize_nf4_experts(record, *run)
    gold = torch.stack([record.dequantize_expert(e) for e in range(*run)])
    assert ours.shape == gold.shape and ours.dtype == dtype
    assert torch.equal(ours, gold)


def test_the_result_reuses_a_given_buffer(device):
    record = quantize_nf4_experts(
        torch.randn(WHOLE_BLOCKS, generator=torch.Generator().manual_seed(3)).to(device)
    )
    buffer = torch.full((3, 96, 176), float("nan"), device=device)
    out = dequantize_nf4_experts(record, 3, 5, out=buffer)
    assert out.data_ptr() == buffer.data_ptr() and out.shape == (2, 96, 176)
    assert torch.equal(out, record.dequantize()[3:5])
    with pytest.raises(ValueError, match="at least"):
        dequantize_nf4_experts(record, 0, 5, out=buffer)
    with pytest.raises(ValueError, match="outside the record's 5"):
        dequantize_nf4_experts(record, 2, 6)


def test_experts_not_whole_blocks_are_dequantised_in_torch_said_once(device):
    record = quantize_nf4_experts(
        torch.randn(3, 37, 29, generator=torch.Generator().manual_seed(4)).to(device)
    )
    with pytest.warns(UserWarning, match="not whole blocks of 64") as said:
        ours = dequantize_nf4_experts(record)
        dequantize_nf4_experts(record, 1, 2)
    assert len([w for w in said if "whole blocks" in str(w.message)]) == 1
    assert torch.equal(ours, record.dequantize())
