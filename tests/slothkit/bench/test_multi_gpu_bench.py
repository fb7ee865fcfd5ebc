"""`slothkit bench train --gpus N` on a CPU: the commands it starts (torchrun mocked), what
it refuses, and how the processes' figures and the one-GPU run make the record.  The
runs themselves need N GPUs (docs/multi-gpu.md has the commands)."""

import json
import subprocess
import sys
import types

import pytest
import torch

from slothkit.bench import multi_gpu, train
from slothkit.cli import main
from slothkit.core.distributed import Launch

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


def _fake_workers(monkeypatch):
    """subprocess.run answering for the workers: one GPU steps in 1.9 s, two GPUs (each
    with its batch) in 1.0 s, with 5 % more memory per GPU."""
    commands = []
    real_run = subprocess.run

    def fake_run(command, **kwargs):
        if "slothkit.bench.train_worker" not in command:
            return real_run(command, **kwargs)
        if "matmul-peak" not in command:  # (asked for first on a GPU machine)
            commands.append(command)
        spread = command[: len(TORCHRUN)] == TORCHRUN
        result = {
            "status": "ok",
            "step_s": 1.0 if spread else 1.9,
            "losses": [2.0, 1.5],
            "final_loss": 1.5,
            "peak_allocated_gib": 9.0 if spread else 8.5,
            "peak_reserved_gib": 10.5 if spread else 10.0,
        }
        if spread:
            result.update(gpus=2, adapters_in_sync=True, per_gpu=[{"rank": 0}, {"rank": 1}])
        return subprocess.CompletedProcess(command, 0, train.RESULT_TAG + json.dumps(result) + "\n", "")

    monkeypatch.setattr(train.subprocess, "run", fake_run)
    return commands


def test_each_implementation_runs_on_one_gpu_and_under_torchrun(tmp_path, monkeypatch, capsys):
    commands = _fake_workers(monkeypatch)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)  # a tiny shape may run on the CPU
    output = tmp_path / "record.json"
    args = ["bench", "train", "--model", "tiny-llama", "--impl", "slothkit,hf", "--batch", "2", "--seq", "64"]
    assert main([*args, "--gpus", "2", "--output", str(output)]) == 0
    spread = [c for c in commands if c[: len(TORCHRUN)] == TORCHRUN]
    alone = [c for c in commands if c[:3] == [sys.executable, "-m", "slothkit.bench.train_worker"]]
    assert len(spread) == len(alone) == 2 and len(commands) == 4
    for command in spread:  # the same worker arguments, the per-GPU batch as given
        assert command[len(TORCHRUN) :][:2] == ["-m", "slothkit.bench.train_worker"]
        assert command[command.index("--batch") + 1] == "2"
    assert sorted(c[c.index("--impl") + 1] for c in spread) == ["hf", "slothkit"]
    record = json.loads(output.read_text())
    assert record["gpus"] == 2 and set(record["raw"]) == {"1", "2"}
    for row in record["rows"]:
        assert row["gpus"] == 2 and row["adapters_in_sync"] is True and len(row["per_gpu"]) == 2
        # 2 GPUs x 2 x 64 tokens per 1.0 s step, against 2 x 64 per 1.9 s on one GPU.
        assert row["tokens_per_s"] == pytest.approx(256.0)
        assert row["single_gpu"]["tokens_per_s"] == pytest.approx(128 / 1.9)
        assert row["scaling"] == pytest.approx(3.8)
        assert row["memory_vs_single"] == pytest.approx(1.05)
        assert row["vs_hf"] == pytest.approx(1.0) and row["single_gpu"]["vs_hf"] == pytest.approx(1.0)
    assert "| slothkit (2 GPUs: 3.80x one) | ok |" in capsys.readouterr().out


def test_one_gpu_starts_no_torchrun(tmp_path, monkeypatch):
    commands = _fake_workers(monkeypatch)
    assert main(["bench", "train", "--model", "tiny-llama", "--impl", "hf"]) == 0
    assert [c[:3] for c in commands] == [[sys.executable, "-m", "slothkit.bench.train_worker"]]


@pytest.mark.parametrize(
    "gpus, model, available, message",
    [
        (0, "tiny-llama", 2, "--gpus 0; expected 1 or more"),
        (4, "llama-3-8b", 2, "--gpus 4 but this machine has 2 CUDA GPU(s)"),
        (2, "llama-3-8b", 0, "--gpus 2 but this machine has 0 CUDA GPU(s); without GPUs only a tiny"),
    ],
)
def test_gpus_this_machine_lacks_are_refused(gpus, model, available, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        multi_gpu.check_gpus(gpus, model, available)


def test_gpus_this_machine_has_are_accepted():
    multi_gpu.check_gpus(2, "llama-3-8b", 2)
    multi_gpu.check_gpus(2, "tiny-llama", 0)  # gloo processes on the CPU
    multi_gpu.check_gpus(1, "llama-3-8b", 0)  # (refused later: a real shape needs a GPU)


def test_best_and_gpus_are_not_combined(capsys):
    code = main(["bench", "train", "--model", "tiny-llama", "--gpus", "2", "--memory-gib", "8", "--best"])
    assert code == 2
    assert "--best and --gpus N together are not supported" in capsys.readouterr().err


def test_process_zero_gathers_the_processes_figures(monkeypatch):
    """Tokens/s summed over the processes, the step time that sum means, each process's
    peak, the global batch's loss, and whether the adapters stayed equal."""
    import torch.distributed as dist

    results = [
        {"step_s": 1.0, "losses": [2.0, 1.0], "checksum": 3.5, "peak_reserved_gib": 10.0, "status": "ok"},
        {"step_s": 1.25, "losses": [3.0, 2.0], "checksum": 3.5, "peak_reserved_gib": 10.5, "status": "ok"},
    ]
    monkeypatch.setattr(dist, "all_gather_object", lambda out, mine: out.__setitem__(slice(None), results))
    combined = multi_gpu.gather(results[0], Launch(2, 0, 0), batch=2, seq=100)
    assert combined["tokens_per_s"] == pytest.approx(200 / 1.0 + 200 / 1.25)
    assert combined["step_s"] == pytest.approx(400 / combined["tokens_per_s"])
    assert combined["losses"] == [2.5, 1.5] and combined["final_loss"] == 1.5
    assert combined["peak_reserved_gib"] == 10.5 and combined["gpus"] == 2
    assert [g["peak_reserved_gib"] for g in combined["per_gpu"]] == [10.0, 10.5]
    assert combined["adapters_in_sync"] is True and "checksum" not in combined
    results[1]["checksum"] = 3.25
    assert multi_gpu.gather(results[0], Launch(2, 0, 0), 2, 100)["adapters_in_sync"] is False
    assert multi_gpu.gather(results[1], Launch(2, 1, 1), 2, 100) is None  # only process 0 reports


def test_the_worker_wraps_the_model_as_the_trainer_does(monkeypatch):
    seen = {}
    monkeypatch.setattr(
        torch.nn.parallel, "DistributedDataParallel", lambda model, **kwargs: seen.update(kwargs) or "ddp"
    )
    model = types.SimpleNamespace()
    assert multi_gpu.wrap(model, Launch()) is model
    assert multi_gpu.wrap(model, Launch(2, 1, 1)) == "ddp"
    assert seen["find_unused_parameters"] is False and seen["broadcast_buffers"] is False
