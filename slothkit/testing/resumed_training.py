"""A training run killed mid-way and resumed from its last Trainer checkpoint, against the
same run uninterrupted: the per-step losses must agree.

The run: a tiny Llama from slothkit.testing through ``FastModel.from_pretrained`` (fp32,
or NF4 computing in fp32), ``FastModel.get_peft_model`` with the checkpointing under
test, and slothkit.trl's ``SFTTrainer`` for ``STEPS`` steps over two epochs of the chat
examples, saving every ``SAVE_STEPS`` steps.  Killed at ``KILL_AFTER`` steps, the run's
last checkpoint lies mid-way through the first epoch, so the resume skips batches of
that epoch and then shuffles the second as the uninterrupted run does.

The killed run is a process of its own, which stops after step ``KILL_AFTER`` (its
losses written to ``losses.json``) and waits to be killed:

    python -m slothkit.testing.resumed_training --output DIR --checkpointing offload [--4bit]

Needs trl; imported by tests only.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

RECORDS = 8
BATCH = 2
STEPS = 6  # two epochs of RECORDS / BATCH = 4 steps
SAVE_STEPS = 3
KILL_AFTER = 4  # one step past the checkpoint at step 3, which the resume computes again
LEARNING_RATE = 2e-3
SEED = 3407


def build_trainer(
    output_dir,
    checkpointing="offload",
    load_in_4bit: bool = False,
    cuda_graphs: bool | None = None,
    callbacks=(),
):
    """The run's ``SFTTrainer``, built from scratch as a restarted script builds it.

    Args:
        output_dir: the trainer's output folder (its checkpoints go there).
        checkpointing: ``use_gradient_checkpointing`` for get_peft_model ("offload",
            "unsloth", "auto", True or False).
        load_in_4bit: NF4 weights through bitsandbytes.
        cuda_graphs: get_peft_model's ``cuda_graphs`` (None: slothkit's choice).
        callbacks: TrainerCallbacks to add.
    """
    from slothkit import FastModel
    from slothkit.data import apply_chat_template, example_dataset
    from slothkit.testing import tiny_model_path
    from slothkit.trl import SFTTrainer
    from slothkit.trl.defaults import sft_config

    model, tokenizer = FastModel.from_pretrained(
        str(tiny_model_path("llama")),
        dtype=torch.float32,
        load_in_4bit=load_in_4bit,
        max_seq_length=96,
        fused=True,  # slothkit's fused layers also on a CPU, where it would keep Hugging Face's
    )
    model = FastModel.get_peft_model(
        model,
        r=8,
        lora_alpha=16,
        use_gradient_checkpointing=checkpointing,
        cuda_graphs=cuda_graphs,
        random_state=SEED,
        **({"max_memory": 1000} if checkpointing == "auto" else {}),
    )
    if checkpointing == "auto":
        _keep_one_layer_of_two(model)
    dataset = apply_chat_template(example_dataset("chat").select(range(RECORDS)), tokenizer)
    args = sft_config(
        model,
        output_dir=str(output_dir),
        max_steps=STEPS,
        per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=1,
        learning_rate=LEARNING_RATE,
        warmup_steps=0,
        logging_steps=1,
        save_steps=SAVE_STEPS,
        seed=SEED,
        disable_tqdm=True,
        dataloader_pin_memory=False,
    )
    return SFTTrainer(
        model=model, processing_class=tokenizer, train_dataset=dataset, args=args, callbacks=list(callbacks)
    )


def _keep_one_layer_of_two(model) -> None:
    """Give the "auto" policy a budget that keeps the second layer's activations and
    offloads the first's at a full batch (BATCH x max_seq_length tokens), and keeps both
    for batches short enough: the policy's choice then changes with the steps' lengths,
    which a resumed run meets from the checkpoint's step on, not from the first."""
    from slothkit.core.inspection import causal_lm_of
    from slothkit.core.model_state import state_of

    causal_lm = causal_lm_of(model)
    policy = state_of(causal_lm).recompute_policy
    tokens = BATCH * state_of(causal_lm).max_seq_length
    assert policy.memory.layers == 2 and policy.choice is None
    policy.budget = (policy.memory.reserved(tokens, 1, 0) + policy.memory.reserved(tokens, 2, 0)) / 2


def step_losses(trainer) -> dict[int, float]:
    """{step: loss} of every logged training step in ``trainer.state.log_history``."""
    return {entry["step"]: entry["loss"] for entry in trainer.state.log_history if "loss" in entry}


def _stop_and_wait_after(step: int, losses_file: Path):
    from transformers import TrainerCallback

    class StopAndWait(TrainerCallback):
        """After ``step``, write the losses logged so far and wait to be killed."""

        def on_log(self, args, state, control, logs=None, **kwargs):
            if state.global_step >= step and "loss" in (logs or {}):
                losses = {entry["step"]: entry["loss"] for entry in state.log_history if "loss" in entry}
                losses_file.with_suffix(".partial").write_text(json.dumps(losses))
                losses_file.with_suffix(".partial").rename(losses_file)
                while True:
                    time.sleep(60)

    return StopAndWait()


def main(argv=None) -> int:
    import warnings

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", required=True)
    parser.add_argument("--checkpointing", default="offload")
    parser.add_argument("--4bit", dest="load_in_4bit", action="store_true")
    parser.add_argument("--cuda-graphs", dest="cuda_graphs", action="store_true")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", message="slothkit_kernels.*no Triton backend")
    warnings.filterwarnings("ignore", category=FutureWarning)
    output = Path(args.output)
    trainer = build_trainer(
        output / "run",
        args.checkpointing,
        args.load_in_4bit,
        cuda_graphs=True if args.cuda_graphs else None,
        callbacks=[_stop_and_wait_after(KILL_AFTER, output / "losses.json")],
    )
    trainer.train()
    return 1  # the callback never lets the run end


if __name__ == "__main__":
    sys.exit(main())
