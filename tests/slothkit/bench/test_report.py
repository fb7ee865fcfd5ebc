"""The README's overview and docs/benchmarks.md's tables are the ones generated from the
committed records."""

import json

from slothkit.bench.report import (
    BEGIN,
    END,
    FULL_TABLE,
    ROOT,
    full_table,
    load_records,
    readme_with_table,
    readme_with_tables,
)
from slothkit.bench.report_overview import overview
from slothkit.bench.report_tables import render, render_context, render_summary


def test_readme_and_full_table_match_the_records():
    stale = "{}'s table is stale: run python -m slothkit.bench.report --write"
    readme = (ROOT / "README.md").read_text()
    assert readme == readme_with_tables(readme), stale.format("README.md")
    full = FULL_TABLE.read_text()
    assert full == readme_with_table(full, full_table()), stale.format(FULL_TABLE.name)


def test_every_record_row_is_rendered():
    records = load_records()
    table = render(records)
    assert records, "no benchmark records committed under results/bench/"
    assert table.count("\n") - 1 == sum(len(r["rows"]) for r in records)
    assert BEGIN not in table and END not in table


def _record(tmp_path, name, **fields):
    base = {"accelerator": {"name": "GPU X"}, "model": "llama-3-8b", "mode": "qlora", "dtype": "bf16"}
    (tmp_path / name).write_text(json.dumps({**base, **fields}))


def _ok(impl, tokens):
    return {
        "impl": impl,
        "status": "ok",
        "tokens_per_s": tokens,
        "vs_hf": tokens / 1000.0,
        "peak_allocated_gib": 5.0,
    }


def test_summary_shows_the_latest_run_and_an_earlier_fuller_one(tmp_path):
    setting = {"kind": "train", "batch": 2, "seq": 2048}
    _record(
        tmp_path,
        "a.json",
        date="2026-01-01T10:00:00",
        **setting,
        rows=[_ok("slothkit", 1500.0), _ok("hf", 1000.0), _ok("liger", 1100.0)],
    )
    _record(
        tmp_path,
        "b.json",
        date="2026-01-01T11:00:00",
        **setting,
        rows=[_ok("slothkit", 1600.0), _ok("hf", 1000.0), _ok("liger", 1150.0)],
    )
    _record(
        tmp_path,
        "c.json",
        date="2026-01-01T12:00:00",
        **setting,
        rows=[
            _ok("slothkit", 1700.0),
            _ok("hf", 1000.0),
            {"impl": "unsloth", "status": "error", "error": "disk full"},
        ],
    )
    _record(
        tmp_path, "d.json", date="2026-01-01T09:00:00", **{**setting, "seq": 4096}, rows=[_ok("hf", 900.0)]
    )
    # An A/B inside a comparison run: more rows than b.json, but two implementations.
    _record(
        tmp_path,
        "a2.json",
        date="2026-01-01T10:30:00",
        **setting,
        rows=[
            _ok("hf", 1000.0),
            _ok("slothkit", 1550.0),
            _ok("slothkit@.ab/x", 1500.0),
            _ok("slothkit@.ab/y", 1450.0),
        ],
    )
    _record(
        tmp_path,
        "e.json",
        date="2026-01-01T13:00:00",
        **setting,  # no HF: a diagnostic run
        rows=[_ok("slothkit", 1800.0), {**_ok("slothkit@.ab/old", 1750.0), "vs_hf": None}],
    )
    lines = render_summary(load_records(tmp_path)).splitlines()[2:]
    assert [line.rsplit("|", 2)[-2].strip() for line in lines] == [
        "`results/bench/b.json`",
        "`results/bench/c.json`",
        "`results/bench/d.json`",
    ]
    assert (
        "| 1,600 (1.60x), 5.0 / \u2014 / \u2014 GiB | 1,000 (1.00x), 5.0 / \u2014 / \u2014 GiB "
        "| 1,150 (1.15x), 5.0 / \u2014 / \u2014 GiB | not in this run |" in lines[0]
    )
    assert "| 1,700 (1.70x), 5.0 / \u2014 / \u2014 GiB |" in lines[1] and lines[1].endswith(
        "| not in this run | error | `results/bench/c.json` |"
    )
    assert "| 2026-01-01 12:00 |" in lines[1]


