"""TRL's trainers, taking the keywords older notebooks pass.

    trainer = SFTTrainer(model=model, tokenizer=tokenizer, train_dataset=dataset,
                         dataset_text_field="text", max_seq_length=2048, packing=False,
                         args=TrainingArguments(warmup_ratio=0.1, max_steps=60, ...))

Each trainer is a subclass of TRL's.  Before TRL's constructor runs, it rewrites:

* ``tokenizer=`` as ``processing_class=``;
* options given to the trainer that TRL 1.x reads from the config (``dataset_text_field``,
  ``max_seq_length`` -> ``max_length``, ``packing``, ``dataset_num_proc``, ``beta``,
  ``max_length``, ``max_prompt_length``, ...) into the config;
* ``args=TrainingArguments(...)`` into the trainer's config class, keeping every value set
  (what TRL itself did before 1.x);

saying once for each how it is written now.  Then, as slothkit.trainers' constructors do,
it checks the setup (``check_setup``: a tokenizer larger than the embeddings, the Trainer's
gradient checkpointing over slothkit's) and the datasets (slothkit.data.validation: a
missing column or a bad record is named before TRL's preprocessing meets it; SFT with a
``formatting_func`` or ``skip_prepare_dataset`` is left to TRL), keeps the adapters in the
dtype get_peft_model gave them, and makes ``train()`` explain a CUDA out-of-memory error.

SFTTrainer trains on the text column when the dataset also holds the ``conversations`` (or
``messages``) it was rendered from, as TRL did before 1.x; TRL 1.x would render those again
with the chat template.

``max_prompt_length`` (dropped by TRL 1.16): DPOTrainer keeps the last max_prompt_length
tokens of each tokenized prompt (and its BOS), the end next to the answer, as TRL's
``truncation_mode="keep_end"`` did for prompts; ORPOTrainer cuts each prompt's text to its
last max_prompt_length tokens before TRL tokenizes it, and KTOTrainer each text prompt of
its datasets (and each text completion to its first max_completion_length tokens);
GRPOTrainer and RLOOTrainer refuse a dataset with a longer prompt (TRL no longer truncates
their prompts).
"""

from __future__ import annotations

import copy
import inspect

import trl

from slothkit.data.validation import (
    check_preference_dataset,
    check_prompt_dataset,
    check_sft_dataset,
    check_unpaired_preference_dataset,
)
from slothkit.notices import say_once
from slothkit.trainers.configs import trl_class
from slothkit.trainers.on_policy_generation import generate_on_fast_path
from slothkit.trl.configs import (
    DPOConfig,
    GRPOConfig,
    KTOConfig,
    ORPOConfig,
    RewardConfig,
    RLOOConfig,
    SFTConfig,
    UnslothTrainingArguments,
    field_names,
)
from slothkit.trl.configs import convert_arguments as _convert_arguments

# Options of TRL's older trainers with no counterpart now that do not change what is trained.
_DROPPED_OPTIONS = {
    "dataset_batch_size": "it only set how many samples a tokenization batch holds",
}


def _modern_keywords(owner: str, trl_class, config_class, args, kwargs: dict, renames: dict):
    """(args, kwargs) for TRL's constructor from the older keywords (module docstring)."""
    kwargs = dict(kwargs)
    if "tokenizer" in kwargs:
        if kwargs.get("processing_class") is not None:
            raise ValueError(f"{owner}: got both tokenizer= and processing_class=; keep processing_class")
        kwargs["processing_class"] = kwargs.pop("tokenizer")
        say_once(f"{owner}(tokenizer=...) is written {owner}(processing_class=...) in TRL 1.x")
    accepted = set(inspect.signature(trl_class.__init__).parameters) - {"self", "args"}
    config_name = config_class.__name__
    fields = field_names(config_class) | set(config_class._extra_keywords)
    options = {}
    for name in [name for name in kwargs if name not in accepted]:
        new = renames.get(name, name)
        if name in _DROPPED_OPTIONS:
            kwargs.pop(name)
            say_once(f"{owner}({name}=...) is ignored: {_DROPPED_OPTIONS[name]}; TRL 1.x has no such option")
        elif new in fields:
            options[new] = kwargs.pop(name)
            say_once(f"{owner}({name}=...) is written {config_name}({new}=...) in TRL 1.x; passed on there")
    unknown = sorted(set(kwargs) - accepted)
    if unknown:
        raise TypeError(
            f"{owner}() got the keyword(s) {unknown}, which neither TRL's {trl_class.__name__} nor its "
            f"{config_name} accepts; check the spelling against both"
        )
    return _convert_arguments(args, config_class, options, owner), kwargs


