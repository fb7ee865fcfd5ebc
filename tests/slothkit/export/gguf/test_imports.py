"""The modules of slothkit.export.gguf import each other without a cycle, counting the imports
inside functions too (a lazy import only hides a cycle until the call)."""

import ast
import importlib.util
import pathlib

PACKAGE = "slothkit.export.gguf"


def _package_sources() -> dict[str, str]:
    """{module name within the package ("writer", "__init__"): its source}."""
    (folder,) = importlib.util.find_spec(PACKAGE).submodule_search_locations
    return {path.stem: path.read_text() for path in pathlib.Path(folder).glob("*.py")}


def _imports(source: str, modules: set[str]) -> set[str]:
    """The package's modules that `source` imports anywhere in its body. Importing a name from
    the package itself (`from slothkit.export.gguf import f`) runs its __init__."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level > 1:  # relative, above this package
                continue
            if node.level:  # relative, within this package
                base = PACKAGE + ("." + base if base else "")
            targets = [f"{base}.{alias.name}" if base == PACKAGE else base for alias in node.names]
        else:
            continue
        for target in targets:
            if target == PACKAGE:
                found.add("__init__")
            elif target.startswith(PACKAGE + "."):
                name = target[len(PACKAGE) + 1 :].split(".")[0]
                found.add(name if name in modules else "__init__")
    return found


def _cycle(sources: dict[str, str]) -> list[str] | None:
    """A cycle in the import graph of `sources`, as the list of modules along it, or None."""
    graph = {name: _imports(source, set(sources)) for name, source in sources.items()}
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> list[str] | None:
        if name in path:
            return path[path.index(name) :] + [name]
        if name in done:
            return None
        for imported in sorted(graph.get(name, ())):
            cycle = visit(imported, path + [name])
            if cycle:
                return cycle
        done.add(name)
        return None

    for name in sorted(graph):
        cycle = visit(name, [])
        if cycle:
            return cycle
    return None


def test_no_import_cycle_in_the_gguf_package():
    sources = _package_sources()
    assert {"__init__", "writer", "layout", "verify", "tensor_types"} <= set(sources)
    assert _cycle(sources) is None, " -> ".join(_cycle(sources))


def test_the_check_sees_cycles_through_lazy_imports_and_the_package():
    """The shape of the cycle the package once had: the writer imported the verifier inside a
    function, and the verifier the reader from the package, whose __init__ imports the writer."""
    sources = {
        "__init__": "from slothkit.export.gguf.writer import save_pretrained_gguf\n",
        "writer": "def save():\n    from slothkit.export.gguf.verify import verify_gguf\n",
        "verify": "def verify():\n    from slothkit.export.gguf import hf_weights_from_gguf\n",
        "layout": "import torch\n",
    }
    assert _cycle(sources) == ["__init__", "writer", "verify", "__init__"]
    sources["verify"] = "from slothkit.export.gguf.layout import hf_weights_from_gguf\n"
    assert _cycle(sources) is None
    sources["layout"] = "from . import writer\n"  # relative imports count as well
    assert _cycle(sources) == ["writer", "verify", "layout", "writer"]
