"""slothkit installed from its built wheel and sdist, as a user gets it.

The wheel and the sdist are built from the checkout. The wheel is installed into a fresh
virtual environment that sees nothing of this interpreter's packages: no system site
packages, no PYTHONPATH, a working directory outside the checkout. pip resolves every
dependency from the package index, as on a new Colab or Kaggle machine, so a dependency
the wheel forgets to declare, or a module it forgets to ship, fails here.  The sdist
must build that same wheel, byte for byte.

A second environment holds the lowest versions pyproject.toml declares (the ones
LOWEST_TESTED names, and the dev extra's test tools in LOWEST_TEST_TOOLS) and runs a
subset of this suite against the installed wheel, scheduled as the README's test command
does: the declared lower bounds are the tested ones.

The environments need a package index (pip's cache makes later runs quick); they are
skipped where pip cannot reach one (the GPU machine).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tarfile
import venv
import zipfile
from pathlib import Path

import pytest
import tomllib
import torch

ROOT = Path(__file__).resolve().parents[1]
JOURNEY = ROOT / "tests" / "packaging_journey.py"
# The torch every environment gets: this interpreter's own release, which on a CPU machine
# is the CPU wheel on local disk (a bare `torch` would pull a multi-GB CUDA build).
TORCH = f"torch=={torch.__version__.split('+')[0]}"
# Dependencies whose lowest declared version the second environment installs. torch is not
# among them: the lowest declared torch is the GPU machine's (docs/gpu-runs.md), which has
# no CPU wheel here; the CPU environments run TORCH.
LOWEST_TESTED = (
    "transformers",
    "peft",
    "accelerate",
    "trl",
    "datasets",
    "huggingface_hub",
    "tokenizers",
    "safetensors",
    "numpy",
    "bitsandbytes",
    "gguf",
)
# The test tools whose lowest version in the dev extra the second environment installs.
LOWEST_TEST_TOOLS = ("pytest", "pytest_xdist", "pytest_timeout", "nbval")
# The subset of this suite the lowest versions run (about a minute): FastModel against
# HF + PEFT in 16 and 4 bits, the merged and adapter saves, the GGUF writer, SFT and DPO
# against HF + PEFT, and one notebook end to end.
LOWEST_SUBSET = (
    "tests/slothkit/test_fast_model.py::test_fused_training_matches_hf_peft[llama-16bit]",
    "tests/slothkit/test_fast_model.py::test_fused_training_matches_hf_peft[llama-4bit]",
    "tests/slothkit/export/test_merge.py::test_merged_16bit_gives_the_lora_models_logits[llama]",
    "tests/slothkit/export/test_save.py::test_lora_adapter_reloads_in_plain_peft[llama]",
    "tests/slothkit/export/gguf/test_writer.py::test_metadata_tensor_names_shapes_and_types",
    "tests/slothkit/test_trl.py::test_sft_matches_hf_peft[lora]",
    "tests/slothkit/test_trl.py::test_dpo_matches_hf_peft[lora]",
    "notebooks/llama-3-8b-finetune.ipynb",
)

pytestmark = pytest.mark.slow


def _run(command, **kwargs):
    """Run `command`; on failure raise with its output, which pytest shows."""
    result = subprocess.run(command, capture_output=True, text=True, **kwargs)
    if result.returncode != 0:
        raise AssertionError(
            f"{' '.join(map(str, command))} exited {result.returncode}\n"
            f"--- stdout ---\n{result.stdout[-8000:]}\n--- stderr ---\n{result.stderr[-8000:]}"
        )
    return result


def _user_environment(**extra) -> dict[str, str]:
    """os.environ as a user's shell has it: nothing pointing into this checkout or this
    interpreter's packages, and without the Triton interpreter the tests switch on."""
    drop = {"PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "TRITON_INTERPRET", "PYTEST_CURRENT_TEST"}
    environment = {key: value for key, value in os.environ.items() if key not in drop}
    environment.update(extra)
    return environment


@pytest.fixture(scope="module")
def dist(tmp_path_factory):
    pytest.importorskip("build", reason="building the distributions needs `build` (slothkit[dev])")
    out = tmp_path_factory.mktemp("dist")
    _run(
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
        ]
    )
    (wheel,) = out.glob("slothkit-*.whl")
    (sdist,) = out.glob("slothkit-*.tar.gz")
    return wheel, sdist