class _SlothkitSetup:
    """Mixin: slothkit's checks and repairs around TRL's constructor (module docstring)."""

    def _check_dataset(self, dataset, tokenizer, args, kwargs: dict, name: str) -> None:
        """Raise ValueError on a record the trainer could not use (slothkit.data.validation)."""
        raise NotImplementedError

    def _build(self, trl_class, model, args, kwargs):
        import datasets

        from slothkit.data.loading import records_as_dataset
        from slothkit.trainers import check_setup, explain_out_of_memory, restore_adapter_dtypes

        for argument in ("train_dataset", "eval_dataset"):
            if argument in kwargs:
                kwargs[argument] = records_as_dataset(kwargs[argument], argument)
        tokenizer = kwargs.get("processing_class")
        is_model = model is not None and not isinstance(model, str)
        if is_model and tokenizer is not None:
            check_setup(model, getattr(tokenizer, "tokenizer", tokenizer), args)
        for name, key in (("training", "train_dataset"), ("evaluation", "eval_dataset")):
            # A dict of evaluation datasets, or a torch dataset, is left to TRL.
            dataset = kwargs.get(key)
            if isinstance(dataset, (datasets.Dataset, datasets.IterableDataset)):
                self._check_dataset(dataset, getattr(tokenizer, "tokenizer", tokenizer), args, kwargs, name)
        dtypes = {n: p.dtype for n, p in model.named_parameters() if p.requires_grad} if is_model else {}
        trl_class.__init__(self, model=model, args=args, **kwargs)
        if is_model:
            restore_adapter_dtypes(model, dtypes)
            explain_out_of_memory(self, model)


class SFTTrainer(_SlothkitSetup, trl.SFTTrainer):
    """``trl.SFTTrainer`` that takes the older keywords (module docstring).

    Args:
        model: the model (from ``FastModel.get_peft_model``) or a model name.
        args: a ``SFTConfig``, a ``TrainingArguments`` (converted) or None (TRL's defaults
            with the options given here).
        **kwargs: ``trl.SFTTrainer``'s keywords, ``tokenizer=``, and SFTConfig fields such
            as dataset_text_field, max_seq_length, packing, dataset_num_proc.
    """

    _config_class = SFTConfig

    def __init__(self, model=None, args=None, **kwargs):
        args, kwargs = _modern_keywords(
            type(self).__name__,
            trl.SFTTrainer,
            self._config_class,
            args,
            kwargs,
            {"max_seq_length": "max_length"},
        )
        self._build(trl.SFTTrainer, model, args, kwargs)

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


# The columns TRL 1.x renders with the chat template in preference to the text column.
_CONVERSATION_COLUMNS = ("messages", "conversations")


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
        "the conversations with the chat template instead"
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
        "written one (render the text with slothkit.data.apply_chat_template, which leaves it out)"
    )
    return dataset.map(
        lambda record: {field: record[field][len(bos) :] if record[field].startswith(bos) else record[field]},
        desc="Dropping the BOS written in the text",
    )


class DPOTrainer(_SlothkitSetup, trl.DPOTrainer):
    """``trl.DPOTrainer`` that takes the older keywords (module docstring), beta,
    max_length and max_prompt_length among them.

    Args:
        model: the model (from ``FastModel.get_peft_model``) or a model name.
        ref_model: the reference model; None (default): the model with its adapters off.
        args: a ``DPOConfig``, a ``TrainingArguments`` (converted) or None.
        **kwargs: ``trl.DPOTrainer``'s keywords, ``tokenizer=``, and DPOConfig fields.
    """

    def __init__(self, model=None, ref_model=None, args=None, **kwargs):
        args, kwargs = _modern_keywords("DPOTrainer", trl.DPOTrainer, DPOConfig, args, kwargs, {})
        self._build(trl.DPOTrainer, model, args, {"ref_model": ref_model, **kwargs})

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


