"""Package discovery; everything else about the distribution is in pyproject.toml.

slothkit's and slothkit_kernels' subpackages are found rather than listed, so a new
folder under either ships without an edit here (a hand-kept list once left three
packages out of the wheel).  The notebook templates live in templates/ but install as
`slothkit_templates` ([tool.setuptools] package-dir): discovery cannot rename a folder,
so that one is named here.
"""

from setuptools import find_packages, setup

setup(
    packages=[
        *find_packages(include=["slothkit", "slothkit.*", "slothkit_kernels", "slothkit_kernels.*"]),
        "slothkit_templates",
    ]
)
