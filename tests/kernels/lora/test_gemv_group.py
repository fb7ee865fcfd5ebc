"""lora_gemv_group against the fp32 reference on fresh random inputs: two to four
projections of different widths (not multiples of the tiles), adapters on some or all of
them, with and without biases, unsplit and split K, and against lora_gemv run on each
projection alone."""

import pytest
import torch
import triton

from slothkit_kernels import split_k
from slothkit_kernels.lora.gemv import CANDIDATES, lora_gemv, tile
from slothkit_kernels.lora.gemv_group import lora_gemv_group, lora_gemv_group_reference
from slothkit_kernels.testing import relative_error

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _inputs(rows, widths, k, ranks, dtype, device, bias: bool, generator):
    """x, weights, biases, xa (the adapters' x A^T side by side), lora_bs (None where the
    rank is 0) and scalings."""

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator) * scale).to(device, dtype)

    x = randn(rows, k)
    weights = [randn(n, k, scale=k**-0.5) for n in widths]
    biases = [randn(n) for n in widths] if bias else None
    lora_bs = [None if r == 0 else randn(n, r, scale=0.05) for n, r in zip(widths, ranks)]
    xa = randn(rows, sum(ranks)) if sum(ranks) else None
    scalings = [float(torch.rand((), generator=generator)) * 2 for _ in widths]
    return x, weights, biases, xa, lora_bs, scalings


CASES = [  # (rows, widths, ranks, bias, dtype)
    (1, (72, 24, 24), (16, 16, 16), False, torch.bfloat16),
    (3, (40, 96), (8, 0), True, torch.float32),
    (8, (24, 56, 8, 40), (0, 4, 4, 0), False, torch.float16),
    (2, (64, 16), (0, 0), True, torch.bfloat16),
    (5, (33, 70, 17), (4, 8, 2), True, torch.float32),
]


def _candidates(device, case: int) -> list[int]:
    """Every tile candidate on a GPU; under the interpreter three per case, rotating."""
    if device == "cuda":
        return list(range(len(CANDIDATES)))
    return sorted({(case * 3 + j) % len(CANDIDATES) for j in range(3)})


@pytest.mark.parametrize("case", range(len(CASES)))
def test_lora_gemv_group_matches_the_fp32_reference(case, device):
    rows, widths, ranks, bias, dtype = CASES[case]
    generator = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    inputs = _inputs(rows, widths, 200, ranks, dtype, device, bias, generator)
    expected = lora_gemv_group_reference(*inputs)
    for candidate in _candidates(device, case):
        got = lora_gemv_group(*inputs, candidate=candidate)
        assert [tuple(y.shape) for y in got] == [(rows, n) for n in widths]
        for y, e in zip(got, expected):
            assert y.dtype == dtype and y.is_contiguous()
            assert relative_error(y, e) < TOLERANCE[dtype], (CANDIDATES[candidate], widths)


@pytest.mark.parametrize("candidate", [c for c, tile in enumerate(CANDIDATES) if tile[3] > 0 and not tile[4]])
def test_split_k_spans_every_group_and_resets_the_counters(candidate, device):
    """A split candidate over several groups (on a CPU, one "SM": few bands, so K is cut):
    each band's slices summed once and the counters left at 0 (a second call gives the
    same result), equal to lora_gemv's on each projection alone, which splits K alike."""
    generator = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    rows, widths, k = 2, (16, 8, 8), 1024
    x, weights, biases, xa, lora_bs, scalings = _inputs(
        rows, widths, k, (4, 4, 4), torch.float32, device, True, generator
    )
    first = lora_gemv_group(x, weights, biases, xa, lora_bs, scalings, candidate=candidate)
    second = lora_gemv_group(x, weights, biases, xa, lora_bs, scalings, candidate=candidate)
    _, block_n, block_k = tile(candidate, rows, k)
    bands = sum(triton.cdiv(n, block_n) for n in widths)
    slices, _ = split_k.slices(torch.device(device), bands, k, block_k, CANDIDATES[candidate][3])
    assert slices > 1 or device == "cuda"
    if slices > 1:
        _, counters = split_k._workspaces[(str(x.device), rows, bands * block_n, slices, bands)]
        assert not counters.any()
    xas = xa.split(4, dim=1)
    for g, weight in enumerate(weights):
        alone = lora_gemv(x, weight, biases[g], xas[g], lora_bs[g], scalings[g], candidate=candidate)
        torch.testing.assert_close(first[g], alone, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(second[g], first[g], rtol=0, atol=0)


def test_what_lora_gemv_group_cannot_compute_is_refused(device):
    generator = torch.Generator().manual_seed(0)
    x, weights, biases, xa, lora_bs, scalings = _inputs(
        2, (8, 8), 16, (4, 0), torch.float32, device, True, generator
    )
    with pytest.raises(ValueError, match="for every weight, or for none"):
        lora_gemv_group(x, weights, [biases[0], None], xa, lora_bs, scalings)
    with pytest.raises(ValueError, match=r"expected \(2, 4\)"):
        lora_gemv_group(x, weights, biases, xa[:, :2], lora_bs, scalings)
    with pytest.raises(ValueError, match="contiguous"):
        lora_gemv_group(x, [weights[0].t(), weights[1]], biases, xa, lora_bs, scalings)
    with pytest.raises(ValueError, match="1 to 4"):
        lora_gemv_group(x, weights * 3, None, None, None, None)
    with pytest.raises(ValueError, match="mixed dtypes"):
        lora_gemv_group(x, [weights[0].half(), weights[1]], None, None, None, None)
