"""Supervised fine-tuning: ``SFTTrainer``, TRL's with slothkit's setup (slothkit.trl.setup).

Two repairs to the data of notebooks written for TRL before 1.x:

* a dataset holding the text column and the ``conversations`` (or ``messages``) it was
  rendered from trains on the text, as TRL did before 1.x; TRL 1.x would render the
  conversations again with the chat template;
* text rendered with ``tokenizer.apply_chat_template(..., tokenize=False)`` holds a BOS
  that tokenizing adds again: the written one goes.
"""

from __future__ import annotations

import trl

from slothkit.core.notices import DataWarning, say_once
from slothkit.data.validation import check_sft_dataset
from slothkit.trl.configs import SFTConfig
from slothkit.trl.setup import TrainerSetup

# The columns TRL 1.x renders with the chat template in preference to the text column.
_CONVERSATION_COLUMNS = ("messages", "conversations")


class SFTTrainer(TrainerSetup, trl.SFTTrainer):
    """``trl.SFTTrainer`` with slothkit's setup: the older keywords, slothkit's defaults
    when no config is given, the data checked first (slothkit.trl.setup).

    Args:
        model: the model (from ``FastModel.get_peft_model``) or a model name.
        args: a ``SFTConfig``, a ``TrainingArguments`` (converted) or None
            (``slothkit.trl.defaults.sft_config(model)`` with the options given here).
        **kwargs: ``trl.SFTTrainer``'s keywords (processing_class, train_dataset,
            eval_dataset, callbacks, ...), ``tokenizer=``, and SFTConfig fields such as
            dataset_text_field, max_seq_length, packing, dataset_num_proc.

    Raises:
        ValueError: the data or the setup would fail in training; the message says what
            and where.
    """

    _trl_trainer = trl.SFTTrainer
    _config_class = SFTConfig
    _method = "sft"
    _renames = {"max_seq_length": "max_length"}

    def __init__(self, model=None, args=None, **kwargs):
        args, kwargs = self._modern_keywords(model, args, kwargs)
        self._build(model, args, kwargs)

    def _check_dataset(self, dataset, tokenizer, args, kwargs, name):
        if kwargs.get("formatting_func") is not None or (args.dataset_kwargs or {}).get(
            "skip_prepare_dataset"
        ):
            return  # the records are the formatting function's or the caller's to prepare
        check_sft_dataset(dataset, tokenizer, text_field=args.dataset_text_field, name=name)

    def _prepare_dataset(self, dataset, processing_class, args, packing, formatting_func, dataset_name):
        # Notebooks render their text column with tokenizer.apply_chat_template(...,
        # tokenize=False), which writes the BOS; TRL's tokenizing adds another.  One goes,
        # as slothkit.data.apply_chat_template drops it.
        dataset = _text_over_conversations(dataset, args.dataset_text_field)
        dataset = _without_written_bos(dataset, processing_class, args.dataset_text_field)
        return super()._prepare_dataset(
            dataset, processing_class, args, packing, formatting_func, dataset_name
        )


def _text_over_conversations(dataset, field: str):
    """A dataset with the text column and a conversation column (the notebooks render
    "conversations" into "text" and keep both) trains on the text, as TRL did before 1.x:
    TRL 1.x would render the conversations again with the tokenizer's chat template, which
    fails when that template reads ShareGPT's keys (mapping=) and ignores what the
    notebook's formatter wrote."""
    import datasets

    if not (isinstance(dataset, datasets.Dataset) and field in dataset.column_names):
        return dataset
    conversations = [name for name in _CONVERSATION_COLUMNS if name in dataset.column_names]
    if not conversations or not isinstance(dataset[0][field], str):
        return dataset
    say_once(
        f"the dataset has a {field!r} column and {', '.join(map(repr, conversations))}: slothkit trains on "
        f"{field!r} (dataset_text_field), as TRL did before 1.x; drop the {field!r} column to have TRL render "
        "the conversations with the chat template instead",
        DataWarning,
    )
    return dataset.remove_columns(conversations)


def _without_written_bos(dataset, processing_class, field: str):
    import datasets

    from slothkit.data.chat_templates import adds_bos

    tokenizer = getattr(processing_class, "tokenizer", processing_class)
    bos = getattr(tokenizer, "bos_token", None)
    if not (isinstance(dataset, datasets.Dataset) and bos and field in dataset.column_names):
        return dataset
    if not any(isinstance(t, str) and t.startswith(bos) for t in dataset[:64][field]) or not adds_bos(
        tokenizer
    ):
        return dataset
    say_once(
        f"the {field!r} column starts with the BOS token {bos!r} and tokenizing adds one: slothkit drops the "
        "written one (render the text with slothkit.data.apply_chat_template, which leaves it out)",
        DataWarning,
    )
    return dataset.map(
        lambda record: {field: record[field][len(bos) :] if record[field].startswith(bos) else record[field]},
        desc="Dropping the BOS written in the text",
    )
