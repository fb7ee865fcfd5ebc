"""The notebook's data and training cells: load the configured dataset; the settings
slothkit chooses for this machine, which the train cell passes into the TRL config it
builds; after training, report time and peak memory and plot the loss."""

from __future__ import annotations

import dataclasses

import torch

EXAMPLE_PREFIX = "example:"


def load_configured_dataset(source: str):
    """``example:alpaca`` / ``chat`` / ``preference`` / ``math`` (shipped with slothkit,
    slothkit.data.examples), else load_data(source)."""
    from slothkit.data import example_dataset, load_data

    if source.startswith(EXAMPLE_PREFIX):
        return example_dataset(source[len(EXAMPLE_PREFIX) :])
    return load_data(source)


def load_configured_image_dataset(source: str) -> list[dict]:
    """Chat-message records with images for VisionDataCollator: ``example:latex_ocr`` (the
    formula images shipped with slothkit, slothkit.data.example_images), else load_data(source)
    whose records are conversations already (a "messages" column) or ``{"image", "text"}``
    pairs, made conversations with the OCR instruction.

    Raises:
        ValueError: an unknown example, or records with neither form.
    """
    from slothkit.data import load_data
    from slothkit.data.example_images import IMAGE_FOLDER, as_image_chat, example_image_dataset

    if source.startswith(EXAMPLE_PREFIX):
        if source != EXAMPLE_PREFIX + IMAGE_FOLDER:
            raise ValueError(
                f"unknown example image dataset {source!r}; accepted: {EXAMPLE_PREFIX}{IMAGE_FOLDER}"
            )
        return example_image_dataset()
    dataset = load_data(source)
    if "messages" in dataset.column_names:
        return list(dataset)
    if {"image", "text"} <= set(dataset.column_names):
        return [as_image_chat(record) for record in dataset]
    raise ValueError(
        f"{source}: records with columns {dataset.column_names}; accepted: a 'messages' column of "
        f"conversations with image parts, or 'image' and 'text' columns"
    )