def test_settings_and_context_records_are_shown(tmp_path):
    row = {
        "impl": "hf",
        "status": "ok",
        "tokens_per_s": 1234.0,
        "vs_hf": 1.0,
        "peak_allocated_gib": 3.0,
        "training_gib": 1.0,
        "final_loss": 2.5,
    }
    _record(tmp_path, "a.json", kind="train", batch=2, seq=64, autocast=False, memory_gib=15.0, rows=[row])
    _record(tmp_path, "c.json", kind="train", batch=2, seq=64, autocast=False, gpus=2, rows=[row])
    _record(
        tmp_path,
        "b.json",
        kind="context",
        memory_gib=24.0,
        rows=[
            {"impl": "slothkit", "status": "ok", "longest_seq": 65536, "first_failing_seq": 73728},
            {"impl": "hf", "longest_seq": None, "first_failing_seq": 4096},
            {"impl": "unsloth", "status": "skipped", "error": "not importable"},
        ],
        pending=["liger"],
    )
    table = full_table(tmp_path)
    assert (
        "qlora (bf16, no autocast, 15 GiB cap)" in table
        and "| 1,234 (1.00x), 3.0 / \u2014 / \u2014 GiB |" in table
    )
    assert "qlora (bf16, no autocast, DDP on 2 GPUs)" in table  # its tokens/s are both GPUs'

    context = render_context(load_records(tmp_path, "context"))
    lines = context.splitlines()[2:]
    assert "| 65,536 | 73,728 |" in lines[0]
    assert "| nothing fits | - |" in lines[1]
    assert "| skipped | - |" in lines[2]
    assert "| liger | not reached | - |" in lines[3] and len(lines) == 4
    assert context in table


def test_t4_runs_get_their_own_table_with_the_planner_prediction(tmp_path):
    from slothkit.memory.plan import plan

    row = {
        "impl": "slothkit",
        "status": "ok",
        "tokens_per_s": 5000.0,
        "peak_allocated_gib": 6.5,
        "peak_reserved_gib": 7.0,
        "training_gib": 1.2,
        "final_loss": 2.5,
    }
    _record(
        tmp_path,
        "t4.json",
        kind="train",
        dtype="fp16",
        memory_gib=15.0,
        batch=1,
        seq=2048,
        rank=16,
        rows=[row],
    )
    _record(
        tmp_path,
        "bf16.json",
        kind="train",
        batch=2,
        seq=2048,
        rank=16,
        rows=[{**row, "tokens_per_s": 9876.0}, {**row, "impl": "hf", "tokens_per_s": 6000.0}],
    )
    table = full_table(tmp_path)
    speed, t4 = table.split("T4 stand-in", 1)
    assert "9,876" in speed and "5,000" not in speed
    predicted = plan("llama-3-8b", gpu="t4", seq=2048, batch=1, mode="qlora", rank=16)
    allocated, reserved = predicted.allocated_gib, predicted.total_gib
    assert f"| 6.50 / 7.00 | {allocated:.2f} / {reserved:.2f} | {reserved / 7.0 - 1:+.0%} |" in t4


def test_generation_runs_get_their_table_with_ratios_and_time_to_first_token(tmp_path):
    rows = [
        {"impl": "slothkit", "batch": 1, "status": "ok", "tokens_per_s": 90.5, "vs_hf": 10.0, "ttft_s": 0.11},
        {"impl": "hf", "batch": 1, "status": "ok", "tokens_per_s": 9.05, "vs_hf": 1.0, "ttft_s": 0.1},
        {"impl": "slothkit", "batch": 8, "status": "ok", "tokens_per_s": 600.0, "vs_hf": 7.5},
        {"impl": "hf", "batch": 8, "status": "out of memory"},
    ]
    _record(tmp_path, "g.json", kind="generate", batches=[1, 8], rows=rows)
    table = full_table(tmp_path)
    generation = table.split("Generation after", 1)[1]
    lines = [line for line in generation.splitlines() if line.startswith("| GPU X")]
    assert "| 1 | 90.5 (10.00x) | 9.1 (1.00x) | not in this run | 0.110 / 0.100 |" in lines[0]
    assert "| 8 | 600.0 (7.50x) | out of memory | not in this run | - |" in lines[1]
    assert all("(bf16) |" in line for line in lines)  # the usual lengths: not repeated

    _record(tmp_path, "g.json", kind="generate", batches=[1], rows=rows[:2], new_tokens=256, prompt_len=64)
    generation = full_table(tmp_path).split("Generation after", 1)[1]
    assert "| qlora (bf16, 64-token prompt, 256 new tokens) | 1 | 90.5 (10.00x) |" in generation

    # A run stopped at a time limit: what it never started says so, not "not in this run".
    _record(tmp_path, "g.json", kind="generate", batches=[1, 8], rows=rows[:3], pending=["hf batch 8"])
    generation = full_table(tmp_path).split("Generation after", 1)[1]
    assert "| 8 | 600.0 (7.50x) | not reached | not in this run | - |" in generation


