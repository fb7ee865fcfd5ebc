"""How a benchmark record's setting and figures are written into a table's cells, for
the README's overview (``report_overview``) and docs/benchmarks.md's tables
(``report_tables``).
"""

from __future__ import annotations


def _setting(record: dict) -> str:
    """How the run was made, beside its mode: dtype, autocast (records before the switch
    existed ran under autocast), slothkit's switches where set, memory cap (and with
    --best, that each implementation ran in its fastest setting under it), and the GPUs
    of a --gpus run."""
    parts = [record["dtype"]]
    if not record.get("autocast", True):
        parts.append("no autocast")
    checkpointing = record.get("slothkit_checkpointing", "offload")
    if checkpointing != "offload":
        parts.append(
            {"on": "slothkit checkpointing on GPU"}.get(
                checkpointing, f"slothkit checkpointing {checkpointing}"
            )
        )
    for key, what in (("slothkit_cuda_graphs", "CUDA graphs"), ("slothkit_keep_sums", "keep sums")):
        if record.get(key, "auto") != "auto":
            parts.append(f"{what} {record[key]}")
    # Runs before the "auto" backend (torch._grouped_mm where it applies on compute
    # capability 9.0 and up) ran the Triton kernel by default and say "triton".
    if record.get("slothkit_moe_gemm", "auto") not in ("auto", "triton"):
        parts.append(f"slothkit's experts through {record['slothkit_moe_gemm']}")
    if record.get("hf_checkpointing", "on") != "on" and not record.get("best"):
        parts.append("HF and Liger without checkpointing")
    if record.get("memory_gib"):
        cap = f"{record['memory_gib']:g} GiB"
        parts.append(f"each at its fastest under {cap}" if record.get("best") else f"{cap} cap")
    if record.get("gpus", 1) > 1:  # bench train --gpus N: tokens/s of all N, memory per GPU
        parts.append(f"DDP on {record['gpus']} GPUs")
    return ", ".join(parts)


MISSING = "\u2014"  # an em dash: the run did not record this figure


def _figure(value, fmt: str) -> str:
    return fmt.format(value) if value is not None else MISSING


def _gib(row: dict, key: str) -> str:
    return _figure(row.get(key), "{:.1f}")


def host_cell(row: dict) -> str:
    """The worker's peak resident host memory over the training steps, in GiB.  Records
    made before the peak was restarted at the first step have the process's lifetime
    peak, loading included (a peer that loads a 16-bit checkpoint from disk peaks there):
    for those, the resident memory at the end of the steps, marked "(end)"."""
    if row.get("peak_host_scope") != "steps" and "peak_host_gib" in row and "host_rss_gib" in row:
        return f"{row['host_rss_gib']:.1f} (end)"
    return _gib(row, "peak_host_gib")


def memory_cells(row: dict) -> list[str]:
    """Peak GPU memory allocated and reserved, and the worker's peak resident host memory
    over the steps (``host_cell``), in GiB; an em dash for a figure the record lacks."""
    return [_gib(row, "peak_allocated_gib"), _gib(row, "peak_reserved_gib"), host_cell(row)]


def setting_of(row: dict) -> str:
    """The setting a --best run chose for the row ("" for other runs); for slothkit's
    "auto", how many layers it kept."""
    setting = row.get("setting") or ""
    recompute = row.get("recompute")
    if setting and recompute:
        setting += f", {recompute['kept_layers']} of {recompute['layers']} layers kept"
        if recompute.get("on_gpu_layers"):
            setting += f", {recompute['on_gpu_layers']} checkpointed on the GPU (host memory)"
    return setting


def _table(columns: list[str], records: list[dict], row_cells) -> str:
    """A markdown table with one line per row of every record: the GPU, then
    row_cells(record, row), then the record's file."""
    lines = ["| " + " | ".join(["GPU", *columns, "record"]) + " |", "|" + "---|" * (len(columns) + 2)]
    for record in records:
        gpu = record["accelerator"].get("name", "cpu")
        for row in record["rows"]:
            cells = [gpu, *row_cells(record, row), f"`results/bench/{record['_file']}`"]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(row: dict, key: str, fmt: str) -> str:
    """The formatted figure, or "-" where the run did not measure it (no HF in the run)."""
    return fmt.format(row[key]) if row.get(key) is not None else "-"


def is_t4_standin(record: dict) -> bool:
    """A `bench train --t4` run: fp16 under a 15 GiB cap, a memory check for the planner
    (two timed steps at batch 1; its speed is not a side-by-side figure)."""
    return record["dtype"] == "fp16" and record.get("memory_gib") == 15
