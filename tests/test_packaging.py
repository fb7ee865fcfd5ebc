"""slothkit installed from its built wheel, outside this repository, as a user gets it.

The wheel and the sdist are built from the checkout; the wheel goes into a fresh virtual
environment (which borrows torch and the other dependencies from this interpreter's site
packages, so nothing is downloaded) and `slothkit demo --quick` runs from there, away from
the checkout, so that only what the wheel ships can be imported.
"""

import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def dist(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    pytest.importorskip(
        "build", reason="building the distributions needs the `build` package (slothkit[dev])"
    )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "build",
            "--no-isolation",
            "--sdist",
            "--wheel",
            "--outdir",
            str(out),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    (wheel,) = out.glob("slothkit-*.whl")
    (sdist,) = out.glob("slothkit-*.tar.gz")
    return wheel, sdist


def _shipped_data():
    """What a user's notebook and `slothkit new-notebook` read besides code."""
    templates = [f"slothkit_templates/{p.name}" for p in (ROOT / "templates").glob("*.py")]
    examples = [
        f"slothkit/data/example_data/{p.name}" for p in (ROOT / "slothkit/data/example_data").glob("*.jsonl")
    ]
    assert templates and examples
    return [*templates, "slothkit_templates/models.json", *examples]


def test_wheel_and_sdist_ship_templates_and_example_data(dist):
    wheel, sdist = dist
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = [name for name in _shipped_data() if name not in names]
    assert not missing, f"the wheel lacks {missing}"
    assert "slothkit_kernels/rms_norm.py" in names and "slothkit/export/gguf/writer.py" in names
    assert not any(name.startswith(("tests/", "notebooks/", "results/")) for name in names)

    with tarfile.open(sdist) as tar:
        members = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    for name in ("pyproject.toml", "LICENSE", "README.md", "templates/models.json", "kernels/rms_norm.py"):
        assert name in members, f"the sdist lacks {name}"


def test_wheel_installs_in_a_fresh_venv_and_runs_the_quick_demo(dist, tmp_path):
    wheel, _ = dist
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
        check=True,
        capture_output=True,
    )
    workdir = tmp_path / "elsewhere"
    workdir.mkdir()
    where = subprocess.run(
        [
            str(python),
            "-c",
            "import slothkit, slothkit_kernels, slothkit_templates; print(slothkit.__file__)",
        ],
        cwd=workdir,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    assert where.startswith(str(venv)), f"slothkit was imported from {where}, not from the installed wheel"

    # As a user runs it: without the Triton interpreter the tests switch on.
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run(
        [str(venv / "bin" / "slothkit"), "demo", "--quick"],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "loss" in result.stdout
