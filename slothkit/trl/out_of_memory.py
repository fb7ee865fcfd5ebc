"""A CUDA out-of-memory error in training, explained: the step, the settings in use (the
batch, the sequence length, the checkpointing and the "auto" budget in effect), the
memory planner's figures for this model on this GPU, what to change, and the checkpoint
to resume from.  The Trainer's checkpoints are whole folders written between steps, so an
out-of-memory error inside a step leaves every one written before it complete."""

from __future__ import annotations

import os

import torch

from slothkit.core.inspection import causal_lm_of, is_4bit_model
from slothkit.core.model_state import state_of
from slothkit.engine.checkpointing.choice import uses_offloaded_checkpoint
from slothkit.memory.memory_model import GIB


class TrainingOutOfMemoryError(torch.cuda.OutOfMemoryError):
    """CUDA ran out of memory in training; the message says which settings to change.
    A torch.cuda.OutOfMemoryError, so code that catches that still catches this."""


def explain_out_of_memory(trainer, model):
    """Make ``trainer.train()`` turn a CUDA out-of-memory error into one that names the
    settings in use and what to change, with the memory planner's figures for this model
    on this GPU. Patches this trainer instance only.

    Args:
        trainer: a transformers Trainer or TRL trainer.
        model: the model it trains.

    Returns:
        The same trainer, whose ``train()`` raises ``TrainingOutOfMemoryError`` (a
        ``torch.cuda.OutOfMemoryError``) with that advice.
    """
    train = trainer.train

    def train_and_explain(*args, **kwargs):
        try:
            return train(*args, **kwargs)
        except torch.cuda.OutOfMemoryError as error:
            if isinstance(error, TrainingOutOfMemoryError):
                raise
            advice = out_of_memory_advice(trainer.args, model, error, step=trainer.state.global_step + 1)
            raise TrainingOutOfMemoryError(advice) from error

    trainer.train = train_and_explain
    return trainer


def out_of_memory_advice(args, model, error, step: int | None = None) -> str:
    """The message of a ``TrainingOutOfMemoryError`` (module docstring).

    Args:
        args: the trainer's config.
        model: the model it trains.
        error: the out-of-memory error.
        step: the step that ran out (the Trainer's ``global_step + 1``), or None.
    """
    from slothkit.memory.plan import plan, shape_from_config

    causal_lm = causal_lm_of(model)
    batch = getattr(args, "per_device_train_batch_size", None)
    accumulation = getattr(args, "gradient_accumulation_steps", 1)
    state = state_of(causal_lm)
    max_seq_length = state.max_seq_length if state is not None else None
    seq = getattr(args, "max_length", None) or max_seq_length or 2048
    mode = "qlora" if is_4bit_model(causal_lm) else "lora"
    policy = state.recompute_policy if state is not None else None
    at_step = f" at step {step}" if step is not None else ""
    lines = [
        f"CUDA ran out of memory while training{at_step} ({mode}, per_device_train_batch_size={batch}, "
        f"max_length={seq} (the model's max_seq_length: {max_seq_length}), "
        f"gradient_accumulation_steps={accumulation}, {_checkpointing_in_effect(model, policy)}).",
    ]
    try:
        suggested = plan(
            shape_from_config(causal_lm.config), gpu="auto", seq=seq, batch=batch or 1, mode=mode
        )
    except Exception:  # an architecture the planner cannot read: the advice stands alone
        suggested = None
    if suggested is not None and suggested.gpu_gib:
        lines.append(
            f"The memory planner predicts {suggested.total_gib:.1f} GiB (reserved, every layer offloaded) "
            f"for batch {suggested.batch} x "
            f"{suggested.seq} tokens on this {suggested.gpu_gib:.0f} GiB GPU "
            f"(slothkit plan; its notes: {'; '.join(suggested.notes) or 'none'})."
        )
    if policy is not None:
        checkpointing = (
            f"give use_gradient_checkpointing='auto' a lower budget than its {policy.budget / GIB:.2f} GiB "
            "(get_peft_model's max_memory=), so that it keeps fewer layers"
        )
    else:
        checkpointing = "use use_gradient_checkpointing='offload' (or 'auto' with max_memory=) in FastModel.get_peft_model"
    lines.append(
        f"To fit: lower per_device_train_batch_size (now {batch}) and raise gradient_accumulation_steps "
        f"(now {accumulation}) by the same factor (the effective batch stays), or lower max_seq_length "
        f"(max_length, now {seq}); {checkpointing}; "
        + ("" if mode == "qlora" else "load the model with load_in_4bit=True; ")
        + "close other processes on the GPU. "
        + _last_checkpoint(args)
        + "The original error: "
        + str(error).splitlines()[0]
    )
    return "\n".join(lines)


def _checkpointing_in_effect(model, policy) -> str:
    if policy is not None:
        choice = policy.choice
        kept = (
            f", keeping {choice.kept} of {choice.layers} layers' activations "
            f"at {choice.tokens:,} tokens per step"
            if choice is not None
            else ""
        )
        return f"use_gradient_checkpointing='auto' with a budget of {policy.budget / GIB:.2f} GiB{kept}"
    if uses_offloaded_checkpoint(model.modules()):
        return "offloaded gradient checkpointing"
    if any(getattr(module, "gradient_checkpointing", False) for module in model.modules()):
        return "gradient checkpointing"
    return "no gradient checkpointing"


def _last_checkpoint(args) -> str:
    from transformers.trainer_utils import get_last_checkpoint

    folder = getattr(args, "output_dir", None)
    last = get_last_checkpoint(folder) if folder and os.path.isdir(folder) else None
    if last is None:
        return ""
    return (
        f"The checkpoints written before are complete; resume from {last} "
        "with trainer.train(resume_from_checkpoint=True). "
    )
