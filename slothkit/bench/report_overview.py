"""README.md's benchmark overview: one line per model and mode, from the latest runs."""

from __future__ import annotations

from slothkit.bench.report_cells import _cell, _setting, is_t4_standin, memory_cells


def _latest(records: list[dict]) -> dict:
    return max(records, key=lambda r: (r.get("date", ""), r["_file"]))


def _row(record: dict, impl: str, batch: int | None = None) -> dict | None:
    return next(
        (r for r in record["rows"] if r["impl"] == impl and (batch is None or r.get("batch") == batch)),
        None,
    )


def _ok(row: dict | None) -> bool:
    return row is not None and row.get("status") == "ok"


def _is_comparison(record: dict) -> bool:
    """A training run that stands for its model and mode in the overview: slothkit and HF +
    PEFT both trained, and it is neither a T4 stand-in (a memory check) nor a --best run
    (each implementation in a setting of its own)."""
    return (
        _ok(_row(record, "slothkit"))
        and _ok(_row(record, "hf"))
        and not is_t4_standin(record)
        and not record.get("best")
    )


def _training_cells(record: dict | None) -> list[str]:
    """Setting, slothkit's tokens/s, its ratios to HF + PEFT and to Unsloth in the same run,
    and slothkit's and HF + PEFT's peak GPU memory allocated / reserved."""
    if record is None:
        return ["-"] * 6
    mine, hf, unsloth = (_row(record, impl) for impl in ("slothkit", "hf", "unsloth"))
    if _ok(unsloth):
        vs_unsloth = f"{mine['tokens_per_s'] / unsloth['tokens_per_s']:.2f}x"
    else:
        vs_unsloth = unsloth["status"] if unsloth else "-"
    return [
        f"{_setting(record)}, {record['batch']} x {record['seq']}",
        f"{mine['tokens_per_s']:,.0f}",
        _cell(mine, "vs_hf", "{:.2f}x"),
        vs_unsloth,
        " / ".join(memory_cells(mine)[:2]),
        " / ".join(memory_cells(hf)[:2]),
    ]


def _decode_cell(records: list[dict], batch: int) -> str:
    """slothkit's decode tokens/s at `batch` in the latest run that measured it (ratio to HF
    generate where that run has it); runs under a memory cap (the T4 stand-in) stand apart."""
    runs = [r for r in records if not r.get("memory_gib") and _ok(_row(r, "slothkit", batch))]
    if not runs:
        return "-"
    row = _row(_latest(runs), "slothkit", batch)
    ratio = f" ({row['vs_hf']:.1f}x)" if row.get("vs_hf") is not None else ""
    return f"{row['tokens_per_s']:,.1f}{ratio}"


def _context_cell(records: list[dict]) -> str:
    """slothkit's longest batch-1 training sequence under a memory cap, in the latest run
    that found one; "or more" where no longer sequence was probed."""
    runs = [r for r in records if _ok(_row(r, "slothkit")) and _row(r, "slothkit").get("longest_seq")]
    if not runs:
        return "-"
    record = _latest(runs)
    row = _row(record, "slothkit")
    more = "" if row.get("first_failing_seq") else " or more"
    return f"{row['longest_seq']:,}{more} under {record['memory_gib']:g} GiB"


def overview(train: list[dict], generate: list[dict], context: list[dict]) -> str:
    """README: one line per model and mode.  Training: the latest run in which slothkit and
    HF + PEFT both trained (``_is_comparison``); decode: the latest run per batch size;
    context: the latest run that found slothkit's longest sequence."""

    def by_model_and_mode(records):
        groups: dict[tuple[str, str], list[dict]] = {}
        for record in records:
            groups.setdefault((record["model"], record["mode"]), []).append(record)
        return groups

    train_runs = by_model_and_mode(r for r in train if _is_comparison(r))
    decode_runs, context_runs = by_model_and_mode(generate), by_model_and_mode(context)
    header = [
        "model",
        "mode",
        "training run",
        "slothkit tokens/s",
        "vs HF + PEFT",
        "vs Unsloth",
        "peak GiB slothkit",
        "peak GiB HF + PEFT",
        "decode tokens/s, batch 1",
        "decode, batch 8",
        "longest context",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for model, mode in sorted(set(train_runs) | set(decode_runs) | set(context_runs)):
        key = (model, mode)
        training = _latest(train_runs[key]) if key in train_runs else None
        decode = decode_runs.get(key, [])
        cells = [
            model,
            {"lora": "LoRA", "qlora": "QLoRA"}.get(mode, mode),
            *_training_cells(training),
            _decode_cell(decode, 1),
            _decode_cell(decode, 8),
            _context_cell(context_runs.get(key, [])),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
