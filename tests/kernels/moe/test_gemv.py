"""expert_gemv, each pair's chosen expert on its row, against the products in float64."""

import math

import pytest
import torch

from slothkit_kernels.moe.gemv import expert_gemv, expert_gemv_reference
from slothkit_kernels.testing import relative_error

# One product of length K <= 300, rounding like sqrt(K) u in norm; 16 times that leaves
# room for the bias and the order of the sums.  bf16: the inputs exact, the output
# rounded once (u = 2^-9) after an fp32 sum.
RTOL = {torch.float32: 16 * math.sqrt(300) * 2.0**-24, torch.bfloat16: 2.0**-8}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["out_in", "in_out"])
@pytest.mark.parametrize(("group", "bias"), [(3, False), (1, True)])
def test_expert_gemv_is_each_pairs_product(dtype, layout, group, bias, device):
    """Pair p: row p // group of x times expert ids[p] (repeats, an idle expert), N and K
    not multiples of the tiles, against float64 products of the same values."""
    gen = torch.Generator().manual_seed(5)
    experts, n, k, rows = 6, 37, 300, 4
    ids = torch.randint(0, experts - 1, (rows * group,), generator=gen)  # the last expert idle
    ids[1] = ids[0]

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype).to(device)

    x = randn(rows, k)
    stored = randn(experts, n, k) if layout == "out_in" else randn(experts, k, n)
    b = randn(experts, n) if bias else None
    y = expert_gemv(x, ids.to(device), stored, group=group, bias=b, weights_in_out=layout == "in_out")

    logical = stored.double() if layout == "out_in" else stored.double().transpose(1, 2)
    gold = torch.stack([logical[ids[p]] @ x.double()[p // group] for p in range(ids.shape[0])])  # (P, N)
    if bias:
        gold = gold + b.double()[ids]
    assert y.shape == (rows * group, n) and y.dtype == dtype
    assert relative_error(y, gold) < RTOL[dtype]
    reference = expert_gemv_reference(
        x, ids.to(device), stored, group=group, bias=b, weights_in_out=layout == "in_out"
    )
    assert relative_error(reference, gold) < RTOL[dtype]


def test_expert_gemv_says_what_its_shapes_must_be(device):
    x = torch.randn(2, 8, device=device)
    weight = torch.randn(3, 5, 8, device=device)
    with pytest.raises(ValueError, match="ids must hold rows \\* group = 4"):
        expert_gemv(x, torch.zeros(3, dtype=torch.long, device=device), weight, group=2)
    with pytest.raises(ValueError, match="x has 8 features; the experts take 5"):
        expert_gemv(x, torch.zeros(2, dtype=torch.long, device=device), weight, weights_in_out=True)