def test_generation_rows_give_the_bandwidth_share_and_a_merged_column_once_a_run_has_one(tmp_path):
    rows = [
        {
            "impl": "slothkit",
            "batch": 1,
            "status": "ok",
            "tokens_per_s": 120.0,
            "vs_hf": 10.0,
            "share_of_limit": 0.4,
        },
        {
            "impl": "hf",
            "batch": 1,
            "status": "ok",
            "tokens_per_s": 12.0,
            "vs_hf": 1.0,
            "share_of_limit": 0.04,
        },
    ]
    _record(tmp_path, "a.json", kind="generate", batches=[1], rows=rows)
    generation = full_table(tmp_path).split("Generation after", 1)[1]
    assert (
        "| 120.0 (10.00x, 40% of the bandwidth limit) | 12.0 (1.00x, 4% of the bandwidth limit) |"
        in generation
    )
    assert "merged" not in generation.splitlines()[2]  # no run has the merged row: no column

    merged = {"impl": "slothkit-merged", "batch": 1, "status": "ok", "tokens_per_s": 150.0, "vs_hf": 12.5}
    _record(tmp_path, "b.json", kind="generate", batches=[1], rows=[*rows, merged])
    generation = full_table(tmp_path).split("Generation after", 1)[1]
    lines = [line for line in generation.splitlines() if line.startswith("| GPU")]
    assert lines[0].endswith("| Unsloth | slothkit, adapters merged | TTFT s slothkit / HF | record |")
    assert "| not in this run | 150.0 (12.50x) |" in generation
    assert generation.count("| not in this run | not in this run |") == 1  # the older run's row


def test_allocated_reserved_and_host_memory_are_shown_and_missing_ones_marked(tmp_path):
    """Records since reserved and host memory were kept show all three figures; older
    ones an em dash where they lack one."""
    full = {
        **_ok("slothkit", 2000.0),
        "peak_reserved_gib": 7.25,
        "peak_host_gib": 3.04,
        "host_rss_gib": 2.9,
        "peak_host_scope": "steps",
    }
    old = {**_ok("hf", 1000.0), "host_rss_gib": 1.6}  # at the end of the run, not its peak
    _record(tmp_path, "m.json", kind="train", date="2026-01-02T10:00:00", batch=2, seq=2048, rows=[full, old])
    summary = render_summary(load_records(tmp_path))
    assert "| 2,000 (2.00x), 5.0 / 7.2 / 3.0 GiB | 1,000 (1.00x), 5.0 / \u2014 / \u2014 GiB |" in summary
    every = render(load_records(tmp_path)).splitlines()
    assert "allocated GiB | reserved GiB | host GiB |" in every[0]
    assert "| slothkit | 2,000 | 2.00x | 5.0 | 7.2 | 3.0 |" in every[2]
    assert "| hf | 1,000 | 1.00x | 5.0 | \u2014 | \u2014 |" in every[3]


def test_a_lifetime_host_peak_is_not_shown_as_the_steps_peak(tmp_path):
    """Before the peak was restarted at the first step, a peer loading a 16-bit checkpoint
    from disk peaked while loading (16.5 GiB against 3.0 while training): such a record
    shows the resident memory at the end of the steps, marked."""
    lifetime = {**_ok("unsloth", 1500.0), "peak_host_gib": 16.54, "host_rss_gib": 3.05}
    _record(tmp_path, "m.json", kind="train", date="2026-01-02T10:00:00", batch=2, seq=2048, rows=[lifetime])
    every = render(load_records(tmp_path)).splitlines()
    assert "| 3.0 (end) |" in every[2] and "16.5" not in every[2]


