# %% Install what is missing (never replaces Colab's torch or ipywidgets)
import importlib.util
import os
import subprocess
import sys

if importlib.util.find_spec("slothkit") is None:
    spec = os.environ.get("SLOTHKIT_PIP_SPEC", "slothkit")  # or a wheel path, or git+https://...
    if subprocess.call([sys.executable, "-m", "pip", "install", "-q", spec]) != 0:
        raise RuntimeError(f"pip could not install slothkit from {spec!r} (see pip's message above); "
                           f"set SLOTHKIT_PIP_SPEC to a wheel file or a git URL and run this cell again")
from slothkit.notebook import prepare_runtime

runtime = prepare_runtime()
