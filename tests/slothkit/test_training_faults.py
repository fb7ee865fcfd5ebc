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

from transformers import TrainerCallback

from slothkit.testing.resumed_training import KILL_AFTER, SAVE_STEPS, STEPS, build_trainer, step_losses
from slothkit.testing.training_parity import lora_weights

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
    whole_adapters = lora_weights(whole.model)  # and the last step's update, which no loss shows
    for name, weight in lora_weights(resumed.model).items():
        torch.testing.assert_close(
            weight, whole_adapters[name], rtol=rtol, atol=1e-6, msg=lambda text, name=name: f"{name}: {text}"
        )


@pytest.mark.parametrize(
    "checkpointing, load_in_4bit",
    [("unsloth", False), ("auto", True)],
    ids=["offloaded-16bit", "auto-4bit"],
)
def test_a_run_killed_with_sigkill_resumes_with_the_same_losses(
    reference_kernels, tmp_path, checkpointing, load_in_4bit
):
    """resumed_training's run on slothkit's fused path; "auto" keeps one layer and offloads
    the other (resumed_training._keep_one_layer_of_two).  Each checkpointing and each
    precision once, as each run costs a process of its own (the GPU test crosses them)."""
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


def _sft_trainer(steps=4, callbacks=(), precision=None, **options):
    """A tiny SFT run on slothkit's fused path (slothkit.testing.training_parity)."""
    from slothkit.data import apply_chat_template, example_dataset
    from slothkit.testing.training_parity import RUN, load_for_training
    from slothkit.trl import SFTTrainer
    from slothkit.trl.defaults import sft_config

    dtype = {None: torch.float32, "fp16": torch.float16}[precision]
    model, tokenizer = load_for_training("slothkit", dtype=dtype)
    dataset = apply_chat_template(example_dataset("chat").select(range(8)), tokenizer)
    args = sft_config(model, max_steps=steps, learning_rate=2e-3, output_dir="run", **{**RUN, **options})
    trainer = SFTTrainer(
        model=model, processing_class=tokenizer, train_dataset=dataset, args=args, callbacks=list(callbacks)
    )
    return trainer, model


class _ArmAt(TrainerCallback):
    """Calls ``arm()`` as step ``step`` begins and keeps the adapters as they were then."""

    def __init__(self, step, arm):
        self.step, self.arm, self.adapters = step, arm, None

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if state.global_step + 1 == self.step:
            self.adapters = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
            self.arm()


def _nan_out_of_layer(model, index):
    """A switch that makes decoder layer ``index`` return NaN from its next call on."""
    from slothkit.engine.decoder import decoder_layers

    armed = []

    def hook(module, args, output):
        if not armed:
            return output
        hidden = output[0] if isinstance(output, tuple) else output
        poisoned = hidden * float("nan")
        return (poisoned, *output[1:]) if isinstance(output, tuple) else poisoned

    decoder_layers(model)[1][index].register_forward_hook(hook)
    return lambda: armed.append(True)


def test_a_nan_loss_stops_training_at_its_step_naming_the_layer(reference_kernels):
    """transformers' Trainer would leave the NaN out of the logged mean and train on, writing
    NaN into every adapter; slothkit stops before that step's update."""
    from slothkit.trl.non_finite_loss import NonFiniteLossError

    trainer, model = _sft_trainer(save_steps=2, save_strategy="steps")
    arm = _ArmAt(3, _nan_out_of_layer(model, 1))
    trainer.add_callback(arm)
    with pytest.raises(NonFiniteLossError) as caught:
        trainer.train()
    message = str(caught.value)
    assert message.startswith("the training loss was nan at step 3 (micro-batch 1 of 1)")
    assert "come out of decoder layer 1;" in message and "the micro-batch: 2 sequences of" in message
    assert "the adapters are those of the step before" in message
    assert "lower the learning rate (it is 0.002)" in message and "(precision: fp32)" in message
    assert "resume from run/checkpoint-2" in message
    assert trainer.state.global_step == 2 and len([e for e in trainer.state.log_history if "loss" in e]) == 2
    for name, param in model.named_parameters():
        if param.requires_grad:
            assert torch.equal(param.detach(), arm.adapters[name]), name  # step 3 changed nothing


def test_a_nan_loss_with_the_trainers_filter_off_is_named_at_the_log(reference_kernels):
    from slothkit.trl.non_finite_loss import NonFiniteLossError

    trainer, model = _sft_trainer(logging_nan_inf_filter=False)
    trainer.add_callback(_ArmAt(3, _nan_out_of_layer(model, 0)))
    with pytest.raises(
        NonFiniteLossError, match=r"^the training loss was nan at step 3 \(micro-batch 1 of 1\)"
    ):
        trainer.train()
    assert trainer.state.log_history[-1]["step"] == 3 and trainer.state.log_history[-1]["loss"] != 0


def test_an_infinite_gradient_with_a_finite_loss_is_named_at_its_step(reference_kernels):
    """Without a GradScaler (bf16, fp32) an infinite gradient reaches the optimizer."""
    from slothkit.trl.non_finite_loss import NonFiniteLossError

    trainer, model = _sft_trainer()
    name, param = next((n, p) for n, p in model.named_parameters() if p.requires_grad)
    armed = []
    param.register_hook(lambda grad: grad * float("inf") if armed else grad)
    trainer.add_callback(_ArmAt(2, lambda: armed.append(True)))
    with pytest.raises(
        NonFiniteLossError, match=r"^the gradient norm was (inf|nan) at step 2 \(the loss logged: \d"
    ):
        trainer.train()


