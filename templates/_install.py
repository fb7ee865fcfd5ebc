# %% Install what is missing (Colab's torch and ipywidgets stay, where torch is 2.11 or newer)
import glob
import importlib.util
import os
import subprocess
import sys

if importlib.util.find_spec("slothkit") is None:
    # In order: SLOTHKIT_PIP_SPEC, the newest slothkit wheel uploaded next to this notebook
    # (Colab's Files pane, a Kaggle dataset), then PyPI.
    wheels = glob.glob("slothkit-*.whl") + glob.glob("/content/slothkit-*.whl") + glob.glob("/kaggle/input/*/slothkit-*.whl")
    tried = [s for s in [os.environ.get("SLOTHKIT_PIP_SPEC"), *sorted(wheels, key=os.path.getmtime)[-1:], "slothkit"] if s]
    if not any(subprocess.call([sys.executable, "-m", "pip", "install", "-q", spec]) == 0 for spec in tried):
        raise RuntimeError(
            f"pip could not install slothkit from {' or '.join(map(repr, tried))} (pip says why above). "
            "This cell installs slothkit from, in order: the pip spec in the SLOTHKIT_PIP_SPEC environment "
            "variable (a wheel file, a git URL or a version), a slothkit-*.whl uploaded next to this notebook "
            "(Colab: the Files pane; Kaggle: add it as a dataset), then PyPI. Build a wheel in a slothkit "
            "checkout with `pip wheel --no-deps -w dist .`, upload dist/slothkit-*.whl, and run this cell again."
        )
from slothkit.notebook import prepare_runtime

runtime = prepare_runtime()
