"""docs/benchmarks.md's tables (``report.full_table`` puts them together): the
implementations side by side per setting, the T4 stand-in beside the planner's
prediction, the context and generation runs, and every row of every training record.
"""

from __future__ import annotations

from slothkit.bench.report_cells import _cell, _figure, _setting, _table, memory_cells, setting_of


def _train_cells(record: dict, row: dict) -> list[str]:
    figures = (
        [row["status"], "-", "-", "-", "-", "-", "-"]
        if row["status"] != "ok"
        else [
            _cell(row, "tokens_per_s", "{:,.0f}"),
            _cell(row, "vs_hf", "{:.2f}x"),
            *memory_cells(row),
            _cell(row, "training_gib", "{:.1f}"),
            _cell(row, "final_loss", "{:.4f}"),
        ]
    )
    setting = setting_of(row)
    return [
        record["model"],
        f"{record['mode']} ({_setting(record)})",
        f"{record['batch']} x {record['seq']}",
        row["impl"] + (f" ({setting})" if setting else ""),
        *figures,
    ]


def _context_cells(record: dict, row: dict) -> list[str]:
    if row.get("status", "ok") == "ok" and row.get("longest_seq"):
        failing = row.get("first_failing_seq")
        longest, failing = f"{row['longest_seq']:,}", f"{failing:,}" if failing else "none probed"
    else:
        longest, failing = row.get("status") or "nothing fits", "-"
    return [
        record["model"],
        f"{record['mode']} ({record['dtype']})",
        f"{record['memory_gib']:g} GiB",
        row["impl"],
        longest,
        failing,
    ]


def render(records: list[dict]) -> str:
    columns = [
        "model",
        "mode",
        "batch x seq",
        "implementation",
        "tokens/s",
        "vs HF + PEFT",
        "allocated GiB",
        "reserved GiB",
        "host GiB",
        "GiB above weights",
        "final loss",
    ]
    return _table(columns, records, _train_cells)


def _impl_cell(record: dict, impl: str) -> str:
    row = next((r for r in record["rows"] if r["impl"] == impl), None)
    if row is None:
        return "not in this run"
    if row["status"] != "ok":
        return row["status"]
    ratio = f" ({row['vs_hf']:.2f}x)" if row.get("vs_hf") is not None else ""
    setting = setting_of(row)
    return f"{row['tokens_per_s']:,.0f}{ratio}, {' / '.join(memory_cells(row))} GiB" + (
        f", {setting}" if setting else ""
    )


def _ok_rows(record: dict) -> int:
    """Implementations that worked; extra source trees of slothkit (``slothkit@DIR``, an
    A/B inside a comparison run) are not more implementations."""
    return sum(r["status"] == "ok" and "@" not in r["impl"] for r in record["rows"])


def summarise_records(records: list[dict]) -> list[dict]:
    """Per setting (model, mode, dtype/autocast/cap, batch x seq): the latest run, and
    also the run with the most implementations that worked if that is an earlier one
    (a later run of fewer peers must not hide the full comparison, nor the full
    comparison hide newer code).  Only runs with an HF + PEFT row that worked count: every
    ratio refers to it, and a run without it (an A/B of two slothkit versions, a
    checkpointing variant) is a diagnostic, listed with every other row in
    docs/benchmarks.md."""
    groups: dict[tuple, list[dict]] = {}
    for record in records:
        if not any(r["impl"] == "hf" and r["status"] == "ok" for r in record["rows"]):
            continue
        key = (record["model"], record["mode"], _setting(record), record["batch"], record["seq"])
        groups.setdefault(key, []).append(record)
    chosen = []
    for key in sorted(groups):
        runs = sorted(groups[key], key=lambda r: (r.get("date", ""), r["_file"]))
        latest = runs[-1]
        fullest = max(reversed(runs), key=_ok_rows)  # the latest among the fullest
        chosen += [fullest, latest] if fullest is not latest else [latest]
    return chosen


