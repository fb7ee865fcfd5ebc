"""The modules of slothkit (and of slothkit_kernels) import each other without a cycle, and
slothkit's wings stand on floors: a wing imports only the wings on the floors below it.

The graph is read from the source (ast), not by importing, so it sees every import: absolute
and relative, at module level and inside functions. Imports inside functions count: a lazy
import only hides a cycle until the call, and it still ties the two modules together (neither
can be read, tested or moved without the other). Imports under `if TYPE_CHECKING:` do not
count: they never run.

An edge goes to the module an import names: `import slothkit.a.b` and
`from slothkit.a import b` (b a module) to slothkit.a.b; `from slothkit.a import f` (f a
name) to slothkit.a, the package's __init__. The packages above the named module are not
edges: Python imports them first, and by then they are already being imported by whoever
came in through them, which is not a cycle of the code's own making.
"""

import ast
import importlib.util
import pathlib

import pytest

PACKAGE = "slothkit"


def _package_sources(package: str = PACKAGE) -> dict[str, str]:
    """{dotted module name: its source} for every module of the package, packages as their
    own name (slothkit.engine for slothkit/engine/__init__.py)."""
    (folder,) = importlib.util.find_spec(package).submodule_search_locations
    root = pathlib.Path(folder)
    sources = {}
    for path in sorted(root.rglob("*.py")):
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        sources[".".join(parts)] = path.read_text()
    return sources


def _is_package(name: str, modules: set[str]) -> bool:
    return any(other.startswith(name + ".") for other in modules)


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of the nodes under `if TYPE_CHECKING:` blocks."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else getattr(test, "attr", None)
            if name == "TYPE_CHECKING":
                for child in node.body:
                    skipped.update(id(inner) for inner in ast.walk(child))
    return skipped


