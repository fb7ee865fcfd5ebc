"""The kernel library's public surface and its independence from model code."""

import os
import subprocess
import sys
from pathlib import Path


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
    # 'kernels' is Hugging Face's package name (transformers 5.25 depends on it, so it may
    # be installed); slothkit installs as slothkit_kernels only. A checkout's root on
    # PYTHONPATH (as the GPU scripts set it) exposes kernels/ itself; what is checked here
    # is what installing put on the path: no `kernels` that is slothkit's folder.
    root = Path(__file__).resolve().parents[2]
    entries = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    pythonpath = os.pathsep.join(e for e in entries if e and Path(e).resolve() != root)
    code = "import importlib.util; spec = importlib.util.find_spec('kernels'); print(spec.origin if spec else '')"
    env = {**os.environ, "PYTHONPATH": pythonpath}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd="/", env=env, capture_output=True, text=True, check=True
    )
    origin = done.stdout.strip()
    assert not origin or Path(origin).resolve().parent != root / "kernels", origin
    assert not origin or not (Path(origin).parent / "lora_projection.py").exists(), origin
