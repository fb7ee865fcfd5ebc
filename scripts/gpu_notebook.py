"""Run a rendered fine-tune notebook end to end on a GPU, as a user would, and record each
cell's time and the peak reserved GPU memory.

The notebook is `slothkit new-notebook llama-3-8b`'s, unchanged except its config cell's
MODEL_NAME (SmolLM2-135M-Instruct, slothkit.testing.real_models: its wheel must already be
in $SLOTHKIT_CACHE_DIR/wheels on a machine without a package index), OUTPUT_DIR and the
Hub repository, which is a local server speaking the Hub's protocol
(slothkit.testing.local_hub).  Everything else (4-bit loading, LoRA, 60 steps, batch, the
save cell's LoRA adapter, merged 16-bit model and GGUF files, the pushes) is the
notebook's own default.

Runs:
  t4   a T4 stand-in: the kernel sees no bf16 (so it trains in fp16 with loss scaling),
       a 15 GiB cap (torch.cuda.set_per_process_memory_fraction), and slothkit's
       switches as on a compute-capability 7.5 GPU (no layer CUDA graphs, no kept sums).
  bf16 the GPU as it is.

A measuring cell is put before the notebook's first cell of the executed copy (not of
the rendered notebook): it applies the stand-in and registers IPython hooks that write,
after each cell, its wall time and the peak reserved memory since the cell began.

    python scripts/gpu_notebook.py --out DIR [--runs t4,bf16] [--steps 60]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

MEASURE = """\
# Measurement only (scripts/gpu_notebook.py): not part of the notebook.
import json as _json, time as _time, torch as _torch
_STANDIN = {standin!r}
_CUDA = _torch.cuda.is_available()  # False only in a smoke test of this script on a CPU
if _STANDIN == "t4" and _CUDA:
    _torch.cuda.is_bf16_supported = lambda *args, **kwargs: False  # a T4 has no bf16
    _torch.cuda.set_per_process_memory_fraction(
        min(1.0, 15 * 2**30 / _torch.cuda.get_device_properties(0).total_memory)
    )
_cells = {{"start": _time.perf_counter()}}

def _before(info):
    if _CUDA:
        _torch.cuda.synchronize()
        _torch.cuda.reset_peak_memory_stats()
    _cells["start"] = _time.perf_counter()

def _after(result):
    if _CUDA:
        _torch.cuda.synchronize()
    with open({log!r}, "a") as _handle:
        _handle.write(_json.dumps({{
            "seconds": _time.perf_counter() - _cells["start"],
            "peak_reserved_gib": _torch.cuda.max_memory_reserved() / 2**30 if _CUDA else 0.0,
            "peak_allocated_gib": _torch.cuda.max_memory_allocated() / 2**30 if _CUDA else 0.0,
            "error": result.error_in_exec is not None,
            "source": (result.info.raw_cell or "")[:80],
        }}) + "\\n")