_TRLORPOTrainer = trl_class("ORPOTrainer")  # in trl.experimental.orpo


def last_tokens_of(tokenizer, text: str, limit: int) -> str:
    """The end of `text` that holds its last `limit` tokens (cut at a token's first
    character, so no text is decoded and re-encoded)."""
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    offsets = encoded["offset_mapping"]
    if len(offsets) <= limit:
        return text
    return text[offsets[len(offsets) - limit][0] :]


class ORPOTrainer(_SlothkitSetup, _TRLORPOTrainer):
    """``trl.experimental.orpo.ORPOTrainer`` that takes the older keywords (module
    docstring) and applies ``max_prompt_length``.

    Args:
        model: the model (from ``FastModel.get_peft_model``) or a model name.
        args: an ``ORPOConfig``, a ``TrainingArguments`` (converted) or None.
        **kwargs: ``ORPOTrainer``'s keywords, ``tokenizer=``, and ORPOConfig fields.
    """

    def __init__(self, model=None, args=None, **kwargs):
        args, kwargs = _modern_keywords("ORPOTrainer", _TRLORPOTrainer, ORPOConfig, args, kwargs, {})
        self._max_prompt_length = getattr(args, "max_prompt_length", None)
        self._build(_TRLORPOTrainer, model, args, kwargs)

    def _check_dataset(self, dataset, tokenizer, args, kwargs, name):
        check_preference_dataset(dataset, name=name)

    def tokenize_row(self, feature, model=None):
        limit = self._max_prompt_length
        if limit is not None and isinstance(feature.get("prompt"), str):
            feature = {**feature, "prompt": last_tokens_of(self.processing_class, feature["prompt"], limit)}
        return super().tokenize_row(feature, model)


class GRPOTrainer(_SlothkitSetup, trl.GRPOTrainer):
    """``trl.GRPOTrainer`` that takes the older keywords (module docstring); a
    ``max_prompt_length`` is checked against the dataset's prompts.

    Args:
        model: the model (from ``FastModel.get_peft_model``) or a model name.
        reward_funcs: as ``trl.GRPOTrainer``.
        args: a ``GRPOConfig``, a ``TrainingArguments`` (converted) or None.
        fast_generation: how completions are sampled: None (default) through slothkit's
            fast decode loop where it pays, True also on a CPU, False Hugging Face's
            generate (slothkit.trainers.on_policy_generation).
        **kwargs: ``trl.GRPOTrainer``'s keywords, ``tokenizer=``, and GRPOConfig fields.
    """

    def __init__(self, model=None, reward_funcs=None, args=None, fast_generation=None, **kwargs):
        args, kwargs = _modern_keywords("GRPOTrainer", trl.GRPOTrainer, GRPOConfig, args, kwargs, {})
        limit = getattr(args, "max_prompt_length", None)
        if limit is not None:
            _check_prompt_lengths(kwargs.get("train_dataset"), kwargs.get("processing_class"), limit)
        self._build(trl.GRPOTrainer, model, args, {"reward_funcs": reward_funcs, **kwargs})
        generate_on_fast_path(self, self.model, fast_generation)

    def _check_dataset(self, dataset, tokenizer, args, kwargs, name):
        check_prompt_dataset(dataset, name=name)


class RLOOTrainer(_SlothkitSetup, trl.RLOOTrainer):
    """``trl.RLOOTrainer`` that takes the older keywords (module docstring); a
    ``max_prompt_length`` is checked against the dataset's prompts.

    Args:
        model: the model (from ``FastModel.get_peft_model``) or a model name.
        reward_funcs: as ``trl.RLOOTrainer``.
        args: an ``RLOOConfig``, a ``TrainingArguments`` (converted) or None.
        fast_generation: as for GRPOTrainer.
        **kwargs: ``trl.RLOOTrainer``'s keywords, ``tokenizer=``, and RLOOConfig fields.
    """

    def __init__(self, model=None, reward_funcs=None, args=None, fast_generation=None, **kwargs):
        args, kwargs = _modern_keywords("RLOOTrainer", trl.RLOOTrainer, RLOOConfig, args, kwargs, {})
        limit = getattr(args, "max_prompt_length", None)
        if limit is not None:
            _check_prompt_lengths(kwargs.get("train_dataset"), kwargs.get("processing_class"), limit)
        self._build(trl.RLOOTrainer, model, args, {"reward_funcs": reward_funcs, **kwargs})
        generate_on_fast_path(self, self.model, fast_generation)

    def _check_dataset(self, dataset, tokenizer, args, kwargs, name):
        check_prompt_dataset(dataset, name=name)


