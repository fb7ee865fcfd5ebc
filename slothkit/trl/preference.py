"""Preference training: DPO, ORPO and KTO, TRL's trainers with slothkit's setup
(slothkit.trl.setup).

DPO and KTO compare the policy with a reference; with a PeftModel the reference is the
same model with its adapters switched off (no second copy in memory).  ORPO needs no
reference: an odds-ratio term beside the SFT loss on the chosen answers.

``max_prompt_length`` (dropped by TRL 1.16, kept by slothkit.trl's configs): DPOTrainer
keeps the last max_prompt_length tokens of each tokenized prompt (and its BOS), the end
next to the answer, as TRL's ``truncation_mode="keep_end"`` did for prompts; ORPOTrainer
cuts each prompt's text to its last max_prompt_length tokens before TRL tokenizes it, and
KTOTrainer each text prompt of its datasets (and each text completion to its first
max_completion_length tokens).
"""

from __future__ import annotations

import copy

import trl

from slothkit.data.validation import check_preference_dataset, check_unpaired_preference_dataset
from slothkit.trl.configs import DPOConfig, KTOConfig, ORPOConfig
from slothkit.trl.library import trl_class
from slothkit.trl.setup import TrainerSetup


class DPOTrainer(TrainerSetup, trl.DPOTrainer):
    """``trl.DPOTrainer`` with slothkit's setup (slothkit.trl.setup) and
    ``max_prompt_length`` (module docstring).

    Args:
        model: the model (from ``FastModel.get_peft_model``) or a model name.
        ref_model: the reference model; None (default): the model with its adapters off.
        args: a ``DPOConfig``, a ``TrainingArguments`` (converted) or None
            (``slothkit.trl.defaults.dpo_config(model)`` with the options given here).
        **kwargs: ``trl.DPOTrainer``'s keywords (processing_class, train_dataset: "prompt",
            "chosen" and "rejected" columns, ...), ``tokenizer=``, and DPOConfig fields
            (beta, max_length, max_prompt_length, ...).

    Raises:
        ValueError: the data or the setup would fail in training.
    """

    _trl_trainer = trl.DPOTrainer
    _config_class = DPOConfig
    _method = "dpo"

    def __init__(self, model=None, ref_model=None, args=None, **kwargs):
        args, kwargs = self._modern_keywords(model, args, kwargs)
        self._build(model, args, {"ref_model": ref_model, **kwargs})

    def _check_dataset(self, dataset, tokenizer, args, kwargs, name):
        check_preference_dataset(dataset, name=name)

    def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
        limit = getattr(args, "max_prompt_length", None)
        if limit is None:
            return super()._prepare_dataset(dataset, processing_class, args, dataset_name)
        # TRL drops the samples whose prompt alone fills max_length; that check must see the
        # prompts after they are cut, so it runs here, after.
        uncut = copy.copy(args)
        uncut.max_length = None
        dataset = super()._prepare_dataset(dataset, processing_class, uncut, dataset_name)
        bos = getattr(self._tokenizer, "bos_token_id", None)

        def cut(example):
            ids = example["prompt_ids"]
            if len(ids) <= limit:
                return {"prompt_ids": ids}
            if bos is not None and ids[0] == bos and limit > 1:
                return {"prompt_ids": [bos] + ids[len(ids) - limit + 1 :]}
            return {"prompt_ids": ids[len(ids) - limit :]}

        dataset = dataset.map(
            cut, desc=f"Keeping the last {limit} prompt tokens of the {dataset_name} dataset"
        )
        if args.max_length is not None and args.truncation_mode == "keep_start":
            dataset = dataset.filter(lambda example: len(example["prompt_ids"]) < args.max_length)
        return dataset


_TRL_ORPO_TRAINER = trl_class("ORPOTrainer")  # in trl.experimental.orpo