def _imports(name: str, source: str, modules: set[str]) -> set[str]:
    """The package's modules that module `name` imports anywhere in its body."""
    tree = ast.parse(source)
    skipped = _type_checking_only(tree)
    # The package a relative import starts from: the module itself for a package's __init__.
    here = name if _is_package(name, modules) else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the package `here`, one level up per dot after the first
                parts = here.split(".")
                base = ".".join(parts[: len(parts) - (node.level - 1)])
                if not base:  # above the top package: not ours
                    continue
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names
            ]
        else:
            continue
        for target in targets:
            # The longest known module the dotted name starts with (slothkit.a.b.f -> slothkit.a.b).
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def _graph(sources: dict[str, str]) -> dict[str, set[str]]:
    modules = set(sources)
    return {name: _imports(name, source, modules) for name, source in sources.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected group of modules (Tarjan), as the modules
    along it, the first repeated at the end; none when the graph has no cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph.get(node, ())):
            if other not in index:
                connect(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.add(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(group)

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return sorted(_shortest_cycle(graph, group) for group in groups)


def _shortest_cycle(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """The shortest cycle within a strongly connected group, from its first module by name."""
    start = min(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for other in sorted(graph[node] & group):
                if other == start:
                    return paths[node] + [start]
                if other not in paths:
                    paths[other] = paths[node] + [other]
                    following.append(other)
        frontier = following
    raise AssertionError(f"{sorted(group)} is not strongly connected")


@pytest.mark.parametrize(
    "package, some_modules",
    [
        (
            "slothkit",
            {"slothkit", "slothkit.memory.plan", "slothkit.engine.decoder", "slothkit.export.gguf.writer"},
        ),
        ("slothkit_kernels", {"slothkit_kernels", "slothkit_kernels.lora", "slothkit_kernels.utils"}),
    ],
)
def test_no_import_cycle(package, some_modules):
    sources = _package_sources(package)
    assert some_modules <= set(sources)
    cycles = _cycles(_graph(sources))
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in cycles)


def test_the_check_sees_lazy_relative_and_package_imports():
    sources = {
        "p": "from p.a import f\n",
        "p.a": "def f():\n    from p.b import g\n",  # inside a function: counts
        "p.b": "from . import c\n",  # relative: p.c
        "p.c": "from p import f\n",  # a name from the package: its __init__
        "p.d": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from p.a import f\n",
    }
    graph = _graph(sources)
    assert graph == {"p": {"p.a"}, "p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": {"p"}, "p.d": set()}
    assert _cycles(graph) == [["p", "p.a", "p.b", "p.c", "p"]]
    sources["p.c"] = "from ..q import x\nimport p.d\n"  # above the package: not ours
    assert _cycles(_graph(sources)) == []


def test_the_check_names_each_cycle_once():
    graph = {"a": {"b"}, "b": {"a", "c"}, "c": {"b"}, "d": {"e"}, "e": {"d"}, "f": {"a"}}
    assert _cycles(graph) == [["a", "b", "a"], ["d", "e", "d"]]


# slothkit's wings, lowest floor first.  A module's wing is its folder under slothkit/ (the
# modules left at the root are the public face and the command line).  Each wing may import
# its own modules and the wings of lower floors, never a wing on its own floor or above.
FLOORS = [
    {"core"},  # state, notices, configuration, environment, inspection: imports no wing
    {"models", "checkpoint", "compat"},  # family records; checkpoint checks; other libraries' spellings
    {"memory", "data"},  # the memory model and planner; datasets and chat formats
    {"engine"},  # the fused training path, patched onto instances
    {"export"},  # saving, merging, GGUF, the Hub
    {"inference"},  # generation after training, vLLM's calls
    {"loading", "trl"},  # FastModel's loading pipeline; TRL's trainers with slothkit's defaults
    {"face"},  # slothkit, fast_model, chat_templates, vllm, trainers: what users import
    {"testing"},  # tiny fixtures, parity harnesses, a local Hub
    {"bench", "notebook"},  # slothkit bench; notebook templates and their helpers
    {"command_line"},  # cli, demo
]
FACE = {
    "slothkit",
    "slothkit.fast_model",
    "slothkit.fast_vision_model",
    "slothkit.chat_templates",
    "slothkit.vllm",
    "slothkit.trainers",
}
COMMAND_LINE = {"slothkit.cli", "slothkit.demo"}


def _wing(module: str) -> str:
    if module in FACE:
        return "face"
    if module in COMMAND_LINE:
        return "command_line"
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or _is_package(module, _MODULES) else f"root module {module}"


_MODULES = set(_package_sources())


def _floor_of(wing: str) -> int:
    for floor, wings in enumerate(FLOORS):
        if wing in wings:
            return floor
    raise AssertionError(
        f"{wing} has no floor: place the folder in FLOORS (tests/slothkit/test_imports.py), "
        "or move a module left at the package root into the wing it belongs to"
    )


def _upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """'a -> b (wing -> wing)' for each import of a wing on the same floor or above."""
    found = []
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            here, there = _wing(module), _wing(target)
            if here != there and _floor_of(there) >= _floor_of(here):
                found.append(f"{module} -> {target} ({here} -> {there})")
    return found


def test_every_module_stands_in_a_wing_on_a_floor():
    for module in _MODULES:
        _floor_of(_wing(module))


def test_wings_import_only_the_floors_below():
    upward = _upward_imports(_graph(_package_sources()))
    assert not upward, "imports of a wing on the same floor or above:\n" + "\n".join(upward)


def test_the_floor_check_sees_an_import_upward_and_across():
    graph = {
        "slothkit.core.notices": {"slothkit.engine.decoder"},  # up
        "slothkit.memory.plan": {"slothkit.data.packing"},  # across one floor
        "slothkit.engine.decoder": {"slothkit.core.notices", "slothkit.engine.sizes"},  # down; inside
    }
    assert _upward_imports(graph) == [
        "slothkit.core.notices -> slothkit.engine.decoder (core -> engine)",
        "slothkit.memory.plan -> slothkit.data.packing (memory -> data)",
    ]
    with pytest.raises(AssertionError, match="root module slothkit.helpers has no floor"):
        _floor_of(_wing("slothkit.helpers"))


def test_the_kernel_library_knows_nothing_of_slothkit():
    graph = _graph({**_package_sources("slothkit_kernels"), **_package_sources()})
    reaching = sorted(
        f"{module} -> {target}"
        for module, targets in graph.items()
        if module.startswith("slothkit_kernels")
        for target in targets
        if not target.startswith("slothkit_kernels")
    )
    assert not reaching, "\n".join(reaching)