def test_a_best_run_shows_the_budget_and_each_implementation_s_setting(tmp_path):
    rows = [
        {
            **_ok("slothkit", 2100.0),
            "setting": "use_gradient_checkpointing='auto'",
            "recompute": {"kept_layers": 22, "layers": 32},
        },
        {**_ok("hf", 1000.0), "setting": "no gradient checkpointing"},
    ]
    _record(tmp_path, "best.json", kind="train", batch=2, seq=2048, memory_gib=40.0, best=True, rows=rows)
    summary = render_summary(load_records(tmp_path))
    assert "qlora (bf16, each at its fastest under 40 GiB)" in summary
    assert (
        "2,100 (2.10x), 5.0 / \u2014 / \u2014 GiB, use_gradient_checkpointing='auto', 22 of 32 layers kept"
        in summary
    )
    assert "1,000 (1.00x), 5.0 / \u2014 / \u2014 GiB, no gradient checkpointing |" in summary
    every = render(load_records(tmp_path))
    assert "| hf (no gradient checkpointing) | 1,000 |" in every


def test_a_best_run_says_which_layers_went_on_the_gpu_for_want_of_host_memory(tmp_path):
    rows = [
        {
            **_ok("slothkit", 2100.0),
            "setting": "use_gradient_checkpointing='auto'",
            "recompute": {"kept_layers": 2, "layers": 32, "on_gpu_layers": 11},
        },
        {**_ok("hf", 1000.0), "setting": "gradient checkpointing"},
    ]
    _record(tmp_path, "best.json", kind="train", batch=1, seq=65536, memory_gib=40.0, best=True, rows=rows)
    summary = render_summary(load_records(tmp_path))
    assert "2 of 32 layers kept, 11 checkpointed on the GPU (host memory)" in summary


def _overview_line(tmp_path, model="llama-3-8b", mode="qlora"):
    train = load_records(tmp_path)
    table = overview(train, load_records(tmp_path, "generate"), load_records(tmp_path, "context"))
    label = {"lora": "LoRA", "qlora": "QLoRA"}[mode]
    (line,) = [line for line in table.splitlines() if line.startswith(f"| {model} | {label} |")]
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_the_overview_shows_the_latest_comparison_run_per_model_and_mode(tmp_path):
    setting = {"kind": "train", "batch": 2, "seq": 2048, "autocast": False}
    memory = {"peak_allocated_gib": 6.84, "peak_reserved_gib": 10.76}
    _record(
        tmp_path,
        "old.json",
        date="2026-01-01T10:00:00",
        **setting,
        rows=[_ok("slothkit", 1500.0), _ok("hf", 1000.0), _ok("unsloth", 1200.0)],
    )
    _record(
        tmp_path,
        "latest.json",
        date="2026-01-01T12:00:00",
        **setting,
        rows=[
            {**_ok("slothkit", 2040.0), **memory},
            {**_ok("hf", 1000.0), "peak_reserved_gib": 15.2},
            _ok("unsloth", 1700.0),
        ],
    )
    # Later, but not comparisons: an A/B without HF, a --best run, a T4 stand-in.
    _record(tmp_path, "ab.json", date="2026-01-02T10:00:00", **setting, rows=[_ok("slothkit", 2100.0)])
    _record(
        tmp_path,
        "best.json",
        date="2026-01-02T11:00:00",
        **{**setting, "memory_gib": 24.0, "best": True},
        rows=[_ok("slothkit", 2500.0), _ok("hf", 1000.0)],
    )
    _record(
        tmp_path,
        "t4.json",
        date="2026-01-02T12:00:00",
        **{**setting, "dtype": "fp16", "memory_gib": 15.0},
        rows=[_ok("slothkit", 900.0), _ok("hf", 450.0)],
    )
    assert _overview_line(tmp_path) == [
        "llama-3-8b",
        "QLoRA",
        "bf16, no autocast, 2 x 2048",
        "2,040",
        "2.04x",
        "1.20x",  # 2,040 / 1,700, in the same run
        "6.8 / 10.8",
        "5.0 / 15.2",
        "-",
        "-",
        "-",
    ]

    # Unsloth that failed says so; one that was not in the run is "-".
    _record(
        tmp_path,
        "latest.json",
        date="2026-01-01T12:00:00",
        **setting,
        rows=[_ok("slothkit", 2040.0), _ok("hf", 1000.0), {"impl": "unsloth", "status": "out of memory"}],
    )
    assert _overview_line(tmp_path)[5] == "out of memory"
    _record(
        tmp_path,
        "latest.json",
        date="2026-01-01T12:00:00",
        **setting,
        rows=[_ok("slothkit", 2040.0), _ok("hf", 1000.0)],
    )
    assert _overview_line(tmp_path)[5] == "-"