class ORPOTrainer(TrainerSetup, _TRL_ORPO_TRAINER):
    """``trl.experimental.orpo.ORPOTrainer`` with slothkit's setup (slothkit.trl.setup)
    and ``max_prompt_length`` (module docstring).

    Args:
        model: the model (from ``FastModel.get_peft_model``) or a model name.
        args: an ``ORPOConfig``, a ``TrainingArguments`` (converted) or None
            (``slothkit.trl.defaults.orpo_config(model)`` with the options given here).
        **kwargs: ``ORPOTrainer``'s keywords (train_dataset: preference pairs, as
            DPOTrainer's), ``tokenizer=``, and ORPOConfig fields.

    Raises:
        ValueError: the data or the setup would fail in training.
    """

    _trl_trainer = _TRL_ORPO_TRAINER
    _config_class = ORPOConfig
    _method = "orpo"

    def __init__(self, model=None, args=None, **kwargs):
        args, kwargs = self._modern_keywords(model, args, kwargs)
        self._max_prompt_length = getattr(args, "max_prompt_length", None)
        self._build(model, args, kwargs)

    def _check_dataset(self, dataset, tokenizer, args, kwargs, name):
        check_preference_dataset(dataset, name=name)

    def tokenize_row(self, feature, model=None):
        limit = self._max_prompt_length
        if limit is not None and isinstance(feature.get("prompt"), str):
            feature = {**feature, "prompt": last_tokens_of(self.processing_class, feature["prompt"], limit)}
        return super().tokenize_row(feature, model)


class KTOTrainer(TrainerSetup, trl.KTOTrainer):
    """``trl.KTOTrainer`` with slothkit's setup (slothkit.trl.setup); applies
    ``max_prompt_length`` and ``max_completion_length`` to text prompts and completions.

    Args:
        model: the model (from ``FastModel.get_peft_model``) or a model name.
        ref_model: the reference model; None (default): the model with its adapters off.
        args: a ``KTOConfig``, a ``TrainingArguments`` (converted) or None
            (``slothkit.trl.defaults.kto_config(model)`` with the options given here).
        **kwargs: ``trl.KTOTrainer``'s keywords (train_dataset: "prompt", "completion" and
            "label", True for a desirable completion, or preference pairs, which TRL
            splits in two), ``tokenizer=``, and KTOConfig fields.

    Raises:
        ValueError: the data or the setup would fail in training.
    """

    _trl_trainer = trl.KTOTrainer
    _config_class = KTOConfig
    _method = "kto"

    def __init__(self, model=None, ref_model=None, args=None, **kwargs):
        args, kwargs = self._modern_keywords(model, args, kwargs)
        tokenizer = kwargs.get("processing_class")
        limits = (getattr(args, "max_prompt_length", None), getattr(args, "max_completion_length", None))
        if tokenizer is not None and limits != (None, None):
            for name in ("train_dataset", "eval_dataset"):
                if kwargs.get(name) is not None:
                    kwargs[name] = _cut_texts(
                        kwargs[name], getattr(tokenizer, "tokenizer", tokenizer), *limits
                    )
        self._build(model, args, {"ref_model": ref_model, **kwargs})

    def _check_dataset(self, dataset, tokenizer, args, kwargs, name):
        check_unpaired_preference_dataset(dataset, name=name)


def last_tokens_of(tokenizer, text: str, limit: int) -> str:
    """The end of `text` that holds its last `limit` tokens (cut at a token's first
    character, so no text is decoded and re-encoded)."""
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    offsets = encoded["offset_mapping"]
    if len(offsets) <= limit:
        return text
    return text[offsets[len(offsets) - limit][0] :]


def first_tokens_of(tokenizer, text: str, limit: int) -> str:
    """The start of `text` that holds its first `limit` tokens (cut where the next token
    starts, so no text is decoded and re-encoded)."""
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    offsets = encoded["offset_mapping"]
    if len(offsets) <= limit:
        return text
    return text[: offsets[limit][0]]


def _cut_texts(dataset, tokenizer, prompt_limit, completion_limit):
    """Text prompts cut to their last `prompt_limit` tokens, text completions to their first
    `completion_limit` (the part next to the prompt), as TRL's KTOTrainer did before 1.x."""
    columns = dataset.column_names or []

    def cut(record):
        changed = {}
        if prompt_limit is not None and isinstance(record.get("prompt"), str):
            changed["prompt"] = last_tokens_of(tokenizer, record["prompt"], prompt_limit)
        if completion_limit is not None and isinstance(record.get("completion"), str):
            changed["completion"] = first_tokens_of(tokenizer, record["completion"], completion_limit)
        return changed

    if not {"prompt", "completion"} & set(columns):
        return dataset
    return dataset.map(cut, desc="Applying max_prompt_length and max_completion_length")
