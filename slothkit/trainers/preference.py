"""Preference training: DPO, ORPO and KTO, TRL's trainers after slothkit's checks.

DPO and KTO compare the policy with a reference; with a PeftModel the reference is the
same model with its adapters switched off (no second copy in memory).  ORPO needs no
reference: an odds-ratio term beside the SFT loss on the chosen answers.
"""

from __future__ import annotations

from slothkit.trainers.checks import checked_trainer
from slothkit.trainers.configs import dpo_config, kto_config, orpo_config, trl_class


def dpo_trainer(model, tokenizer, train_dataset, args=None, eval_dataset=None, **trainer_kwargs):
    """``trl.DPOTrainer`` after checking the data and the setup, as ``sft_trainer``.  With
    a PeftModel the reference model is the same model with its adapters switched off: no
    second copy in memory.

    Args:
        model: the model from ``FastModel.get_peft_model``.
        tokenizer: its tokenizer (TRL's processing_class).
        train_dataset: a ``datasets.Dataset`` of preference pairs: "prompt", "chosen"
            and "rejected" columns (text or conversations).
        args: a ``trl.DPOConfig``; None (default): ``dpo_config(model)``.
        eval_dataset: an evaluation dataset of the same kind (default None).
        **trainer_kwargs: passed to ``trl.DPOTrainer`` (ref_model, callbacks, ...).

    Returns:
        The ``trl.DPOTrainer``.

    Raises:
        ValueError: the data or the setup would fail in training.
    """
    from slothkit.data.validation import check_preference_dataset

    args = dpo_config(model) if args is None else args
    return checked_trainer(
        trl_class("DPOTrainer"),
        model,
        tokenizer,
        args,
        check_preference_dataset,
        train_dataset,
        eval_dataset,
        **trainer_kwargs,
    )


def orpo_trainer(model, tokenizer, train_dataset, args=None, eval_dataset=None, **trainer_kwargs):
    """``trl.experimental.orpo.ORPOTrainer`` after checking the data and the setup, as
    ``sft_trainer``.

    Args:
        model: the model from ``FastModel.get_peft_model``.
        tokenizer: its tokenizer (TRL's processing_class).
        train_dataset: a ``datasets.Dataset`` of preference pairs, as ``dpo_trainer``.
        args: an ``ORPOConfig``; None (default): ``orpo_config(model)``.
        eval_dataset: an evaluation dataset of the same kind (default None).
        **trainer_kwargs: passed to ``ORPOTrainer`` (callbacks, ...).

    Returns:
        The ``ORPOTrainer``.

    Raises:
        ValueError: the data or the setup would fail in training.
    """
    from slothkit.data.validation import check_preference_dataset

    args = orpo_config(model) if args is None else args
    return checked_trainer(
        trl_class("ORPOTrainer"),
        model,
        tokenizer,
        args,
        check_preference_dataset,
        train_dataset,
        eval_dataset,
        **trainer_kwargs,
    )


def kto_trainer(model, tokenizer, train_dataset, args=None, eval_dataset=None, **trainer_kwargs):
    """``trl.KTOTrainer`` after checking the data and the setup, as ``sft_trainer``; the
    reference is the model with its adapters off, as in ``dpo_trainer``.

    Args:
        model: the model from ``FastModel.get_peft_model``.
        tokenizer: its tokenizer (TRL's processing_class).
        train_dataset: a ``datasets.Dataset`` with "prompt", "completion" and "label"
            (True for a desirable completion, False for an undesirable one), or
            preference pairs as ``dpo_trainer`` takes (TRL splits each in two).
        args: a ``trl.KTOConfig``; None (default): ``kto_config(model)``.
        eval_dataset: an evaluation dataset of the same kind (default None).
        **trainer_kwargs: passed to ``trl.KTOTrainer`` (ref_model, callbacks, ...).

    Returns:
        The ``trl.KTOTrainer``.

    Raises:
        ValueError: the data or the setup would fail in training.
    """
    from slothkit.data.validation import check_unpaired_preference_dataset

    args = kto_config(model) if args is None else args
    return checked_trainer(
        trl_class("KTOTrainer"),
        model,
        tokenizer,
        args,
        check_unpaired_preference_dataset,
        train_dataset,
        eval_dataset,
        **trainer_kwargs,
    )
