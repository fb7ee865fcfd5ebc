"""Unsloth's trainer names: ``UnslothTrainer`` (an SFTTrainer with its own learning rate
for the embeddings, for continued pretraining), ``unsloth_train``, ``PatchDPOTrainer``
(nothing to do on slothkit) and ``UnslothVisionDataCollator`` (slothkit's
VisionDataCollator, under the name its vision notebooks import from ``unsloth.trainer``)."""

from __future__ import annotations

from slothkit.core.inspection import causal_lm_of
from slothkit.core.notices import LegacySpellingWarning, say_once
from slothkit.data.vision_collator import VisionDataCollator
from slothkit.trl.configs import UnslothTrainingArguments
from slothkit.trl.supervised import SFTTrainer


class UnslothTrainer(SFTTrainer):
    """``SFTTrainer`` whose optimizer gives the embeddings'
    trainable parameters their own learning rate, ``args.embedding_learning_rate``
    (UnslothTrainingArguments), as continued pretraining wants: new rows of
    ``embed_tokens`` and ``lm_head`` (``modules_to_save``) learn slower than the adapters.

    Args:
        model: the model (from ``FastModel.get_peft_model``).
        args: an ``UnslothTrainingArguments``, another config (converted) or None.
        **kwargs: as SFTTrainer.
    """

    _config_class = UnslothTrainingArguments  # slothkit's SFT defaults when args is None

    def create_optimizer(self, model=None):
        optimizer = super().create_optimizer(model)
        rate = getattr(self.args, "embedding_learning_rate", None)
        if rate is None or getattr(self, "_embedding_group_split", False):
            return optimizer
        embedding_ids = _embedding_parameter_ids(self.model if model is None else model)
        # Move the embeddings' parameters out of each group into a copy of that group (its
        # weight decay kept) with their own learning rate; no step has run, so no state moves.
        for group in list(optimizer.param_groups):
            moved = [p for p in group["params"] if id(p) in embedding_ids]
            if not moved:
                continue
            group["params"] = [p for p in group["params"] if id(p) not in embedding_ids]
            optimizer.add_param_group(
                {**{k: v for k, v in group.items() if k != "params"}, "params": moved, "lr": rate}
            )
        optimizer.param_groups[:] = [g for g in optimizer.param_groups if g["params"]]
        self._embedding_group_split = True
        return optimizer


def _embedding_parameter_ids(model) -> set[int]:
    """ids of the trainable parameters inside the input and output embedding modules
    (their modules_to_save copies and any adapters on them)."""
    causal_lm = causal_lm_of(model)
    found = set()
    for module in (causal_lm.get_input_embeddings(), causal_lm.get_output_embeddings()):
        if module is not None:
            found |= {id(p) for p in module.parameters() if p.requires_grad}
    return found


def unsloth_train(trainer, *args, **kwargs):
    """Run ``trainer.train()`` (slothkit's trainers accumulate gradients correctly
    themselves: the loss is divided by the trainable tokens of the whole accumulated batch).

    Args:
        trainer: any transformers or TRL trainer.
        *args: passed to ``trainer.train``.
        **kwargs: passed to ``trainer.train``.

    Returns:
        What ``trainer.train()`` returns.
    """
    return trainer.train(*args, **kwargs)


def PatchDPOTrainer() -> None:  # noqa: N802 - the name older notebooks call
    """Nothing to patch: slothkit.trl.DPOTrainer (and TRL's own) train slothkit's models as
    they are.  Says so once."""
    say_once(
        "PatchDPOTrainer() does nothing on slothkit: TRL's DPOTrainer trains slothkit's models as they are; "
        "leave the call out (import DPOTrainer from slothkit.trl for the older keywords)",
        LegacySpellingWarning,
    )


UnslothVisionDataCollator = VisionDataCollator
