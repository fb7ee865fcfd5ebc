"""Render a notebook from a template and run it top to bottom on the embedded default.

This is `slothkit demo`: what a user meets first, with no GPU and no download.  The
notebook is the one `slothkit new-notebook` writes for a real model; only its
settings are redirected, through the same SLOTHKIT_* variables the tests use, to a
tiny random model of the same architecture (slothkit.testing) and the example data
shipped with slothkit.  It trains, then saves the LoRA adapter, the merged 16-bit
model and a GGUF file; the executed notebook is kept beside them (and as HTML when
asked), so what ran can be read afterwards.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from pathlib import Path

DEFAULT_MODEL = "llama-3-8b"
DEFAULT_TEMPLATE = "finetune"


def demo_environment(model: str, output_dir: Path, steps: int) -> dict[str, str]:
    """The SLOTHKIT_* overrides that point a rendered notebook at the offline default.
    The dataset is left to the template: each one's default is the example data shipped
    with slothkit for its workflow (instructions, chats, preference pairs)."""
    from slothkit.notebook.render import architecture_of
    from slothkit.testing import tiny_model_path

    return {
        "SLOTHKIT_NO_INSTALL": "1",  # the packages are here already: this is slothkit's own install
        "SLOTHKIT_MODEL_NAME": str(tiny_model_path(architecture_of(model).name)),
        "SLOTHKIT_LOAD_IN_4BIT": "0",
        "SLOTHKIT_MAX_STEPS": str(steps),
        "SLOTHKIT_LEARNING_RATE": "0.002",
        "SLOTHKIT_OUTPUT_DIR": str(output_dir / "outputs"),
        "SLOTHKIT_SAVE_LORA": "1",
        "SLOTHKIT_SAVE_MERGED": "1",
        "SLOTHKIT_SAVE_GGUF": "1",
        # Tiny hidden sizes are not multiples of 256, so K-quants would fall back anyway.
        "SLOTHKIT_GGUF_QUANTS": "q8_0",
        "SLOTHKIT_HUB_REPO": "",
        # On a CPU the kernels run their torch reference; the Triton interpreter is for tests.
        "TRITON_INTERPRET": "0",
    }


@contextlib.contextmanager
def _environment(overrides: dict[str, str]):
    """The kernel is a child process and inherits os.environ when it starts."""
    saved = {key: os.environ.get(key) for key in overrides}
    os.environ.update(overrides)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class NotebookCellError(RuntimeError):
    """A cell of the demo notebook raised; the message names the cell and the error, and
    the executed notebook (written back to its path) holds the full traceback."""


def execute_notebook(path: Path, environment: dict[str, str], timeout: int = 1800):
    """Run every cell of the notebook at `path` in a fresh kernel; return the executed
    notebook (also written back to `path`, a failed run with its outputs up to the
    failure). A failing cell raises NotebookCellError."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(
        notebook,
        timeout=timeout,
        kernel_name="python3",
        resources={"metadata": {"path": str(path.parent)}},
        # A local kernel on loopback: its warning about unencrypted TCP
        # is noise here; errors inside cells still show.
        extra_arguments=["--IPKernelApp.log_level=ERROR"],
    )
    with _environment(environment):
        try:
            client.execute()
        except CellExecutionError as error:
            raise NotebookCellError(_describe_failure(notebook, error, path)) from None
        finally:
            nbformat.write(notebook, path)  # a failed run keeps its outputs up to the failure
    return notebook


def _describe_failure(notebook, error, path: Path) -> str:
    """'step N (heading) failed: Type: message', from the first cell with an error output."""
    heading = None
    for cell in notebook.cells:
        if cell.cell_type == "markdown" and cell.source.startswith("## "):
            heading = cell.source[3:].strip()
        for output in cell.get("outputs", []):
            if output.get("output_type") == "error":
                where = f"step {heading}" if heading else "a cell"
                return (
                    f"{where} failed: {output.get('ename')}: {output.get('evalue')} "
                    f"(full traceback in {path})"
                )
    return (
        f"a cell failed: {getattr(error, 'ename', type(error).__name__)}: {getattr(error, 'evalue', error)}"
    )


def write_html(path: Path) -> Path:
    """The executed notebook as a standalone HTML page (nbconvert), beside it."""
    try:
        from nbconvert import HTMLExporter
    except ImportError as error:
        raise ImportError("writing HTML needs nbconvert: pip install nbconvert") from error

    body, _ = HTMLExporter().from_filename(str(path))
    html = path.with_suffix(".html")
    html.write_text(body, encoding="utf-8")
    return html


def run_notebook_demo(
    model: str = DEFAULT_MODEL,
    template: str = DEFAULT_TEMPLATE,
    output_dir: str | Path = "slothkit-demo",
    steps: int = 16,
    html: bool = False,
    overwrite: bool = False,
) -> dict:
    """Render `template` for `model`, execute it on the offline default and check that
    the adapter, the merged model and the GGUF file exist.  Returns what was written."""
    import importlib.util

    from slothkit.notebook.render import write_notebook

    if html and importlib.util.find_spec("nbconvert") is None:  # say so before the long run
        raise ImportError("writing HTML needs nbconvert: pip install nbconvert")
    output_dir = Path(output_dir)
    notebook_path, script_path = write_notebook(
        template, model, output_dir / f"{model}-{template}", overwrite=overwrite
    )
    environment = demo_environment(model, output_dir.resolve(), steps)
    start = time.perf_counter()
    notebook = execute_notebook(notebook_path, environment)
    elapsed = time.perf_counter() - start

    outputs = output_dir / "outputs"
    artefacts = {
        "notebook": notebook_path,
        "paired script": script_path,
        "lora adapter": outputs / "lora",
        "merged 16-bit": outputs / "merged-16bit",
        "gguf": next(iter(sorted((outputs / "gguf").glob("*.gguf"))), outputs / "gguf"),
    }
    missing = [name for name, path in artefacts.items() if not path.exists()]
    if missing:
        raise RuntimeError(
            f"the notebook ran but did not write: {', '.join(missing)} "
            f"(see the executed notebook {notebook_path})"
        )
    if html:
        artefacts["html"] = write_html(notebook_path)
    return {
        "artefacts": artefacts,
        "seconds": elapsed,
        "cells": len(notebook.cells),
        "loss": _logged_loss(notebook),
    }


def _logged_loss(notebook) -> tuple[float, float] | None:
    """(first, final) training loss from the line the train cell prints
    ("N steps in S s; loss A -> B"), or None when it printed none."""
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            match = re.search(r"; loss ([0-9.]+) -> ([0-9.]+)", output.get("text", ""))
            if match:
                return float(match.group(1)), float(match.group(2))
    return None