class KTOTrainer(_SlothkitSetup, trl.KTOTrainer):
    """``trl.KTOTrainer`` that takes the older keywords (module docstring) and applies
    ``max_prompt_length`` and ``max_completion_length`` to text prompts and completions.

    Args:
        model: the model (from ``FastModel.get_peft_model``) or a model name.
        ref_model: the reference model; None (default): the model with its adapters off.
        args: a ``KTOConfig``, a ``TrainingArguments`` (converted) or None.
        **kwargs: ``trl.KTOTrainer``'s keywords, ``tokenizer=``, and KTOConfig fields.
    """

    def __init__(self, model=None, ref_model=None, args=None, **kwargs):
        args, kwargs = _modern_keywords("KTOTrainer", trl.KTOTrainer, KTOConfig, args, kwargs, {})
        tokenizer = kwargs.get("processing_class")
        limits = (getattr(args, "max_prompt_length", None), getattr(args, "max_completion_length", None))
        if tokenizer is not None and limits != (None, None):
            for name in ("train_dataset", "eval_dataset"):
                if kwargs.get(name) is not None:
                    kwargs[name] = _cut_texts(
                        kwargs[name], getattr(tokenizer, "tokenizer", tokenizer), *limits
                    )
        self._build(trl.KTOTrainer, model, args, {"ref_model": ref_model, **kwargs})

    def _check_dataset(self, dataset, tokenizer, args, kwargs, name):
        check_unpaired_preference_dataset(dataset, name=name)


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


class RewardTrainer(_SlothkitSetup, trl.RewardTrainer):
    """``trl.RewardTrainer`` that takes the older keywords (module docstring).

    Args:
        model: a reward model (``FastModel.from_pretrained(..., num_labels=1)`` then
            ``FastModel.get_peft_model``) or a model name.
        args: a ``RewardConfig``, a ``TrainingArguments`` (converted) or None.
        **kwargs: ``trl.RewardTrainer``'s keywords, ``tokenizer=``, and RewardConfig
            fields such as max_length.
    """

    def __init__(self, model=None, args=None, **kwargs):
        args, kwargs = _modern_keywords("RewardTrainer", trl.RewardTrainer, RewardConfig, args, kwargs, {})
        self._build(trl.RewardTrainer, model, args, kwargs)

    def _check_dataset(self, dataset, tokenizer, args, kwargs, name):
        check_preference_dataset(dataset, name=name)


def _check_prompt_lengths(dataset, tokenizer, limit: int) -> None:
    if dataset is None or tokenizer is None or "prompt" not in (dataset.column_names or []):
        return
    for index, prompt in enumerate(dataset["prompt"]):
        if isinstance(prompt, str):
            ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        else:
            ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        if len(ids) > limit:
            raise ValueError(
                f"prompt {index} has {len(ids)} tokens, more than max_prompt_length={limit}, and TRL 1.16's "
                f"GRPOTrainer and RLOOTrainer no longer cut prompts: drop the long ones first (dataset.filter(...)) or leave "
                "max_prompt_length out"
            )


class UnslothTrainer(SFTTrainer):
    """``SFTTrainer`` (with the older keywords) whose optimizer gives the embeddings'
    trainable parameters their own learning rate, ``args.embedding_learning_rate``
    (UnslothTrainingArguments), as continued pretraining wants: new rows of
    ``embed_tokens`` and ``lm_head`` (``modules_to_save``) learn slower than the adapters.

    Args:
        model: the model (from ``FastModel.get_peft_model``).
        args: an ``UnslothTrainingArguments``, another config (converted) or None.
        **kwargs: as SFTTrainer.
    """

    _config_class = UnslothTrainingArguments

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
    from slothkit.engine.inspection import causal_lm_of

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
        "leave the call out (import DPOTrainer from slothkit.trl for the older keywords)"
    )
