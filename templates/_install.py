# %% Install what is missing (never replaces Colab's torch or ipywidgets)
import importlib.util
import os
import subprocess
import sys

if importlib.util.find_spec("slothkit") is None:
    subprocess.check_call([sys.executable, "-m", "pip", "install", "-q",
                           os.environ.get("SLOTHKIT_PIP_SPEC", "slothkit")])
from slothkit.notebook import prepare_runtime

runtime = prepare_runtime()
