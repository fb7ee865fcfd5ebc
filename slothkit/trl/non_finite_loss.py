"""A NaN or infinite loss (or gradient norm) in training, named at the step where it
appears: slothkit.trl's trainers stop with ``NonFiniteLossError``.

transformers' Trainer, with ``logging_nan_inf_filter`` on (its default), leaves such a
loss out of the logged mean and goes on: the step's NaN gradients reach AdamW, which
writes NaN into every adapter, and every later loss is NaN, logged as the mean of the
earlier ones.  No later step can recover, so slothkit stops at the first one and says
where it came from and what to change.

When it is checked, and what it costs:

* ``logging_nan_inf_filter=True`` (the default): the Trainer reads every micro-batch's
  loss on the host for its filter, a synchronisation it makes anyway; slothkit reads the
  same value there.  A non-finite loss stops training before the optimizer step, so the
  adapters in memory are the previous step's, and the micro-batch is at hand: its forward
  is run again without gradients to find the first module whose output is not finite.
* ``logging_nan_inf_filter=False``: the Trainer reads the loss only at logging steps;
  slothkit keeps the micro-batches' losses on the device and reads them there.  The
  optimizer has taken the step by then.
* the gradient norm, as the Trainer logs it (each logging step's last): non-finite with
  a finite loss stops training too, unless a GradScaler is in use (fp16), which skips
  such a step and lowers its scale: an occasional skipped step is normal there.
"""

from __future__ import annotations

import math
import os

import torch

from slothkit.core.inspection import causal_lm_of
from slothkit.engine.decoder import decoder_layers

IGNORED_LABEL = -100  # the label of a token that is not trained


class NonFiniteLossError(FloatingPointError):
    """Training met a NaN or infinite loss or gradient norm; the message names the step,
    where it came from when that could be found, and what to change."""


class NonFiniteWatch:
    """One trainer's check (module docstring): ``after_micro_batch`` from its
    ``training_step``, ``after_log`` from its ``log``.

    Args:
        trainer: the transformers or TRL trainer.
    """

    def __init__(self, trainer):
        self.trainer = trainer
        self.pending: list[tuple[int, int, torch.Tensor]] = []  # (step, micro-batch, loss)
        self._step = 0
        self._micro_batch = 0

    def after_micro_batch(self, model, inputs, loss: torch.Tensor) -> None:
        """Check (or keep, to check at the next log) one micro-batch's loss.

        Raises:
            NonFiniteLossError: the loss is NaN or infinite (checked here only where the
                Trainer reads it here too).
        """
        step = self.trainer.state.global_step + 1
        self._micro_batch = self._micro_batch + 1 if step == self._step else 1
        self._step = step
        if not self.trainer.args.logging_nan_inf_filter:
            self.pending.append((step, self._micro_batch, loss.detach()))
            return
        if not bool(torch.isfinite(loss).all()):
            where = _where_it_appears(model, inputs)
            raise NonFiniteLossError(self._message(step, self._micro_batch, float(loss), where, before=True))

    def after_log(self, logs: dict) -> None:
        """Check the losses kept since the last log, and the logged gradient norm.

        Raises:
            NonFiniteLossError: one of them is NaN or infinite.
        """
        if self.pending:
            losses = torch.stack([loss.float().reshape(()) for _, _, loss in self.pending]).tolist()
            kept, self.pending = self.pending, []
            for (step, micro_batch, _), value in zip(kept, losses):
                if not math.isfinite(value):
                    raise NonFiniteLossError(self._message(step, micro_batch, value, None, before=False))
        grad_norm = logs.get("grad_norm")
        scaler = getattr(getattr(self.trainer, "accelerator", None), "scaler", None)
        if grad_norm is not None and not math.isfinite(grad_norm) and scaler is None:
            step = self.trainer.state.global_step
            raise NonFiniteLossError(
                f"the gradient norm was {grad_norm} at step {step} (the loss logged: {logs.get('loss')}); "
                f"the optimizer took that step, so the adapters may hold NaN now. " + self._advice()
            )

    def _message(self, step: int, micro_batch: int, value: float, where: str | None, before: bool) -> str:
        args = self.trainer.args
        accumulation = getattr(args, "gradient_accumulation_steps", 1)
        lines = [
            f"the training loss was {value} at step {step} (micro-batch {micro_batch} of {accumulation}); "
            + (where or "")
        ]
        if before:
            lines.append(
                "Training stopped before that step's update: the adapters are those of the step before."
            )
        else:
            lines.append(
                "The optimizer took that step (logging_nan_inf_filter=False checks at the logging steps): "
                "the adapters may hold NaN now."
            )
        lines.append(self._advice())
        return "\n".join(lines)

    def _advice(self) -> str:
        from transformers.trainer_utils import get_last_checkpoint

        args = self.trainer.args
        precision = "fp16" if args.fp16 else "bf16" if args.bf16 else "fp32"
        advice = [
            f"To go on: lower the learning rate (it is {args.learning_rate:g}) or max_grad_norm "
            f"(it is {args.max_grad_norm:g})",
            "check the data around this step",
        ]
        if precision == "fp16":
            advice.append(
                "train in bf16 where the GPU has it (Ampere or newer): "
                "fp16 overflows above 65,504, bf16 does not"
            )
        text = "; ".join(advice) + f" (precision: {precision})."
        last = (
            get_last_checkpoint(args.output_dir)
            if args.output_dir and os.path.isdir(args.output_dir)
            else None
        )
        if last is not None:
            text += f" Then resume from {last} with trainer.train(resume_from_checkpoint=True)."
        return text


