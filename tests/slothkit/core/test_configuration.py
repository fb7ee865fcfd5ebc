"""slothkit.core.configuration: the one reader of SLOTHKIT_* variables, and the list of
every variable in docs/configuration.md."""

import ast
import dataclasses
import re
from pathlib import Path

import pytest

from slothkit.core.configuration import SWITCHES, Defaults, environment_defaults
from slothkit.notebook.config import NotebookConfig

ROOT = Path(__file__).resolve().parents[3]
DOCS = ROOT / "docs" / "configuration.md"
# The modules allowed to read SLOTHKIT_* variables: the configuration module, and the
# notebook layer's own overrides (docs/configuration.md lists both).
ALLOWED = ("slothkit/core/configuration.py", "slothkit/notebook/")
NAME = re.compile(r"SLOTHKIT_[A-Z0-9_]*")


@pytest.mark.parametrize(
    "environ, expected",
    [
        ({}, Defaults(cuda_graphs=None, keep_sums=None)),
        ({"SLOTHKIT_CUDA_GRAPHS": "", "SLOTHKIT_KEEP_SUMS": ""}, Defaults()),  # empty: unset
        ({"SLOTHKIT_CUDA_GRAPHS": "1"}, Defaults(cuda_graphs=True)),
        ({"SLOTHKIT_CUDA_GRAPHS": "0"}, Defaults(cuda_graphs=False)),
        ({"SLOTHKIT_CUDA_GRAPHS": "forward"}, Defaults(cuda_graphs="forward")),
        ({"SLOTHKIT_KEEP_SUMS": "1"}, Defaults(keep_sums=True)),
        (
            {"SLOTHKIT_KEEP_SUMS": "0", "SLOTHKIT_CUDA_GRAPHS": "0"},
            Defaults(cuda_graphs=False, keep_sums=False),
        ),
        ({"SLOTHKIT_MODEL_NAME": "x", "OTHER": "1"}, Defaults()),  # not a library switch
    ],
)
def test_environment_defaults(environ, expected):
    assert environment_defaults(environ) == expected


@pytest.mark.parametrize(
    "environ, message",
    [
        (
            {"SLOTHKIT_CUDA_GRAPHS": "yes"},
            "SLOTHKIT_CUDA_GRAPHS='yes'; accepted: '1', '0', 'forward', or unset",
        ),
        ({"SLOTHKIT_CUDA_GRAPHS": "True"}, "SLOTHKIT_CUDA_GRAPHS='True'; accepted: '1', '0', 'forward'"),
        ({"SLOTHKIT_KEEP_SUMS": "on"}, "SLOTHKIT_KEEP_SUMS='on'; accepted: '1', '0', or unset"),
    ],
)
def test_a_mis_set_variable_is_a_clear_error(environ, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        environment_defaults(environ)


def test_defaults_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Defaults().cuda_graphs = True


def environment_reads(source: str) -> list[str]:
    """Where ``source`` names a SLOTHKIT_* variable in code: a string that is such a name
    (or the prefix of one being built), or an f-string starting with it. Prose that
    mentions one (docstrings, help texts, messages) is not a read."""
    found = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and NAME.fullmatch(node.value):
            found.setdefault(node.lineno, repr(node.value))
        elif isinstance(node, ast.JoinedStr) and node.values:
            first = node.values[0]
            if isinstance(first, ast.Constant) and str(first.value).startswith("SLOTHKIT_"):
                found.setdefault(node.lineno, f"f-string {first.value!r}...")
    return [f"line {line}: {what}" for line, what in sorted(found.items())]


def test_the_scan_finds_reads_and_passes_prose():
    reads = environment_reads(
        "import os\n"
        'a = os.environ.get("SLOTHKIT_CUDA_GRAPHS")\n'
        'b = os.environ[f"SLOTHKIT_{name}"]\n'
        'c = os.getenv("SLOTHKIT_" + name)\n'
        'NAME = "SLOTHKIT_KEEP_SUMS"\n'
        'def f():\n    """Set SLOTHKIT_KEEP_SUMS=1 to keep the sums."""\n'
        'TAG = "SLOTHKIT_BENCH_RESULT "\n'
    )
    assert [read.split(":")[0] for read in reads] == ["line 2", "line 3", "line 4", "line 5"]


def test_only_the_configuration_module_and_the_notebook_layer_read_slothkit_variables():
    offenders = {}
    for package in ("slothkit", "slothkit_kernels"):
        for path in sorted((ROOT / package).rglob("*.py")):
            relative = path.relative_to(ROOT).as_posix()
            if relative.startswith(ALLOWED):
                continue
            reads = environment_reads(path.read_text(encoding="utf-8"))
            if reads:
                offenders[relative] = reads
    assert not offenders, (
        "SLOTHKIT_* variables read outside slothkit/core/configuration.py and the notebook layer "
        f"(make the switch a keyword argument, its default read there): {offenders}"
    )


def _names_in(folder: Path) -> set[str]:
    names = set()
    for path in folder.rglob("*"):
        if path.is_file() and path.suffix in (".py", ".json", ".md", ".txt", ".jinja", ".toml", ".sh"):
            names.update(re.findall(r"SLOTHKIT_[A-Z0-9_]*[A-Z0-9]", path.read_text(encoding="utf-8")))
    return names


def test_every_slothkit_name_is_in_the_configuration_docs():
    documented = DOCS.read_text(encoding="utf-8")
    names = _names_in(ROOT / "slothkit") | _names_in(ROOT / "templates")
    names |= {f"SLOTHKIT_{field.name.upper()}" for field in dataclasses.fields(NotebookConfig)}
    assert "SLOTHKIT_CUDA_GRAPHS" in names and "SLOTHKIT_PIP_SPEC" in names  # the scan sees them
    missing = sorted(name for name in names if f"`{name}`" not in documented)
    assert not missing, f"docs/configuration.md does not list {missing}"


def test_the_docs_give_each_switch_its_keyword_and_values():
    documented = DOCS.read_text(encoding="utf-8")
    for switch in SWITCHES:
        row = next((line for line in documented.splitlines() if f"`{switch.variable}`" in line), "")
        assert f"`{switch.keyword}=`" in row, switch.variable
        for spelling in switch.values:
            assert f"`{spelling}`" in row, (switch.variable, spelling)