def _source_files() -> set[str]:
    """Every file the wheel must hold, as its path inside the wheel."""
    names = {f"slothkit/{p.relative_to(ROOT / 'slothkit')}" for p in (ROOT / "slothkit").rglob("*.py")}
    names |= {p.relative_to(ROOT).as_posix() for p in (ROOT / "slothkit_kernels").rglob("*.py")}
    names |= {f"slothkit_templates/{p.name}" for p in (ROOT / "templates").glob("*.py")}
    names |= {"slothkit_templates/models.json", "slothkit_templates/vision_models.json"}
    names |= {
        f"slothkit/data/example_data/{p.relative_to(ROOT / 'slothkit/data/example_data').as_posix()}"
        for pattern in ("*.jsonl", "latex_ocr/*.png")
        for p in (ROOT / "slothkit/data/example_data").glob(pattern)
    }
    return {name for name in names if "__pycache__" not in name}


def test_wheel_ships_every_module_and_data_file(dist):
    wheel, _ = dist
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = _source_files()
    assert {
        "slothkit/inference/__init__.py",
        "slothkit/trl/__init__.py",
        "slothkit/export/gguf/__init__.py",
        "slothkit_kernels/rope/__init__.py",
        "slothkit_kernels/lora/__init__.py",
        "slothkit_kernels/nf4/__init__.py",
        "slothkit_kernels/moe/__init__.py",
    } <= expected
    missing = sorted(expected - names)
    assert not missing, f"the wheel lacks {missing}"
    assert not any(
        name.startswith(("tests/", "notebooks/", "results/", "kernels/", "templates/")) for name in names
    )


def test_sdist_ships_the_sources_the_wheel_is_built_from(dist):
    _, sdist = dist
    with tarfile.open(sdist) as tar:
        members = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    for name in (
        "pyproject.toml",
        "setup.py",
        "LICENSE",
        "README.md",
        "templates/models.json",
        "slothkit_kernels/rms_norm.py",
    ):
        assert name in members, f"the sdist lacks {name}"
    sources = {
        p.relative_to(ROOT).as_posix()
        for folder in ("slothkit", "slothkit_kernels")
        for p in (ROOT / folder).rglob("*.py")
    }
    missing = sorted(s for s in sources if "__pycache__" not in s and s not in members)
    assert not missing, f"the sdist lacks {missing}"


def _fresh_venv(path: Path) -> Path:
    """A virtual environment with pip and nothing else (no system site packages)."""
    venv.EnvBuilder(with_pip=True, system_site_packages=False, clear=True).create(path)
    python = path / "bin" / "python"
    probe = _run([str(python), "-c", "import importlib.util as u; print(u.find_spec('torch'))"], cwd=path)
    assert probe.stdout.strip() == "None", "the fresh environment sees this interpreter's packages"
    return python


def _pip_install(python: Path, *requirements, cwd: Path):
    try:
        return _run(
            [str(python), "-m", "pip", "install", "-q", *map(str, requirements)],
            cwd=cwd,
            env=_user_environment(),
            timeout=1800,
        )
    except AssertionError as error:
        if "No matching distribution" in str(error) and "Could not fetch URL" in str(error):
            pytest.skip("pip reaches no package index here")
        raise