@dataclasses.dataclass
class TrainResult:
    first_loss: float
    final_loss: float
    seconds: float
    peak_memory_gib: float | None
    losses: list
    trainer: object
    rewards: list = dataclasses.field(default_factory=list)  # mean reward per logged step (GRPO)

    @property
    def loss_went_down(self) -> bool:
        """Mean of the last quarter of the logged losses below the first quarter's
        (single steps are noisy: each sees a different batch)."""
        quarter = max(1, len(self.losses) // 4)
        first = sum(self.losses[:quarter]) / quarter
        last = sum(self.losses[-quarter:]) / quarter
        return last < first


def _peak_memory_gib() -> float | None:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return None


def trainer_defaults(model) -> dict:
    """The trainer settings slothkit chooses for this machine and model, printed, for the
    train cell to pass into its ``SFTConfig(...)`` / ``DPOConfig(...)`` beside the ones it
    writes out: bf16 / fp16 from the model's compute dtype (fp16 on a T4), ``optim``
    (adamw_8bit on a GPU with bitsandbytes, else adamw_torch), pinned host memory on a GPU
    only, and the Trainer's own checkpointing off (``FastModel.get_peft_model`` set up
    slothkit's).  Also restarts the count of peak GPU memory, so that ``report_training``
    reports this training's peak rather than loading's.

    Args:
        model: the model to train (from ``FastModel.get_peft_model``).

    Returns:
        The settings as config keywords, e.g. ``{"bf16": False, "fp16": True, "optim":
        "adamw_8bit", "dataloader_pin_memory": True, "activation_checkpointing": False}``.
    """
    from transformers import TrainingArguments

    from slothkit.trl.defaults import checkpointing_off, machine_defaults

    settings = {**machine_defaults(model), **checkpointing_off(TrainingArguments)}
    print("for this machine: " + ", ".join(f"{name}={value!r}" for name, value in settings.items()))
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    return settings


def report_training(trainer, trainer_stats) -> TrainResult:
    """Print what the training did (steps, seconds, peak GPU memory, first and last loss)
    and plot the loss curve.  A trainer that logs a mean reward per step (GRPO, RLOO)
    also gets its first and last reward printed, and the reward curve is plotted instead:
    their loss weights each completion by how its reward compares with its group's, and
    is zero whenever a group's rewards are equal, so it shows little of the progress.

    Args:
        trainer: the trainer that ran (its ``state.log_history`` holds the losses).
        trainer_stats: what ``trainer.train()`` returned (its ``metrics`` hold the
            seconds, ``train_runtime``).

    Returns:
        The TrainResult (losses, rewards, seconds, peak memory, the trainer).

    Raises:
        RuntimeError: no loss was logged (max_steps below logging_steps).
    """
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    if not losses:
        raise RuntimeError("training logged no loss; check max_steps and logging_steps")
    rewards = [entry["reward"] for entry in trainer.state.log_history if "reward" in entry]
    seconds = trainer_stats.metrics["train_runtime"]
    result = TrainResult(losses[0], losses[-1], seconds, _peak_memory_gib(), losses, trainer, rewards)
    peak = f", peak GPU memory {result.peak_memory_gib:.2f} GiB" if result.peak_memory_gib else ""
    reward = f"; mean reward {rewards[0]:.3f} -> {rewards[-1]:.3f}" if rewards else ""
    print(
        f"{len(losses)} steps in {seconds:.1f} s{peak}; loss {result.first_loss:.4f} -> "
        f"{result.final_loss:.4f}{reward}"
    )
    if rewards:
        plot_curve(rewards, ylabel="mean reward")
    else:
        plot_curve(losses, ylabel="training loss")
    return result


def train(
    model, tokenizer, dataset, config, responses_only: bool = False, method: str = "sft", **overrides
) -> TrainResult:
    """The train cell in one call: SFT (or DPO) for config.max_steps with the config's batch,
    accumulation, learning rate and sequence length, slothkit's defaults for the rest
    (slothkit.trl.defaults), then ``report_training``.

    Args:
        model: the model from ``FastModel.get_peft_model``.
        tokenizer: its tokenizer.
        dataset: the training dataset (a text column for SFT; prompt, chosen, rejected for DPO).
        config: the notebook's NotebookConfig.
        responses_only: SFT only: the loss on the assistant replies only
            (``slothkit.data.train_on_responses_only``).
        method: "sft" (default) or "dpo".
        **overrides: further config fields; they win.

    Returns:
        The TrainResult.
    """
    from slothkit.trl.registry import TRAINERS_BY_METHOD

    if method not in ("sft", "dpo"):
        raise ValueError(f"method={method!r}; accepted: 'sft', 'dpo'")
    record = TRAINERS_BY_METHOD[method]
    args = record.factory(
        model,
        output_dir=f"{config.output_dir}/checkpoints",
        per_device_train_batch_size=config.batch_size,
        gradient_accumulation_steps=config.grad_accum,
        max_steps=config.max_steps,
        learning_rate=config.learning_rate,
        max_length=config.max_seq_length,
        save_strategy="no",
        **overrides,
    )
    trainer = record.trainer(model=model, processing_class=tokenizer, train_dataset=dataset, args=args)
    if responses_only:
        from slothkit.data import train_on_responses_only

        trainer = train_on_responses_only(trainer)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    return report_training(trainer, trainer.train())


def plot_curve(values: list[float], ylabel: str) -> None:
    """A training curve inline (matplotlib); a one-line note instead when matplotlib is missing.

    Args:
        values: one value per logged step.
        ylabel: what they are ("training loss", "mean reward").
    """
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"(no plot of the {ylabel}: matplotlib is not installed; pip install matplotlib)")
        return
    figure, axes = plt.subplots(figsize=(6, 3))
    axes.plot(range(1, len(values) + 1), values, marker=".")
    axes.set_xlabel("step")
    axes.set_ylabel(ylabel)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    plt.show()
