"""A CUDA out-of-memory error in training, explained: the settings in use, the memory
planner's figures for this model on this GPU, and what to change."""

from __future__ import annotations

import torch

from slothkit.core.inspection import causal_lm_of, is_4bit_model
from slothkit.core.model_state import state_of


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
            raise TrainingOutOfMemoryError(out_of_memory_advice(trainer.args, model, error)) from error

    trainer.train = train_and_explain
    return trainer


def out_of_memory_advice(args, model, error) -> str:
    from slothkit.memory.plan import plan, shape_from_config

    causal_lm = causal_lm_of(model)
    batch = getattr(args, "per_device_train_batch_size", None)
    accumulation = getattr(args, "gradient_accumulation_steps", 1)
    state = state_of(causal_lm)
    seq = getattr(args, "max_length", None) or (state.max_seq_length if state is not None else None) or 2048
    mode = "qlora" if is_4bit_model(causal_lm) else "lora"
    lines = [
        f"CUDA ran out of memory while training ({mode}, per_device_train_batch_size={batch}, "
        f"max_length={seq}, gradient_accumulation_steps={accumulation}).",
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
    lines.append(
        "To fit: lower per_device_train_batch_size and raise gradient_accumulation_steps by the same "
        "factor (the effective batch stays), or lower max_length; load the model with "
        "load_in_4bit=True; use use_gradient_checkpointing='offload' in FastModel.get_peft_model (with 'auto', "
        "give it a lower max_memory=); "
        "close other processes on the GPU. The original error: " + str(error).splitlines()[0]
    )
    return "\n".join(lines)