def _journey(python: Path, workdir: Path, steps: str) -> dict:
    result = _run(
        [str(python), str(JOURNEY), str(workdir), "--steps", steps],
        cwd=workdir.parent,
        env=_user_environment(),
        timeout=1800,
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def _check_installed_copy(summary: dict, venv_dir: Path):
    where = summary["imports"]["slothkit_file"]
    assert where.startswith(str(venv_dir)), f"slothkit was imported from {where}, not from the installed copy"


def test_wheel_alone_in_a_fresh_venv_runs_the_whole_journey(dist, tmp_path):
    wheel, _ = dist
    venv_dir = tmp_path / "venv"
    python = _fresh_venv(venv_dir)
    _pip_install(python, TORCH, wheel, cwd=tmp_path)

    summary = _journey(python, tmp_path / "journey", "imports,demo,api,notebook")
    _check_installed_copy(summary, venv_dir)
    modules = set(summary["imports"]["modules"])
    expected = {
        f"slothkit.{p.relative_to(ROOT / 'slothkit').with_suffix('').as_posix().replace('/', '.')}"
        for p in (ROOT / "slothkit").rglob("*.py")
        if p.name != "__init__.py" and "__pycache__" not in p.parts
    }
    assert expected <= modules, f"not importable from the wheel: {sorted(expected - modules)}"

    demo = summary["demo"]
    assert demo["returncode"] == 0, demo["stdout"] + demo["stderr"]
    assert "adapter saved" in demo["stdout"]

    api = summary["api"]
    assert api["losses"][1] < api["losses"][0]
    assert api["generated_new_tokens"] == 6
    assert api["merged_dtype"] in ("torch.bfloat16", "torch.float16"), "merged_16bit wrote another dtype"
    assert api["merged_logit_difference"] < 0.05 * api["logit_spread"]
    assert api["gguf_architecture"] == "llama"
    # Per layer: two norms and seven projections; plus embeddings, final norm and head.
    assert api["gguf_tensors"] >= 9 * api["layers"] + 2

    notebook = summary["notebook"]
    written = notebook["written"]
    assert any(name.endswith(".gguf") for name in written), written
    assert any(name.endswith("adapter_model.safetensors") for name in written), written
    assert any(name.endswith("model.safetensors") and "adapter" not in name for name in written), written
    assert notebook["pushed"], "the notebook's push cell sent nothing to the Hub"


def _wheel_contents(wheel: Path) -> dict[str, str]:
    """{name: sha256} of every file in a wheel but its RECORD (which lists these hashes)."""
    with zipfile.ZipFile(wheel) as archive:
        return {
            name: hashlib.sha256(archive.read(name)).hexdigest()
            for name in archive.namelist()
            if not name.endswith(".dist-info/RECORD")
        }


def test_the_sdist_builds_the_wheel_the_journey_ran(dist, tmp_path):
    """pip given the sdist (where no wheel is offered) builds a wheel from it; that wheel
    holds the same files, byte for byte, with the same metadata and so the same
    dependencies, as the one built from the checkout that the fresh-environment journey
    above installs and runs: the sdist installs that same slothkit."""
    wheel, sdist = dist
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            str(sdist),
        ],
        env=_user_environment(),
    )
    (rebuilt,) = tmp_path.glob("slothkit-*.whl")
    assert _wheel_contents(rebuilt) == _wheel_contents(wheel)


def lowest_declared(names, requirements=None) -> dict[str, str]:
    """{name: the lowest version pyproject.toml declares for it}, among `requirements`
    (default: the dependencies)."""
    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lowest = {}
    for line in project["dependencies"] if requirements is None else requirements:
        requirement = Requirement(line)
        name = requirement.name.lower().replace("-", "_")
        for specifier in requirement.specifier:
            if specifier.operator == ">=" and name in names:
                lowest[name] = specifier.version
    missing = set(names) - set(lowest)
    assert not missing, f"pyproject.toml declares no lower bound for {sorted(missing)}"
    return lowest


def test_lowest_declared_versions_pass_the_core_tests(dist, tmp_path):
    """The lowest dependencies and the lowest test tools of the dev extra, running the
    subset with the README's scheduling: each file, and the notebook, whole on a worker."""
    wheel, _ = dist
    lowest = lowest_declared(LOWEST_TESTED)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    dev_extra = project["optional-dependencies"]["dev"]
    lowest_tools = lowest_declared(LOWEST_TEST_TOOLS, dev_extra)
    venv_dir = tmp_path / "venv"
    python = _fresh_venv(venv_dir)
    pins = {**lowest, **lowest_tools}
    _pip_install(python, TORCH, wheel, *(f"{n}=={v}" for n, v in pins.items()), cwd=tmp_path)

    installed = _run([str(python), "-m", "pip", "list", "--format=json"], cwd=tmp_path).stdout
    found = {row["name"].lower().replace("-", "_"): row["version"] for row in json.loads(installed)}
    assert {name: found.get(name) for name in pins} == pins

    # -P keeps the working directory (this checkout) off sys.path: slothkit comes from the wheel.
    where = _run([str(python), "-P", "-c", "import slothkit; print(slothkit.__file__)"], cwd=ROOT).stdout
    assert where.startswith(str(venv_dir)), where
    _run(
        [str(python), "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadfile"]
        + [*LOWEST_SUBSET, "tests/test_worker_grouping.py"],
        cwd=ROOT,
        env=_user_environment(TRITON_INTERPRET="1"),
        timeout=2400,
    )
