"""lora_gemv against the fp32 reference on fresh random inputs: one to eight rows, with
and without an adapter and a bias, every tile candidate, fp32 / fp16 / bf16."""

import pytest
import torch
import triton

from slothkit_kernels import split_k
from slothkit_kernels.lora.gemv import CANDIDATES, lora_gemv, lora_gemv_reference, tile
from slothkit_kernels.testing import relative_error

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Tolerance on the relative error: the kernel and the reference both accumulate in fp32
# and round once; bf16/fp16 outputs differ by rounding, and the interpreter truncates.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _inputs(rows, n, k, rank, dtype, device, bias: bool, generator):
    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator) * scale).to(device, dtype)

    x = randn(rows, k)
    weight = randn(n, k, scale=k**-0.5)
    xa = None if rank == 0 else randn(rows, rank)
    lora_b = None if rank == 0 else randn(n, rank, scale=0.05)
    return x, weight, randn(n) if bias else None, xa, lora_b


ROWS = [1, 3, 8]
RANK_BIAS = [(16, False), (8, True), (0, False), (0, True)]


def _candidates(device, rows, rank, bias, dtype) -> list[int]:
    """Every tile candidate on a GPU; under the interpreter two per case, rotating with the
    case so that the grid as a whole runs each candidate several times."""
    if device == "cuda":
        return list(range(len(CANDIDATES)))
    case = (DTYPES.index(dtype) * len(ROWS) + ROWS.index(rows)) * len(RANK_BIAS) + RANK_BIAS.index(
        (rank, bias)
    )
    return sorted({case % len(CANDIDATES), (case + len(CANDIDATES) // 2) % len(CANDIDATES)})


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("rank, bias", RANK_BIAS)
def test_lora_gemv_matches_the_fp32_reference(rows, rank, bias, dtype, device):
    generator = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    # N and K not multiples of the tiles: the masks are exercised.
    x, weight, b, xa, lora_b = _inputs(rows, 72, 200, rank, dtype, device, bias, generator)
    scaling = float(torch.rand((), generator=generator)) * 2
    expected = lora_gemv_reference(x, weight, b, xa, lora_b, scaling)
    for candidate in _candidates(device, rows, rank, bias, dtype):
        got = lora_gemv(x, weight, b, xa, lora_b, scaling, candidate=candidate)
        assert got.dtype == dtype and got.shape == (rows, 72)
        assert relative_error(got, expected) < TOLERANCE[dtype], CANDIDATES[candidate]


def test_lora_gemv_adds_the_adapter_as_peft_does(device):
    """y = x W^T + s (x A^T) B^T: the adapter term is PEFT's LoRA of the same A and B."""
    generator = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    x, weight, bias, _, lora_b = _inputs(2, 40, 64, 4, torch.float32, device, True, generator)
    lora_a = torch.randn(4, 64, generator=generator).to(device)
    peft = x @ weight.t() + bias + 0.5 * (x @ lora_a.t()) @ lora_b.t()
    got = lora_gemv(x, weight, bias, x @ lora_a.t(), lora_b, 0.5)
    torch.testing.assert_close(got, peft, rtol=1e-5, atol=1e-5)


def test_lora_gemv_writes_into_a_strided_output(device):
    generator = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    x, weight, _, xa, lora_b = _inputs(4, 24, 48, 8, torch.float32, device, False, generator)
    wide = torch.zeros(4, 40, device=device)
    out = wide[:, 8:32]  # rows 40 apart
    lora_gemv(x, weight, None, xa, lora_b, 1.0, out=out)
    torch.testing.assert_close(
        out, lora_gemv_reference(x, weight, None, xa, lora_b, 1.0), rtol=1e-5, atol=1e-5
    )
    assert not wide[:, :8].any() and not wide[:, 32:].any()


def test_what_lora_gemv_cannot_compute_is_refused(device):
    generator = torch.Generator().manual_seed(0)
    x, weight, bias, xa, lora_b = _inputs(2, 16, 32, 4, torch.float32, device, True, generator)
    nine = torch.zeros(9, 32, device=device)
    for match, call in [
        ("1 to 8", lambda: lora_gemv(nine, weight)),
        ("expected \\(M, K\\) and \\(N, K\\)", lambda: lora_gemv(x, weight[:, :8])),
        ("both xa and lora_b", lambda: lora_gemv(x, weight, None, xa)),
        ("expected \\(2, R\\) and \\(16, R\\)", lambda: lora_gemv(x, weight, None, xa, lora_b[:8])),
        ("bias", lambda: lora_gemv(x, weight, bias[:3])),
        ("mixed dtypes", lambda: lora_gemv(x, weight.double())),
        ("contiguous last", lambda: lora_gemv(x, weight.t().contiguous().t())),
    ]:
        with pytest.raises(ValueError, match=match):
            call()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5])
def test_split_k_candidates_add_every_slice_once_and_reset_their_counters(rows, dtype, device):
    """A K long enough to be cut into several slices (on a CPU, one "SM", as on a GPU):
    the band's last program adds every slice's partial sums once, and leaves the band's
    counter at 0 for the next call."""
    generator = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    n, k = 40, 600
    cut = 0
    for candidate, (*_, programs_per_sm, _) in enumerate(CANDIDATES):
        if not programs_per_sm:
            continue
        _, block_n, block_k = tile(candidate, rows, k)
        bands = triton.cdiv(n, block_n)
        slices, _ = split_k.slices(torch.device(device), bands, k, block_k, programs_per_sm)
        for _ in range(2):  # the second call starts from the counters the first one left
            x, weight, b, xa, lora_b = _inputs(rows, n, k, 8, dtype, device, True, generator)
            got = lora_gemv(x, weight, b, xa, lora_b, 0.5, candidate=candidate)
            expected = lora_gemv_reference(x, weight, b, xa, lora_b, 0.5)
            assert relative_error(got, expected) < TOLERANCE[dtype], (CANDIDATES[candidate], slices)
        if slices > 1:
            cut += 1
            _, counters = split_k._workspaces[(str(x.device), rows, n, slices, bands)]
            assert not counters.any()
    assert cut or device == "cuda"  # a GPU's many SMs may leave these small shapes uncut
