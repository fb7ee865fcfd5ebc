"""slothkit_kernels.testing's comparisons on inputs whose answer is known: the relative
error in the 2-norm, and the per-dtype tolerances of assert_close."""

import pytest
import torch

from slothkit_kernels.testing import TOLERANCES, assert_close, relative_error


def test_relative_error_is_the_norm_of_the_difference_over_the_expected_norm():
    generator = torch.Generator().manual_seed(0)
    expected = torch.randn(64, 32, generator=generator)
    actual = expected + 1e-3 * torch.randn(64, 32, generator=generator)
    exact = ((actual.double() - expected.double()).norm() / expected.double().norm()).item()
    assert relative_error(actual, expected) == pytest.approx(exact, rel=1e-12)
    assert relative_error(torch.tensor([3.0, 4.0]), torch.tensor([0.0, 0.0])) == pytest.approx(5e30)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_relative_error_refuses_non_finite_outputs(bad):
    with pytest.raises(AssertionError, match="NaN or inf"):
        relative_error(torch.tensor([1.0, bad]), torch.tensor([1.0, 1.0]))


@pytest.mark.parametrize("dtype", list(TOLERANCES))
def test_assert_close_passes_within_and_fails_beyond_the_dtypes_tolerance(dtype):
    atol, rtol = TOLERANCES[dtype]
    expected = torch.randn(256, generator=torch.Generator().manual_seed(1)).to(dtype)
    bound = atol + rtol * expected.float().abs()
    assert_close(expected.float() + 0.5 * bound, expected, msg="within")
    with pytest.raises(AssertionError, match="beyond"):
        assert_close(expected.float() + 2 * bound, expected, msg="beyond")
    with pytest.raises(AssertionError, match="NaN or inf"):
        assert_close(torch.full_like(expected.float(), float("nan")), expected, msg="nan")
