"""The benchmark harness, run on tiny CPU shapes through its real code path.

The numbers themselves mean nothing on a CPU; what is checked is that every row
is measured or says why not, that the JSON and Markdown records are complete and
well formed, and that the derived columns follow from the measured ones.
"""

import contextlib
import io
import json
import math
import re
import subprocess
import sys
import types

import pytest
import torch

from slothkit.bench import kernels as bench
from slothkit.bench.kernel_cases import OPS, build_cases
from slothkit.bench.kernel_report import COLUMNS

ENV_KEYS = {
    "date",
    "command",
    "device",
    "gpu",
    "driver",
    "cuda",
    "python",
    "torch",
    "triton",
    "transformers",
    "bitsandbytes",
    "triton_interpreter",
    "copy_gb_per_s",
    "complete",
    "notes",
    "rows",
}
ROW_KEYS = {
    "op",
    "shape",
    "dtype",
    "mode",
    "impl",
    "status",
    "ms",
    "gb_per_s",
    "pct_copy_bw",
    "tflop_per_s",
    "speedup_vs_eager",
    "peak_mib",
    "rel_err",
    "error",
    "timing",
}
# Largest relative error against eager accepted in fp32.  Loose on purpose: the ops'
# own tests check their accuracy; a harness that mixes up arguments or results is off
# by O(1).
FP32_REL_ERR = 1e-2


def run_bench(tmp_path, *args):
    """main() with JSON and Markdown output; returns (exit code, record, markdown, stdout)."""
    json_path, md_path = tmp_path / "bench.json", tmp_path / "bench.md"
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = bench.main(["--cpu-tiny", *args, "--json", str(json_path), "--markdown", str(md_path)])
    return code, json.loads(json_path.read_text()), md_path.read_text(), stdout.getvalue()


def positive_finite(value) -> bool:
    return isinstance(value, float) and math.isfinite(value) and value > 0


def check_row(row: dict, cpu: bool = True) -> None:
    assert set(row) == ROW_KEYS
    assert row["status"] in ("ok", "not available", "error"), row
    assert row["timing"] == "launch", row  # --cuda-graph is CUDA-only
    if row["status"] != "ok":
        assert row["error"], row
        assert row["ms"] is None
        return
    assert row["error"] is None
    for key in ("ms", "gb_per_s", "pct_copy_bw"):
        assert positive_finite(row[key]), (key, row)
    for key in ("tflop_per_s", "speedup_vs_eager"):
        assert row[key] is None or positive_finite(row[key]), (key, row)
    assert row["rel_err"] is None or (math.isfinite(row["rel_err"]) and row["rel_err"] >= 0)
    assert row["peak_mib"] is None if cpu else row["peak_mib"] >= 0