def render_summary(records: list[dict]) -> str:
    """Implementations side by side, one line per setting: tokens/s (ratio to HF + PEFT
    in the same run), then peak GPU memory allocated / reserved and peak host memory in
    GiB (``memory_cells``), and for a --best run the setting each ran in."""
    impls = ["slothkit", "hf", "liger", "unsloth"]
    names = {"slothkit": "slothkit", "hf": "HF + PEFT", "liger": "HF + Liger", "unsloth": "Unsloth"}
    lines = [
        "| "
        + " | ".join(
            ["GPU", "run (UTC)", "model", "mode", "batch x seq", *(names[i] for i in impls), "record"]
        )
        + " |",
        "|" + "---|" * (len(impls) + 6),
    ]
    for record in summarise_records(records):
        when = record.get("date", "")[:16].replace("T", " ") or "-"
        cells = [
            record["accelerator"].get("name", "cpu"),
            when,
            record["model"],
            f"{record['mode']} ({_setting(record)})",
            f"{record['batch']} x {record['seq']}",
            *(_impl_cell(record, impl) for impl in impls),
            f"`results/bench/{record['_file']}`",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _t4_cells(record: dict, row: dict) -> list[str]:
    from slothkit.memory.plan import plan

    predicted = plan(
        record["model"],
        gpu="t4",
        seq=record["seq"],
        batch=record["batch"],
        mode=record["mode"],
        rank=record["rank"],
    )
    allocated, reserved = row.get("peak_allocated_gib"), row.get("peak_reserved_gib")
    error = f"{predicted.total_gib / reserved - 1:+.0%}" if reserved else "-"
    return [
        record["model"],
        record["mode"],
        f"{record['batch']} x {record['seq']}",
        row["impl"],
        row["status"]
        if row["status"] != "ok"
        else " / ".join(_figure(v, "{:.2f}") for v in (allocated, reserved)),
        f"{predicted.allocated_gib:.2f} / {predicted.total_gib:.2f}",
        error,
    ]


def render_t4(records: list[dict]) -> str:
    """The --t4 runs beside what `slothkit plan --gpu t4` predicts for the same setting."""
    columns = [
        "model",
        "mode",
        "batch x seq",
        "implementation",
        "measured peak GiB, allocated / reserved",
        "planner GiB, allocated / reserved",
        "planner error, reserved",
    ]
    return _table(columns, records, _t4_cells)


def render_context(records: list[dict]) -> str:
    """The `slothkit bench context` records: longest batch-1 sequence that trains one step."""
    if not records:
        return ""
    columns = ["model", "mode", "memory cap", "implementation", "longest sequence", "first failing"]
    return _table(columns, sorted(records, key=lambda r: r.get("date", "")), _context_cells)


def _generate_cell(row: dict | None) -> str:
    if row is None:
        return "not in this run"
    if row.get("status") != "ok":
        return row.get("status") or "-"
    notes = []
    if row.get("vs_hf") is not None:
        notes.append(f"{row['vs_hf']:.2f}x")
    if row.get("share_of_limit") is not None:
        notes.append(f"{row['share_of_limit']:.0%} of the bandwidth limit")
    return f"{row['tokens_per_s']:,.1f}" + (f" ({', '.join(notes)})" if notes else "")


def render_generate(records: list[dict]) -> str:
    """`slothkit bench generate`: tokens/s per batch size side by side (ratio to HF
    generate in the same run, and share of the bandwidth limit where the record has it),
    time to first token on the long prompt at batch 1."""
    if not records:
        return ""
    impls = ["slothkit", "hf", "unsloth"]
    header = ["GPU", "model", "mode", "batch", "slothkit", "HF generate", "Unsloth"]
    if any(row.get("impl") == "slothkit-merged" for record in records for row in record["rows"]):
        impls.append("slothkit-merged")
        header.append("slothkit, adapters merged")
    header += ["TTFT s slothkit / HF", "record"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for record in sorted(records, key=lambda r: (r["model"], r["mode"], r.get("date", ""))):
        setting = record["dtype"] + (
            f", {record['memory_gib']:g} GiB cap" if record.get("memory_gib") else ""
        )
        # The table's heading gives the usual lengths; a run that used others says so.
        for key, usual, label in (
            ("prompt_len", 128, "{}-token prompt"),
            ("new_tokens", 128, "{} new tokens"),
        ):
            if record.get(key, usual) != usual:
                setting += ", " + label.format(record[key])
        for batch in record["batches"]:
            rows = {r["impl"]: r for r in record["rows"] if r.get("batch") == batch}
            ttft = "-"
            mine, hf = rows.get("slothkit") or {}, rows.get("hf") or {}
            if mine.get("ttft_s") and hf.get("ttft_s"):
                ttft = f"{mine['ttft_s']:.3f} / {hf['ttft_s']:.3f}"
            cells = [
                record["accelerator"].get("name", "cpu"),
                record["model"],
                f"{record['mode']} ({setting})",
                str(batch),
                *(_generate_cell(rows.get(impl)) for impl in impls),
                ttft,
                f"`results/generate/{record['_file']}`",
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