@pytest.mark.cuda
def test_fp16_steps_the_grad_scaler_skips_are_not_reported():
    """fp16 with a GradScaler: an infinite gradient skips its step and lowers the scale, and
    training goes on; a NaN loss still stops it."""
    from slothkit.trl.non_finite_loss import NonFiniteLossError

    trainer, model = _sft_trainer(precision="fp16", fp16=True, bf16=False)
    _, param = next((n, p) for n, p in model.named_parameters() if p.requires_grad)
    armed = []
    param.register_hook(lambda grad: grad * float("inf") if len(armed) == 1 else grad)
    trainer.add_callback(_ArmAt(2, lambda: armed.append(True)))
    trainer.add_callback(_ArmAt(3, lambda: armed.append(True)))  # the inf for step 2 only
    trainer.train()
    assert trainer.state.global_step == 4

    trainer, model = _sft_trainer(precision="fp16", fp16=True, bf16=False)
    trainer.add_callback(_ArmAt(3, _nan_out_of_layer(model, 1)))
    with pytest.raises(NonFiniteLossError, match=r"at step 3 .*\n.*\n.*train in bf16"):
        trainer.train()


def test_out_of_memory_mid_run_names_the_settings_and_keeps_the_checkpoints(reference_kernels, tmp_path):
    """An out-of-memory error in step 5 of a run with "auto" checkpointing that saved at step 3."""
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import load_file

    from slothkit.core.inspection import causal_lm_of
    from slothkit.core.model_state import state_of
    from slothkit.trl.out_of_memory import TrainingOutOfMemoryError

    trainer = build_trainer(tmp_path / "run", "auto")
    model = trainer.model
    saved = {}

    class KeepTheSavedAdapter(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            saved[state.global_step] = {k: v.clone() for k, v in get_peft_model_state_dict(model).items()}

    trainer.add_callback(KeepTheSavedAdapter())
    forward, calls = model.forward, []

    def forward_out_of_memory_at_step_5(*args, **kwargs):
        calls.append(None)
        if len(calls) == 5:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.00 GiB.")
        return forward(*args, **kwargs)

    model.forward = forward_out_of_memory_at_step_5
    with pytest.raises(TrainingOutOfMemoryError) as caught:
        trainer.train()
    message = str(caught.value)
    policy = state_of(causal_lm_of(model)).recompute_policy  # the budget "auto" had
    assert message.startswith(
        "CUDA ran out of memory while training at step 5 (lora, per_device_train_batch_size=2, "
    )
    assert "max_length=96 (the model's max_seq_length: 96)" in message
    assert (
        f"use_gradient_checkpointing='auto' with a budget of {policy.budget / 2**30:.2f} GiB, "
        f"keeping 1 of 2 layers' activations at {policy.choice.tokens:,} tokens per step" in message
    )
    assert (
        f"a lower budget than its {policy.budget / 2**30:.2f} GiB (get_peft_model's max_memory=)" in message
    )
    assert (
        "lower per_device_train_batch_size (now 2)" in message
        and "max_seq_length (max_length, now 96)" in message
    )
    last = tmp_path / "run" / f"checkpoint-{SAVE_STEPS}"
    assert f"resume from {last} with trainer.train(resume_from_checkpoint=True)" in message
    assert message.endswith("The original error: CUDA out of memory. Tried to allocate 3.00 GiB.")
    if torch.cuda.is_available():  # the planner's figures for this model on this GPU
        assert len(message.splitlines()) == 3
        assert "The memory planner predicts " in message.splitlines()[1]
    else:
        assert len(message.splitlines()) == 2

    # The checkpoint written before it is whole: the adapter as it was saved, the
    # optimizer, scheduler, RNG and trainer state, each readable.
    assert sorted(p.name for p in (tmp_path / "run").iterdir() if p.name.startswith("checkpoint-")) == [
        last.name
    ]
    adapter = load_file(last / "adapter_model.safetensors")
    assert adapter.keys() == saved[SAVE_STEPS].keys()
    for name, weight in adapter.items():
        assert torch.equal(weight, saved[SAVE_STEPS][name]), name
    for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth"):
        torch.load(last / name, weights_only=False)
    assert json.loads((last / "trainer_state.json").read_text())["global_step"] == SAVE_STEPS


def test_a_forward_that_cannot_be_run_again_leaves_the_report_without_the_module(
    reference_kernels, monkeypatch
):
    """The module is looked for by running the micro-batch again; where that fails, the
    NonFiniteLossError still comes, without it, and not that failure."""
    from slothkit.trl import non_finite_loss
    from slothkit.trl.non_finite_loss import NonFiniteLossError

    def cannot_run_again(model, inputs):
        raise TypeError("forward() got an unexpected keyword argument")

    monkeypatch.setattr(non_finite_loss, "_first_non_finite_module", cannot_run_again)
    trainer, model = _sft_trainer(steps=2)
    trainer.add_callback(_ArmAt(2, _nan_out_of_layer(model, 0)))
    with pytest.raises(NonFiniteLossError) as caught:
        trainer.train()
    first_line = str(caught.value).splitlines()[0]
    assert first_line.startswith(
        "the training loss was nan at step 2 (micro-batch 1 of 1); the micro-batch: 2 "
    )
    assert "layer" not in first_line
