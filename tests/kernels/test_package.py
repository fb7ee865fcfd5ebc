"""The kernel library's public surface and its independence from model code.

The helpers the ops share are tested through them: utils' dispatch rule and input checks
by each op's fallback and refusal tests, split_k by the split-K cases of lora/test_gemv.py
and nf4/test_gemv.py; testing's comparisons in test_testing.py."""

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


def test_the_repository_root_shadows_no_kernels_package(tmp_path):
    """Python started in the repository root (`python -c`, `python -m`, pytest-xdist's
    workers) puts the root first on sys.path.  There `kernels` is Hugging Face's package,
    which transformers imports when it is installed (a stand-in here), or nothing: the
    kernel library's folder is named slothkit_kernels and imports as that from the
    checkout."""
    root = Path(__file__).resolve().parents[2]
    installed = tmp_path / "site" / "kernels"
    installed.mkdir(parents=True)
    (installed / "__init__.py").write_text("")
    probe = (
        "import importlib.util, sys\n"
        "assert sys.path[0] in ('', '.'), sys.path[0]\n"
        "spec = importlib.util.find_spec('kernels')\n"
        "print(spec.origin if spec else None)\n"
        "print(importlib.util.find_spec('slothkit_kernels').origin)\n"
    )
    found = {}
    for name, pythonpath in (("stand-in", str(tmp_path / "site")), ("none", "")):
        environment = {**os.environ, "PYTHONPATH": pythonpath}
        done = subprocess.run(
            [sys.executable, "-c", probe],
            cwd=root,
            env=environment,
            capture_output=True,
            text=True,
            check=True,
        )
        found[name] = done.stdout.splitlines()
    assert found["stand-in"] == [
        str(installed / "__init__.py"),
        str(root / "slothkit_kernels" / "__init__.py"),
    ]
    origin, kernel_library = found["none"]
    assert origin == "None" or not Path(origin).resolve().is_relative_to(root), origin
    assert kernel_library == str(root / "slothkit_kernels" / "__init__.py")