get_ipython().events.register("pre_run_cell", _before)
get_ipython().events.register("post_run_cell", _after)
"""


def run(standin: str, out: Path, checkpoint: Path, hub, steps: int) -> dict:
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    from slothkit.notebook.render import write_notebook

    folder = out / standin
    folder.mkdir(parents=True, exist_ok=True)
    values = {
        "MODEL_NAME": str(checkpoint),
        "OUTPUT_DIR": str(folder / "outputs"),
        "HUB_REPO": f"local-user/smollm2-llama-3-notebook-{standin}",
        "MAX_STEPS": steps,
    }
    notebook_path, _ = write_notebook(
        "finetune", "llama-3-8b", folder / "notebook", overwrite=True, config_values=values
    )
    notebook = nbformat.read(notebook_path, as_version=4)
    log = folder / "cells.jsonl"
    log.unlink(missing_ok=True)
    notebook.cells.insert(0, nbformat.v4.new_code_cell(MEASURE.format(standin=standin, log=str(log))))
    environment = {**hub.client_env(), "SLOTHKIT_HUB_TOKEN": hub.token, "HF_HUB_OFFLINE": "0"}
    if os.environ.get("SLOTHKIT_NO_INSTALL"):  # a machine that reaches no package index
        environment["SLOTHKIT_NO_INSTALL"] = os.environ["SLOTHKIT_NO_INSTALL"]
    if standin == "t4":  # slothkit's defaults below compute capability 8.0
        environment.update(SLOTHKIT_CUDA_GRAPHS="0", SLOTHKIT_KEEP_SUMS="0")
    saved = {key: os.environ.get(key) for key in environment}
    os.environ.update(environment)
    client = NotebookClient(
        notebook, timeout=1800, kernel_name="python3", resources={"metadata": {"path": str(folder)}}
    )
    start = time.perf_counter()
    failure = None
    try:
        client.execute()
    except CellExecutionError as error:
        failure = str(error).splitlines()[-1] if str(error) else type(error).__name__
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        nbformat.write(notebook, folder / "executed.ipynb")
    total = time.perf_counter() - start

    measured = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    code_cells = [cell for cell in notebook.cells if cell.cell_type == "code"][1:]  # skip the measuring cell
    headings, heading = [], None
    for cell in notebook.cells[1:]:
        if cell.cell_type == "markdown" and cell.source.startswith("## "):
            heading = cell.source[3:].strip()
        elif cell.cell_type == "code":
            headings.append(heading or cell.source.splitlines()[0])
    measured = [entry for entry in measured if not entry["source"].startswith("# Measurement only")]
    cells = [{"cell": name, **figures} for name, figures in zip(headings, measured)]
    outputs = folder / "outputs"
    files = {
        str(path.relative_to(outputs)): path.stat().st_size
        for path in sorted(outputs.rglob("*"))
        if path.is_file() and "checkpoints" not in path.parts
    }
    pushed = {repo: sorted(hub.files(repo)) for repo in _pushed_repos(values["HUB_REPO"], hub)}
    return {
        "run": standin,
        "ok": failure is None,
        "failure": failure,
        "seconds": total,
        "cells": cells,
        "cells_run": sum(1 for cell in code_cells if cell.get("execution_count")),
        "cells_total": len(code_cells),
        "peak_reserved_gib": max((c["peak_reserved_gib"] for c in cells), default=None),
        "outputs": files,
        "hub": pushed,
    }


def _pushed_repos(repo: str, hub) -> list[str]:
    found = []
    for name in (f"{repo}-lora", repo, f"{repo}-gguf"):
        try:
            hub.files(name)
        except Exception:  # noqa: BLE001 - the local Hub raises for a repository never pushed
            continue
        found.append(name)
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--runs", default="t4,bf16")
    parser.add_argument("--steps", type=int, default=60, help="MAX_STEPS (the notebook's default, 60)")
    args = parser.parse_args(argv)

    import torch

    from slothkit.testing import real_model_path
    from slothkit.testing.local_hub import LocalHub

    start = time.perf_counter()
    checkpoint = real_model_path("smollm2-135m-instruct")
    prepared = time.perf_counter() - start
    records = []
    with LocalHub() as hub:
        for standin in args.runs.split(","):
            records.append(run(standin, args.out, checkpoint, hub, args.steps))
    record = {
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none (CPU)",
        "torch": torch.__version__,
        "checkpoint_seconds": prepared,
        "runs": records,
    }
    (args.out / "notebook-runs.json").write_text(json.dumps(record, indent=1))
    for entry in records:
        print(
            f"== {entry['run']}: {'ok' if entry['ok'] else 'FAILED: ' + str(entry['failure'])}, "
            f"{entry['cells_run']}/{entry['cells_total']} cells, {entry['seconds']:.0f} s, "
            f"peak reserved {entry['peak_reserved_gib']:.2f} GiB"
        )
        for cell in entry["cells"]:
            print(
                f"   {cell['cell'][:48]:48s} {cell['seconds']:7.1f} s  {cell['peak_reserved_gib']:6.2f} GiB"
            )
        print(
            f"   outputs: {', '.join(f'{k} ({v / 2**20:.1f} MiB)' for k, v in entry['outputs'].items() if k.endswith(('.gguf', '.safetensors')))}"
        )
        print(f"   hub: {entry['hub']}")
    return 0 if all(entry["ok"] for entry in records) else 1


if __name__ == "__main__":
    sys.exit(main())
