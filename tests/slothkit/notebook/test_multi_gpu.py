"""The hardware cell on machines with several GPUs, and the launch it offers: a rendered
notebook exported with jupytext runs under torchrun in two processes (gloo, CPU) and
trains one model, with the global batch of both, saved once."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from slothkit.core.distributed import Launch
from slothkit.notebook.multi_gpu import launch_commands, multi_gpu_notice

ROOT = Path(__file__).resolve().parents[3]


def test_one_gpu_says_nothing():
    assert multi_gpu_notice(0, Launch()) is None
    assert multi_gpu_notice(1, Launch()) is None


def test_two_gpus_offer_the_launch():
    notice = multi_gpu_notice(2, Launch())
    assert "This machine has 2 GPUs; this notebook trains on the first one only" in notice
    assert "    jupytext --to py:percent NOTEBOOK.ipynb -o train.py\n" in notice
    assert "    torchrun --nproc-per-node 2 --local-ranks-filter 0 train.py\n" in notice
    assert "accelerate launch --multi_gpu --num_processes 2 train.py" in notice


def test_a_launched_process_says_which_it_is():
    notice = multi_gpu_notice(2, Launch(world_size=2, rank=1, local_rank=1))
    assert notice.startswith("process 1 of 2 on GPU 1 (DistributedDataParallel)")
    assert "only process 0 saves" in notice


def test_the_hardware_cell_prints_the_notice_once(monkeypatch, capsys):
    from slothkit.notebook import multi_gpu
    from slothkit.notebook.hardware import hardware_report

    multi_gpu.print_multi_gpu_notice_once.cache_clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    config = object()
    assert hardware_report(config) is config and hardware_report(config) is config
    out = capsys.readouterr().out
    assert out.count("process 0 of 2 on GPU 0") == 1
    assert out.count("GPU: none.") == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="runs two gloo processes on the CPU")
def test_an_exported_notebook_trains_under_torchrun(tmp_path):
    """The commands the notice prints, on the fine-tune notebook with a tiny model: the
    processes train together (8 steps take 8 x 2 x 2 samples of the 300), and only
    process 0 saves the adapter."""
    from slothkit.testing import tiny_model_path

    notebook = ROOT / "notebooks" / "llama-3-8b-finetune.ipynb"
    export, run = launch_commands(2, notebook=str(notebook), script=str(tmp_path / "train.py"))
    subprocess.run(export.split(), check=True, capture_output=True)
    # The script committed beside the notebook is this export (scripts/gpu_multi_gpu.sh runs
    # it), the header's jupytext version aside (the one installed writes its own).
    assert _without_jupytext_version((tmp_path / "train.py").read_text()) == _without_jupytext_version(
        notebook.with_suffix(".py").read_text()
    )
    steps, batch, processes = 8, 2, 2
    env = {
        **os.environ,
        "CUDA_VISIBLE_DEVICES": "",
        "TRITON_INTERPRET": "0",  # the kernels' torch references, as the notebook tests run them
        "HF_HUB_OFFLINE": "1",
        "MPLBACKEND": "Agg",
        "SLOTHKIT_NO_INSTALL": "1",
        "SLOTHKIT_MODEL_NAME": str(tiny_model_path("llama")),
        "SLOTHKIT_LOAD_IN_4BIT": "0",
        "SLOTHKIT_MAX_STEPS": str(steps),
        "SLOTHKIT_BATCH_SIZE": str(batch),
        "SLOTHKIT_GRAD_ACCUM": "1",
        "SLOTHKIT_LEARNING_RATE": "0.002",
        "SLOTHKIT_OUTPUT_DIR": str(tmp_path / "outputs"),
        "SLOTHKIT_SAVE_MERGED": "0",
        "SLOTHKIT_SAVE_GGUF": "0",
        "SLOTHKIT_HUB_REPO": "",
    }
    # Each process's stdout and stderr go to its own files: two processes writing block-
    # buffered output into one pipe interleave mid-line, so counting lines there is unsound.
    logs = tmp_path / "logs"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--log-dir", str(logs), "--redirects", "3", *run.split()[1:]]
    command.remove("--local-ranks-filter")  # both processes' output, to count what each did
    command.remove("0")
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=240)
    per_process = {
        int(folder.name): "".join(f.read_text() for f in sorted(folder.glob("std*.log")))
        for folder in logs.glob("*/attempt_*/*")
    }
    output = "".join(per_process[rank] for rank in sorted(per_process))
    assert done.returncode == 0, (done.stdout + done.stderr + output)[-3000:]
    assert sorted(per_process) == [0, 1]
    assert (
        "slothkit: 2 processes (WORLD_SIZE): the trainer's config gets ddp_find_unused_parameters=False"
        in output
    )
    assert output.count(f"{steps} steps in") == processes  # both ran the train cell ...
    epochs = re.findall(r"'epoch': '([0-9.]+)'", output)
    # ... as one run: each step took a batch from each process (300 example records).
    assert float(epochs[-1]) == pytest.approx(steps * batch * processes / 300, rel=1e-3)
    saved = {  # the save cell lists the files it wrote
        rank: len(re.findall(r"^lora/adapter_model\.safetensors +\d", text, flags=re.MULTILINE))
        for rank, text in per_process.items()
    }
    assert saved == {0: 1, 1: 0}  # only process 0 saves
    assert (tmp_path / "outputs" / "lora" / "adapter_model.safetensors").is_file()


def _without_jupytext_version(text: str) -> str:
    return "".join(line for line in text.splitlines(keepends=True) if "jupytext_version:" not in line)
