"""Test-wide settings.

Without a GPU the Triton kernels run under the Triton interpreter, which must be
switched on before triton (and so slothkit_kernels) is first imported.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

if os.environ.get("TRITON_INTERPRET") == "1":
    # The interpreter checks every 32-bit integer add, subtract and multiply for overflow
    # (Triton's sanitize_overflow), a fifth of the time of a fused training test here.  Test
    # shapes index far below 2^31, and compiled kernels run without the checks.
    import dataclasses

    from triton.runtime import interpreter

    interpreter.interpreter_builder.options = dataclasses.replace(
        interpreter.interpreter_builder.options, sanitize_overflow=False
    )


@pytest.fixture
def device() -> str:
    """Where kernels are tested: the GPU when there is one, else the CPU interpreter."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU; run on the GPU machine")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip_cuda)