def table_lines(markdown: str) -> list[list[str]]:
    """The cells of each line of the Markdown table (header and separator included)."""
    lines = [line for line in markdown.splitlines() if line.startswith("|")]
    return [[c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]] for line in lines]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One tiny run of every op (no torch.compile: inductor takes minutes on 2 cores)."""
    return run_bench(tmp_path_factory.mktemp("bench"), "--no-compile")


def test_record_and_table_are_complete(tiny_run):
    code, record, markdown, stdout = tiny_run
    assert code == 0
    assert set(record) == ENV_KEYS
    assert record["device"] == "cpu" and record["torch"] == torch.__version__
    assert record["complete"] is True and "Incomplete" not in markdown
    assert record["command"].startswith("python -m slothkit.bench.kernels --cpu-tiny")
    assert positive_finite(record["copy_gb_per_s"])
    rows = record["rows"]
    assert {r["op"] for r in rows} == set(OPS)
    for row in rows:
        check_row(row)
    assert all(r["mode"] == "fwd" for r in rows if r["op"] == "nf4")  # no backward to time

    header, separator, *body = table_lines(markdown)
    assert header == list(COLUMNS)
    assert separator == ["---"] * len(COLUMNS)
    assert len(body) == len(rows)
    assert all(len(cells) == len(header) for cells in body)
    assert [cells[:5] for cells in body] == [
        [r["op"], r["shape"], r["dtype"], r["mode"], r["impl"]] for r in rows
    ]
    assert "device-to-device copy" in markdown and record["command"] in markdown
    # The printed table has the same rows.
    assert stdout.splitlines()[-len(rows) - 2].split() == [
        "kernel",
        "shape",
        "dtype",
        "pass",
        "impl",
        "ms",
        "GB/s",
        "%",
        "copy",
        "BW",
        "TFLOP/s",
        "vs",
        "eager",
        "peak",
        "MiB",
        "rel",
        "err",
        "note",
    ]


@pytest.mark.parametrize("op", OPS)
def test_each_available_op_is_measured(tiny_run, op):
    rows = [r for r in tiny_run[1]["rows"] if r["op"] == op]
    ours = [r for r in rows if r["impl"] == "slothkit"]
    if all(r["status"] == "not available" for r in ours):
        pytest.skip(f"slothkit_kernels op for {op} not written yet: {ours[0]['error']}")
    assert rows and all(r["status"] == "ok" for r in rows), [r["error"] for r in rows]
    for row in ours:
        if row["rel_err"] is not None:
            assert row["rel_err"] < FP32_REL_ERR, row


def _install_stand_in_rms_norm(monkeypatch):
    """A plain-torch rms_norm module, so the harness is tested whatever exists in slothkit_kernels/."""

    def rms_norm_reference(x, weight, eps=1e-6, gemma=False):
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return (y * (weight.float() + (1.0 if gemma else 0.0))).to(x.dtype)

    module = types.ModuleType("slothkit_kernels.rms_norm")
    module.rms_norm_reference = rms_norm_reference
    module.rms_norm = lambda x, weight, eps=1e-6, gemma=False: rms_norm_reference(x, weight, eps)
    monkeypatch.setitem(sys.modules, "slothkit_kernels.rms_norm", module)


def test_every_impl_and_pass_with_derived_columns(tmp_path, monkeypatch):
    _install_stand_in_rms_norm(monkeypatch)
    code, record, markdown, _ = run_bench(
        tmp_path, "--ops", "rms_norm", "--dtype", "bf16", "--compile-backend", "eager"
    )
    assert code == 0
    rows = record["rows"]
    (case,) = build_cases(["rms_norm"], [torch.bfloat16], "tiny")
    assert [(r["dtype"], r["mode"], r["impl"]) for r in rows] == [
        ("bf16", mode, impl) for mode in ("fwd", "fwd+bwd") for impl in ("eager", "compile", "slothkit")
    ]
    for row in rows:
        check_row(row)
        assert row["status"] == "ok", row
        moved = case.bytes_fwd if row["mode"] == "fwd" else case.bytes_fwd_bwd
        assert row["gb_per_s"] == pytest.approx(moved / row["ms"] / 1e6)
        assert row["pct_copy_bw"] == pytest.approx(100 * row["gb_per_s"] / record["copy_gb_per_s"])
        eager = next(r for r in rows if r["impl"] == "eager" and r["mode"] == row["mode"])
        assert row["speedup_vs_eager"] == pytest.approx(eager["ms"] / row["ms"])
        if row["impl"] == "eager":
            assert row["rel_err"] is None
        else:  # the stand-in computes exactly what the reference does
            assert row["rel_err"] == 0.0
    assert len(table_lines(markdown)) == 2 + len(rows)


def test_compile_failure_is_reported_in_its_row(tmp_path, monkeypatch):
    _install_stand_in_rms_norm(monkeypatch)

    def failing_compile(*args, **kwargs):
        raise RuntimeError("inductor is broken on this stack\nlong traceback text")

    monkeypatch.setattr(torch, "compile", failing_compile)
    code, record, markdown, _ = run_bench(tmp_path, "--ops", "rms_norm")
    assert code == 0
    for row in record["rows"]:
        check_row(row)
        if row["impl"] == "compile":
            assert row["status"] == "error"
            assert row["error"] == "RuntimeError: inductor is broken on this stack"
        else:
            assert row["status"] == "ok"
    assert "error: RuntimeError: inductor is broken" in markdown


def test_missing_op_is_reported_not_available(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "slothkit_kernels.swiglu", None)  # import fails
    code, record, _, stdout = run_bench(tmp_path, "--ops", "swiglu", "--no-compile")
    assert code == 0
    assert {r["status"] for r in record["rows"]} == {"not available"}
    assert all("slothkit_kernels.swiglu" in r["error"] for r in record["rows"])
    assert "not available" in stdout


def test_byte_counts_of_the_full_shapes():
    # Building cases allocates nothing, so the H200 shapes can be checked here.
    cases = {(c.op, c.shape): c for c in build_cases(OPS, [torch.bfloat16], "full")}
    norm = cases["rms_norm", "16384x4096"]
    assert norm.bytes_fwd == 2 * (2 * 16384 * 4096 + 4096)
    assert norm.bytes_fwd_bwd == 2 * (4 * 16384 * 4096 + 2 * 4096)
    ce = cases["cross_entropy", "8192x256000"]
    assert ce.bytes_fwd_bwd == 2 * 2 * 8192 * 256000 + 8 * 8192 + 4
    flce = cases["fused_linear_cross_entropy", "8192 tok x 256000 vocab x 3072 hidden"]
    assert flce.flops_fwd == 2 * 8192 * 256000 * 3072
    nf4 = cases["nf4", "dequant 14336x4096"]
    assert nf4.bytes_fwd_bwd is None
    assert nf4.bytes_fwd == pytest.approx(14336 * 4096 * 2.5, rel=0.02)  # 0.5 B in, 2 B out
    for case in cases.values():
        assert case.bytes_fwd > 0
        assert case.bytes_fwd_bwd is None or case.bytes_fwd_bwd > case.bytes_fwd


def test_unknown_op_is_refused(capsys):
    with pytest.raises(SystemExit) as excinfo:
        bench.main(["--cpu-tiny", "--ops", "layer_norm"])
    assert excinfo.value.code == 2
    assert "unknown op layer_norm" in capsys.readouterr().err


def test_missing_output_folder_is_refused_before_running(tmp_path, capsys):
    with pytest.raises(SystemExit) as excinfo:
        bench.main(["--cpu-tiny", "--json", str(tmp_path / "no-such-folder" / "b.json")])
    assert excinfo.value.code == 2
    assert "folder does not exist" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_without_cuda_it_says_so(capsys):
    assert bench.main([]) == 1
    err = capsys.readouterr().err
    assert "No CUDA device" in err and "--cpu-tiny" in err


def test_module_runs_from_the_command_line():
    result = subprocess.run(
        [sys.executable, "-m", "slothkit.bench.kernels", "--cpu-tiny", "--ops", "geglu", "--no-compile"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "device-to-device copy" in result.stdout
    assert re.search(r"^geglu\s+5x37\s+fp32\s+fwd\s+eager\s", result.stdout, re.MULTILINE)
