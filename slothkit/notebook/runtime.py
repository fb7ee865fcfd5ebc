"""Where a notebook runs (Colab, Kaggle, local Jupyter) and what it must install there.

Colab ships ipywidgets 7 and its own torch; installing ipywidgets 8 or another
torch there breaks the runtime, so only packages that are missing are installed,
and never torch or ipywidgets.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

# import name -> pip requirement, for what the notebooks use beyond slothkit's own deps.
NOTEBOOK_PACKAGES = {
    "trl": "trl",
    "datasets": "datasets",
    "gguf": "gguf",
    "matplotlib": "matplotlib",
}


def detect_runtime() -> str:
    """'colab', 'kaggle' or 'local'."""
    if "google.colab" in sys.modules or os.environ.get("COLAB_RELEASE_TAG"):
        return "colab"
    if os.environ.get("KAGGLE_KERNEL_RUN_TYPE") or os.path.isdir("/kaggle/working"):
        return "kaggle"
    return "local"


def missing_packages(packages=NOTEBOOK_PACKAGES) -> list[str]:
    return [req for name, req in packages.items() if importlib.util.find_spec(name) is None]


def prepare_runtime(install: bool | None = None) -> str:
    """Install what is missing (not torch, not ipywidgets) and report the runtime.

    install=None: install unless SLOTHKIT_NO_INSTALL is set (the tests set it).
    """
    runtime = detect_runtime()
    missing = missing_packages()
    if install is None:
        install = not os.environ.get("SLOTHKIT_NO_INSTALL")
    if missing and install:
        print(f"installing {', '.join(missing)} ...")
        subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", *missing])
    elif missing:
        print(f"not installing (SLOTHKIT_NO_INSTALL is set); missing: {', '.join(missing)}")
    print(f"runtime: {runtime}")
    return runtime
