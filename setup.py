"""Package discovery; everything else about the distribution is in pyproject.toml.

slothkit's subpackages are found rather than listed, so a new folder under slothkit/
ships without an edit here (a hand-kept list once left three packages out of the wheel).
The kernel library and the notebook templates live in kernels/ and templates/ but
install as `slothkit_kernels` and `slothkit_templates` ([tool.setuptools] package-dir):
discovery cannot rename a folder, so those two are named here (the kernel library's
subfolders, such as kernels/moe/, are found under their new name).
"""

from setuptools import find_packages, setup

kernel_packages = [f"slothkit_kernels.{name}" for name in find_packages(where="kernels")]
setup(
    packages=[
        *find_packages(include=["slothkit", "slothkit.*"]),
        "slothkit_kernels",
        *kernel_packages,
        "slothkit_templates",
    ]
)