def test_the_overview_takes_decode_per_batch_and_context_from_their_latest_runs(tmp_path):
    def decode(impl, batch, tokens, vs_hf=None):
        return {"impl": impl, "batch": batch, "status": "ok", "tokens_per_s": tokens, "vs_hf": vs_hf}

    _record(
        tmp_path,
        "g1.json",
        kind="generate",
        date="2026-01-01T10:00:00",
        batches=[1, 8],
        rows=[decode("slothkit", 1, 90.0, 9.0), decode("slothkit", 8, 600.0, 7.5)],
    )
    # Later: batch 1 only, no HF (no ratio); its batch 8 never ran.
    _record(
        tmp_path,
        "g2.json",
        kind="generate",
        date="2026-01-01T11:00:00",
        batches=[1, 8],
        rows=[decode("slothkit", 1, 120.5)],
        pending=["slothkit batch 8"],
    )
    # Latest, but under a memory cap (the T4 stand-in): not the headline figure.
    _record(
        tmp_path,
        "g3.json",
        kind="generate",
        date="2026-01-01T12:00:00",
        memory_gib=15.0,
        batches=[1],
        rows=[decode("slothkit", 1, 80.0, 10.0)],
    )
    _record(
        tmp_path,
        "c1.json",
        kind="context",
        date="2026-01-01T10:00:00",
        memory_gib=24.0,
        rows=[{"impl": "slothkit", "status": "ok", "longest_seq": 90112, "first_failing_seq": 94208}],
    )
    _record(
        tmp_path,
        "c2.json",
        kind="context",
        date="2026-01-01T11:00:00",
        memory_gib=24.0,
        rows=[{"impl": "slothkit", "status": "ok", "longest_seq": 131072, "first_failing_seq": None}],
    )
    line = _overview_line(tmp_path)
    assert line[2:8] == ["-"] * 6  # no training run of this model and mode
    assert line[8:] == ["120.5", "600.0 (7.5x)", "131,072 or more under 24 GiB"]

    _record(
        tmp_path,
        "c2.json",
        kind="context",
        date="2026-01-01T11:00:00",
        memory_gib=24.0,
        rows=[{"impl": "slothkit", "status": "ok", "longest_seq": 131072, "first_failing_seq": 135168}],
    )
    assert _overview_line(tmp_path)[10] == "131,072 under 24 GiB"


def test_the_readme_overview_speaks_for_one_gpu(tmp_path):
    """A later run on another GPU stays out of the README's line (its text names the GPU)."""
    from slothkit.bench.report import readme_table

    def decode(tokens):
        return {"impl": "slothkit", "batch": 1, "status": "ok", "tokens_per_s": tokens, "vs_hf": None}

    _record(
        tmp_path, "g1.json", kind="generate", date="2026-01-01T10:00:00", batches=[1], rows=[decode(140.0)]
    )
    _record(
        tmp_path,
        "g2.json",
        kind="generate",
        date="2026-01-02T10:00:00",
        batches=[1],
        rows=[decode(129.0)],
        accelerator={"name": "GPU Y"},
    )
    (line,) = [
        line for line in readme_table(tmp_path, gpu="GPU X").splitlines() if line.startswith("| llama")
    ]
    assert "140.0" in line and "129.0" not in line
    (line,) = [
        line for line in readme_table(tmp_path, gpu="GPU Y").splitlines() if line.startswith("| llama")
    ]
    assert "129.0" in line


def test_the_experts_backend_is_named_in_the_setting_where_not_the_default():
    from slothkit.bench.report_cells import _setting

    record = {"dtype": "bf16", "autocast": False}
    assert _setting(record) == "bf16, no autocast"
    # "auto" is the default; "triton" was, before it.
    assert _setting({**record, "slothkit_moe_gemm": "auto"}) == "bf16, no autocast"
    assert _setting({**record, "slothkit_moe_gemm": "triton"}) == "bf16, no autocast"
    assert _setting({**record, "slothkit_moe_gemm": "grouped_mm"}) == (
        "bf16, no autocast, slothkit's experts through grouped_mm"
    )
