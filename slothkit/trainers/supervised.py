"""Supervised fine-tuning: TRL's SFTTrainer after slothkit's checks."""

from __future__ import annotations

from slothkit.trainers.checks import checked_trainer
from slothkit.trainers.configs import sft_config, trl_class


def sft_trainer(model, tokenizer, train_dataset, args=None, eval_dataset=None, **trainer_kwargs):
    """``trl.SFTTrainer`` after checking the data (slothkit.data.validation) and the setup
    (``check_setup``); the adapters keep their dtype, and an out-of-memory error in
    ``train()`` names the settings to change (``explain_out_of_memory``).

    Args:
        model: the model from ``FastModel.get_peft_model``.
        tokenizer: its tokenizer (TRL's processing_class).
        train_dataset: a ``datasets.Dataset`` (or a list of dicts, converted) with a text
            column (``args.dataset_text_field``), conversations ("messages", or
            ShareGPT's "conversations"), "prompt" and "completion" columns, or
            "input_ids" (already tokenized).
        args: a ``trl.SFTConfig``; None (default): ``sft_config(model)``.
        eval_dataset: an evaluation dataset of the same kind (default None).
        **trainer_kwargs: passed to ``trl.SFTTrainer`` (callbacks, data_collator, ...).

    Returns:
        The ``trl.SFTTrainer``.

    Raises:
        ValueError: the data or the setup would fail in training; the message says
            what and where.
    """
    from slothkit.data.validation import check_sft_dataset

    args = sft_config(model) if args is None else args

    def check(dataset, name):
        check_sft_dataset(dataset, tokenizer, text_field=args.dataset_text_field, name=name)

    return checked_trainer(
        trl_class("SFTTrainer"), model, tokenizer, args, check, train_dataset, eval_dataset, **trainer_kwargs
    )
