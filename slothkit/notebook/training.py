"""The notebook's data and training cells: load the configured dataset, train with
TRL's SFTTrainer, plot the loss, report time and peak memory."""

from __future__ import annotations

import dataclasses
import time

import torch

EXAMPLE_PREFIX = "example:"


def load_configured_dataset(source: str):
    """``example:alpaca`` / ``example:chat`` (shipped with slothkit), else load_data(source)."""
    from slothkit.data import example_dataset, load_data

    if source.startswith(EXAMPLE_PREFIX):
        return example_dataset(source[len(EXAMPLE_PREFIX) :])
    return load_data(source)


@dataclasses.dataclass
class TrainResult:
    first_loss: float
    final_loss: float
    seconds: float
    peak_memory_gib: float | None
    losses: list
    trainer: object

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


def train(
    model, tokenizer, dataset, config, responses_only: bool = False, method: str = "sft", **overrides
) -> TrainResult:
    """SFT (or DPO, method="dpo") for config.max_steps with the config's batch, accumulation
    and learning rate."""
    from slothkit import trainers

    if method not in ("sft", "dpo"):
        raise ValueError(f"method={method!r}; accepted: 'sft', 'dpo'")
    make_config = trainers.sft_config if method == "sft" else trainers.dpo_config
    make_trainer = trainers.sft_trainer if method == "sft" else trainers.dpo_trainer
    args = make_config(
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
    trainer = make_trainer(model, tokenizer, dataset, args=args)
    if responses_only:
        from slothkit.data import train_on_responses_only

        trainer = train_on_responses_only(trainer)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    if not losses:
        raise RuntimeError("training logged no loss; check max_steps and logging_steps")
    result = TrainResult(losses[0], losses[-1], seconds, _peak_memory_gib(), losses, trainer)
    peak = f", peak GPU memory {result.peak_memory_gib:.2f} GiB" if result.peak_memory_gib else ""
    print(
        f"{len(losses)} steps in {seconds:.1f} s{peak}; loss {result.first_loss:.4f} -> "
        f"{result.final_loss:.4f}"
    )
    plot_losses(losses)
    return result


def plot_losses(losses: list[float]) -> None:
    """A loss curve inline (matplotlib); a one-line note instead when matplotlib is missing."""
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        print("(no loss plot: matplotlib is not installed; pip install matplotlib)")
        return
    figure, axes = plt.subplots(figsize=(6, 3))
    axes.plot(range(1, len(losses) + 1), losses, marker=".")
    axes.set_xlabel("step")
    axes.set_ylabel("training loss")
    axes.grid(alpha=0.3)
    figure.tight_layout()
    plt.show()
