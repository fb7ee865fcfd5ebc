"""Numerical comparison helpers for checking kernels against references.

Used by slothkit's own tests; public so that users can check their own kernels
or patched models the same way.
"""

import torch

# (atol, rtol) per dtype for outputs of elementwise / normalisation kernels.
TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected||, computed in float64; NaN/inf fail."""
    actual = actual.detach().double()
    expected = expected.detach().double()
    assert torch.isfinite(actual).all(), "output has NaN or inf"
    denom = expected.norm().clamp_min(1e-30)
    return ((actual - expected).norm() / denom).item()


def assert_close(actual, expected, dtype=None, atol=None, rtol=None, msg=""):
    dtype = dtype or expected.dtype
    default_atol, default_rtol = TOLERANCES[dtype]
    atol = default_atol if atol is None else atol
    rtol = default_rtol if rtol is None else rtol
    assert torch.isfinite(actual).all(), f"{msg}: output has NaN or inf"
    torch.testing.assert_close(
        actual.float(), expected.float(), atol=atol, rtol=rtol, msg=lambda m: f"{msg}: {m}"
    )
