"""What ``slothkit.bench.kernels`` writes: the environment of the run, the rows as a text
or Markdown table, and the Markdown report.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import shlex
import subprocess

import torch

from slothkit.bench.kernel_timing import Row


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _driver_version() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return out.strip().splitlines()[0] if out.strip() else None


def environment(device: torch.device, argv: list[str], copy_gb_per_s: float) -> dict:
    cuda = device.type == "cuda"
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python -m slothkit.bench.kernels " + shlex.join(argv),
        "device": device.type,
        "gpu": torch.cuda.get_device_name(device) if cuda else "none (CPU harness check)",
        "driver": _driver_version() if cuda else None,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "transformers": _version("transformers"),
        "bitsandbytes": _version("bitsandbytes"),
        "triton_interpreter": os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
        "copy_gb_per_s": copy_gb_per_s,
    }


COLUMNS = (
    "kernel",
    "shape",
    "dtype",
    "pass",
    "impl",
    "ms",
    "GB/s",
    "% copy BW",
    "TFLOP/s",
    "vs eager",
    "peak MiB",
    "rel err",
    "note",
)


def _cells(row: Row) -> list[str]:
    def num(value, fmt):
        return "-" if value is None else format(value, fmt)

    note = "" if row.status == "ok" else f"{row.status}: {row.error}"
    if row.status == "ok" and row.timing not in ("launch", "cuda-graph"):
        note = row.timing
    if len(note) > 90:
        note = note[:87] + "..."
    return [
        row.op,
        row.shape,
        row.dtype,
        row.mode,
        row.impl,
        num(row.ms, ".3f"),
        num(row.gb_per_s, ".1f"),
        num(row.pct_copy_bw, ".1f"),
        num(row.tflop_per_s, ".1f"),
        num(row.speedup_vs_eager, ".2f"),
        num(row.peak_mib, ".1f"),
        num(row.rel_err, ".1e"),
        note,
    ]


def text_table(rows: list[Row]) -> str:
    table = [list(COLUMNS)] + [_cells(r) for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown_table(rows: list[Row]) -> str:
    def line(cells):
        return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"

    lines = [line(COLUMNS), line(["---"] * len(COLUMNS))]
    return "\n".join(lines + [line(_cells(r)) for r in rows])


def markdown_report(env: dict, rows: list[Row], notes: dict[str, str]) -> str:
    packages = ("torch", "triton", "transformers", "bitsandbytes")
    versions = ", ".join(f"{k} {env[k]}" for k in packages if env[k])
    lines = [
        "# slothkit_kernels benchmark",
        "",
        f"- GPU: {env['gpu']} (driver {env['driver']}, CUDA {env['cuda']})",
        f"- {versions}",
        f"- device-to-device copy (bytes read + written): {env['copy_gb_per_s']:.1f} GB/s",
        f"- date: {env['date']}",
        f"- command: `{env['command']}`",
        "" if env["complete"] else "\n**Incomplete: written before the last case finished.**\n",
        markdown_table(rows),
        "",
        "timing: replays of a CUDA graph of each call (--cuda-graph), except rows whose note says otherwise"
        if "--cuda-graph" in env["command"]
        else "timing: triton.testing.do_bench of each call, Python and launch overhead included",
        "",
        "ms: median per call; GB/s: least bytes the op must move (inputs read once, outputs",
        "written once) / time; vs eager: eager ms / ms; peak MiB: memory beyond the inputs;",
        "rel err: against eager (outputs for fwd, input gradients for fwd+bwd).",
        "",
    ]
    lines += [f"- {op}: {note}" for op, note in notes.items()]
    return "\n".join(lines) + "\n"
