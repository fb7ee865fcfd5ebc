"""Package discovery; everything else about the distribution is in pyproject.toml.

slothkit's subpackages are found rather than listed, so a new folder under slothkit/
ships without an edit here (a hand-kept list once left three packages out of the wheel).
The kernel library and the notebook templates live in kernels/ and templates/ but
install as `slothkit_kernels` and `slothkit_templates` ([tool.setuptools] package-dir):
discovery cannot rename a folder, so those two are named here.
"""

from setuptools import find_packages, setup

setup(packages=[*find_packages(include=["slothkit", "slothkit.*"]), "slothkit_kernels", "slothkit_templates"])
