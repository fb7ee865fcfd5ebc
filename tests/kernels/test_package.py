"""The kernel library's public surface and its independence from model code."""

import subprocess
import sys


def test_public_api_is_importable():
    import slothkit_kernels

    for name in slothkit_kernels.__all__:
        assert callable(getattr(slothkit_kernels, name)), name


def test_kernel_library_needs_only_torch_and_triton():
    code = (
        "import sys, slothkit_kernels\n"
        "bad = [m for m in ('transformers', 'slothkit', 'peft', 'bitsandbytes') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd="/")


def test_no_top_level_kernels_module_is_installed():
    # 'kernels' is Hugging Face's package name; slothkit installs as slothkit_kernels only.
    code = "import importlib.util, sys; sys.exit(importlib.util.find_spec('kernels') is not None)"
    assert subprocess.run([sys.executable, "-c", code], cwd="/").returncode == 0
