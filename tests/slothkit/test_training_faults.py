"""Faults during training: a run killed with SIGKILL and resumed from its last checkpoint."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

pytest.importorskip("trl")

from slothkit.testing.resumed_training import KILL_AFTER, SAVE_STEPS, STEPS, build_trainer, step_losses

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytestmark = pytest.mark.usefixtures("quiet_training")  # tests/slothkit/conftest.py


def _start_run_to_kill(output, checkpointing, load_in_4bit, cuda_graphs=False) -> subprocess.Popen:
    """resumed_training in a process of its own: it trains, writes the losses of steps 1 to
    KILL_AFTER to OUTPUT/losses.json and waits there to be killed."""
    command = [sys.executable, "-m", "slothkit.testing.resumed_training", "--output", str(output)]
    command += ["--checkpointing", str(checkpointing)] + ["--4bit"] * load_in_4bit
    command += ["--cuda-graphs"] * cuda_graphs
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    with open(output / "stderr.txt", "w") as stderr:  # a file: a full pipe would stall the run
        return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=stderr)


def _kill_when_it_has_logged(process: subprocess.Popen, output) -> dict[int, float]:
    losses_file = output / "losses.json"
    deadline = time.monotonic() + 300
    try:
        while not losses_file.exists():
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                process.wait()
                tail = (output / "stderr.txt").read_text()[-3000:]
                pytest.fail(f"the training process ended early or hung: {tail}")
            time.sleep(0.1)
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    assert process.returncode == -signal.SIGKILL
    return {int(step): loss for step, loss in json.loads(losses_file.read_text()).items()}


def _assert_resume_matches(tmp_path, checkpointing, load_in_4bit, cuda_graphs=None, rtol=1e-5):
    """Kill a run after step KILL_AFTER, resume it from its checkpoint at SAVE_STEPS, and
    compare every step's loss with the same run uninterrupted (trained meanwhile) to
    ``rtol``: fp32 rounding."""
    process = _start_run_to_kill(tmp_path, checkpointing, load_in_4bit, cuda_graphs=bool(cuda_graphs))
    whole = build_trainer(tmp_path / "whole", checkpointing, load_in_4bit, cuda_graphs=cuda_graphs)
    whole.train()
    killed = _kill_when_it_has_logged(process, tmp_path)
    run = tmp_path / "run"
    checkpoints = sorted(p.name for p in run.iterdir() if p.name.startswith("checkpoint-"))
    assert checkpoints == [f"checkpoint-{SAVE_STEPS}"]
    resumed = build_trainer(run, checkpointing, load_in_4bit, cuda_graphs=cuda_graphs)
    resumed.train(resume_from_checkpoint=True)

    expected = step_losses(whole)
    assert sorted(expected) == list(range(1, STEPS + 1))
    assert len(set(expected.values())) == STEPS  # the losses move: the comparison can fail
    assert sorted(killed) == list(range(1, KILL_AFTER + 1))
    # Steps 1 to SAVE_STEPS come from the checkpoint's log; the resume computes the rest,
    # KILL_AFTER (trained by the killed run after its last checkpoint) again.
    got = step_losses(resumed)
    assert sorted(got) == list(range(1, STEPS + 1))
    for losses in (killed, got):
        steps = sorted(losses)
        torch.testing.assert_close(
            torch.tensor([losses[s] for s in steps]),
            torch.tensor([expected[s] for s in steps]),
            rtol=rtol,
            atol=0,
        )


@pytest.mark.parametrize(
    "checkpointing, load_in_4bit",
    [("unsloth", False), ("auto", False), ("auto", True)],
    ids=["offloaded-16bit", "auto-16bit", "auto-4bit"],
)
def test_a_run_killed_with_sigkill_resumes_with_the_same_losses(
    reference_kernels, tmp_path, checkpointing, load_in_4bit
):
    """resumed_training's run on slothkit's fused path; "auto" keeps one layer and offloads
    the other (resumed_training._keep_one_layer_of_two)."""
    if load_in_4bit:
        pytest.importorskip("bitsandbytes")
    _assert_resume_matches(tmp_path, checkpointing, load_in_4bit)


@pytest.mark.cuda
@pytest.mark.parametrize(
    "checkpointing, load_in_4bit",
    [("unsloth", False), ("auto", False), ("unsloth", True), ("auto", True)],
    ids=["offloaded-16bit", "auto-16bit", "offloaded-4bit", "auto-4bit"],
)
def test_a_run_with_layer_graphs_killed_with_sigkill_resumes_with_the_same_losses(
    tmp_path, checkpointing, load_in_4bit
):
    """The same on a GPU, the Triton kernels running and every checkpointed layer replayed
    from CUDA graphs (cuda_graphs=True), whose captured buffers hold the adapters a resume
    loads into the model."""
    if load_in_4bit:
        pytest.importorskip("bitsandbytes")
    # rtol: a GPU kernel that sums with atomic adds may round differently from run to run.
    _assert_resume_matches(tmp_path, checkpointing, load_in_4bit, cuda_graphs=True, rtol=1e-4)
