"""nf4_lora_gemv_group against the reference (each weight dequantised, fp32, rounded once)
on fresh random NF4 weights: two and three projections of different widths, adapters on
some of them, biases, nested scales, CUDA-core and tensor-core candidates, split K; and
against nf4_lora_gemv on each weight alone."""

import itertools

import bitsandbytes.functional as bnbf
import pytest
import torch

from slothkit_kernels.nf4.gemv import CANDIDATES, nf4_lora_gemv
from slothkit_kernels.nf4.gemv_group import nf4_lora_gemv_group, nf4_lora_gemv_group_reference
from slothkit_kernels.nf4.weight import NF4Weight
from slothkit_kernels.testing import relative_error

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _weight(n, k, dtype, nested, device, generator) -> NF4Weight:
    w = (torch.randn(n, k, generator=generator) * k**-0.5).to(dtype)
    packed, state = bnbf.quantize_4bit(
        w, blocksize=64, compress_statistics=nested, quant_type="nf4", quant_storage=torch.uint8
    )
    state.to(device)
    return NF4Weight.from_bitsandbytes(packed.to(device), state)


def _inputs(rows, widths, k, ranks, dtype, nested, bias, device, generator):
    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator) * scale).to(device, dtype)

    weights = [_weight(n, k, dtype, nested, device, generator) for n in widths]
    biases = [randn(n) for n in widths] if bias else None
    lora_bs = [None if r == 0 else randn(n, r, scale=0.05) for n, r in zip(widths, ranks)]
    xa = randn(rows, sum(ranks)) if sum(ranks) else None
    scalings = [float(torch.rand((), generator=generator)) * 2 for _ in widths]
    return randn(rows, k), weights, biases, xa, lora_bs, scalings


CASES = [  # rows, widths, ranks, bias, nested, dtype
    (1, (96, 32, 32), (16, 16, 16), False, True, torch.bfloat16),
    (3, (40, 72), (8, 0), True, False, torch.float32),
    (8, (64, 16, 24), (0, 4, 4), False, True, torch.float16),
    (2, (48, 80), (0, 0), True, True, torch.bfloat16),
]


def _candidates(device, case: int, dtype) -> list[int]:
    """Three per case under the interpreter, rotating over the candidates (a CUDA-core and a
    tensor-core one among them where the dtype has tensor cores); every one on a GPU."""
    usable = [c for c, tile in enumerate(CANDIDATES) if dtype != torch.float32 or tile[4] == "cuda cores"]
    if device == "cuda":
        return usable
    return sorted({usable[(case * 3 + j * len(usable) // 3) % len(usable)] for j in range(3)})


@pytest.mark.parametrize("case", range(len(CASES)))
def test_nf4_lora_gemv_group_matches_the_reference(case, device):
    rows, widths, ranks, bias, nested, dtype = CASES[case]
    generator = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    inputs = _inputs(rows, widths, 256, ranks, dtype, nested, bias, device, generator)
    expected = nf4_lora_gemv_group_reference(*inputs)
    # On a GPU the default lookup (shuffles on CUDA cores, permutes on tensor cores) and, by
    # turns, each of the two everywhere; the interpreter runs no PTX and reads the table.
    lookups = ("auto", ("registers", "shuffle")[case % 2]) if device == "cuda" else ("auto",)
    for candidate, lookup in itertools.product(_candidates(device, case, dtype), lookups):
        got = nf4_lora_gemv_group(*inputs, candidate=candidate, lookup=lookup)
        assert [tuple(y.shape) for y in got] == [(rows, n) for n in widths]
        for y, e in zip(got, expected):
            assert y.dtype == dtype
            assert relative_error(y, e) < TOLERANCE[dtype], (CANDIDATES[candidate], lookup, widths)


@pytest.mark.parametrize("candidate", [c for c, tile in enumerate(CANDIDATES) if tile[3] > 0][::2])
def test_a_split_group_equals_each_weight_alone(candidate, device):
    """Split candidates (several blocks an iteration among them, K of 16 blocks): each
    projection of the group equals nf4_lora_gemv on its weight alone, a second call the
    first (the counters went back to 0)."""
    generator = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    x, weights, biases, xa, lora_bs, scalings = _inputs(
        2, (32, 16, 16), 1024, (4, 4, 4), torch.bfloat16, True, True, device, generator
    )
    first = nf4_lora_gemv_group(x, weights, biases, xa, lora_bs, scalings, candidate=candidate)
    second = nf4_lora_gemv_group(x, weights, biases, xa, lora_bs, scalings, candidate=candidate)
    xas = xa.split(4, dim=1)
    for g, weight in enumerate(weights):
        alone = nf4_lora_gemv(x, weight, biases[g], xas[g], lora_bs[g], scalings[g], candidate=candidate)
        assert relative_error(first[g], alone) < 1e-2, CANDIDATES[candidate]
        torch.testing.assert_close(second[g], first[g], rtol=0, atol=0)


def test_weights_quantised_unlike_are_refused(device):
    generator = torch.Generator().manual_seed(0)
    x, weights, _, _, _, _ = _inputs(1, (16, 16), 128, (0, 0), torch.float32, True, False, device, generator)
    plain = _weight(16, 128, torch.float32, False, device, generator)
    with pytest.raises(ValueError, match="quantised differently"):
        nf4_lora_gemv_group(x, [weights[0], plain])
    other = _weight(16, 128, torch.float32, True, device, generator)
    other.code = other.code * 1.5  # a table of other levels
    with pytest.raises(ValueError, match="levels differ"):
        nf4_lora_gemv_group(x, [weights[0], other])
    with pytest.raises(ValueError, match="for every weight, or for none"):
        nf4_lora_gemv_group(x, weights, [torch.zeros(16, device=device), None])