def _where_it_appears(model, inputs) -> str:
    """Where the non-finite values first appear, found by running the micro-batch's forward
    again without gradients: the adapters holding NaN already, the first module (input
    embeddings, a decoder layer, the final norm) whose output is not finite, or none of
    them (then the loss itself: a batch with no trained token, or the output head)."""
    bad = [name for name, p in model.named_parameters() if p.requires_grad and not torch.isfinite(p).all()]
    if bad:
        return f"the trained weights already hold NaN or inf ({len(bad)} tensors, the first {bad[0]})."
    input_ids = inputs.get("input_ids") if isinstance(inputs, dict) else None
    if not torch.is_tensor(input_ids):
        return ""
    trained = _trained_tokens(inputs)
    batch = f"the micro-batch: {input_ids.shape[0]} sequences of {input_ids.shape[-1]} tokens"
    batch += f", {trained} trained." if trained is not None else "."
    try:
        module = _first_non_finite_module(model, inputs)
    except Exception:  # a model the plain re-run does not fit: the report goes without the module
        return batch
    if module is not None:
        return f"the first values that are not finite come out of {module}; {batch}"
    if trained == 0:
        return f"{batch} With no trained token the mean loss is 0 / 0; drop such samples."
    return f"every decoder layer's output is finite, so the loss (or the output head) made it; {batch}"


def _trained_tokens(inputs) -> int | None:
    labels = inputs.get("labels")
    if not torch.is_tensor(labels):
        return None
    return int((labels[..., 1:] != IGNORED_LABEL).sum())  # each label is predicted from the token before


def _first_non_finite_module(model, inputs) -> str | None:
    causal_lm, layers = decoder_layers(model)
    named = [("the input embeddings", causal_lm.get_input_embeddings())]
    named += [(f"decoder layer {index}", layer) for index, layer in enumerate(layers)]
    decoder = causal_lm_of(model).base_model
    if isinstance(getattr(decoder, "norm", None), torch.nn.Module):
        named.append(("the final norm", decoder.norm))
    found: list[str] = []

    def watch(name):
        def hook(module, args, output):
            tensor = output[0] if isinstance(output, (tuple, list)) else output
            if not found and torch.is_tensor(tensor) and not torch.isfinite(tensor).all():
                found.append(name)

        return hook

    handles = [module.register_forward_hook(watch(name)) for name, module in named]
    keys = ("input_ids", "attention_mask", "position_ids")
    training = model.training
    try:
        model.eval()  # no checkpointing, no dropout: the same forward, once
        with torch.no_grad():
            decoder(**{key: inputs[key] for key in keys if torch.is_tensor(inputs.get(key))})
    finally:
        for handle in handles:
            handle.remove()
        model.train(training)
    return found[0] if found else None
