"""What every trainer of slothkit.trl does around TRL's constructor (``TrainerSetup``):

1. rewrite the keywords older notebooks pass: ``tokenizer=`` as ``processing_class=``;
   options given to the trainer that TRL 1.x reads from its config (``dataset_text_field``,
   ``max_seq_length`` -> ``max_length``, ``packing``, ``beta``, ``max_prompt_length``, ...)
   into the config; ``args=TrainingArguments(...)`` into the trainer's config class,
   keeping every value set; saying once for each how it is written now;
2. with no config given, build slothkit's (slothkit.trl.defaults) for the trainer's method;
3. check the setup (``check_setup``) and the datasets (slothkit.data.validation: a missing
   column or a bad record is named before TRL's preprocessing meets it); a list of records
   is taken as a ``datasets.Dataset``;
4. after TRL's constructor, give the adapters back the dtype TRL changed, and make
   ``train()`` explain a CUDA out-of-memory error (slothkit.trl.out_of_memory);
5. in training, stop at the first NaN or infinite loss, naming its step
   (slothkit.trl.non_finite_loss).
"""

from __future__ import annotations

import inspect
import warnings

import torch

from slothkit.core.distributed import check_ddp_settings
from slothkit.core.inspection import causal_lm_of
from slothkit.core.model_state import state_of
from slothkit.core.notices import LegacySpellingWarning, say_once
from slothkit.engine.checkpointing.choice import uses_offloaded_checkpoint
from slothkit.trl.configs import convert_arguments, field_names
from slothkit.trl.defaults import default_config
from slothkit.trl.non_finite_loss import NonFiniteWatch
from slothkit.trl.out_of_memory import explain_out_of_memory


def check_setup(model, tokenizer, args) -> None:
    """Catch what would fail (or silently misbehave) deep inside a trainer: a tokenizer
    larger than the model's embeddings, bf16 on a machine without it.  Turns off (with a
    warning) ``args.gradient_checkpointing``, which would replace the checkpointing
    ``FastModel.get_peft_model`` set up; under a launcher (WORLD_SIZE > 1) sets an unset
    ``ddp_find_unused_parameters`` to False (slothkit.core.distributed.check_ddp_settings).

    Args:
        model: the model to train (a PeftModel or a plain model).
        tokenizer: the tokenizer the data was (or will be) tokenized with.
        args: the trainer's config (``trl.SFTConfig``, ``TrainingArguments``, ...);
            may be changed in place.

    Raises:
        ValueError: the tokenizer has more ids than the embeddings have rows,
            bf16=True without bf16 support, or ddp_find_unused_parameters=True with
            slothkit's offloaded checkpointing under a launcher.
    """
    causal_lm = causal_lm_of(model)
    rows = causal_lm.get_input_embeddings().weight.shape[0]
    if len(tokenizer) > rows:
        raise ValueError(
            f"the tokenizer has {len(tokenizer)} ids but the model's embeddings {rows} rows; call "
            "get_chat_template(..., model=model) before FastModel.get_peft_model so that they grow together"
        )
    state = state_of(causal_lm)  # patched, or loaded through FastModel
    patched = state is not None and (state.architecture is not None or state.tokenizer is not None)
    # transformers 5's Trainer reads activation_checkpointing; gradient_checkpointing is its
    # deprecated mirror, which TRL still reads: both are turned off.
    names = [
        name for name in ("gradient_checkpointing", "activation_checkpointing") if getattr(args, name, False)
    ]
    if patched and names:
        warnings.warn(
            f"{names[0]}=True in the training arguments would replace the checkpointing "
            "FastModel.get_peft_model set up; turning it off (choose it with use_gradient_checkpointing=)",
            stacklevel=3,
        )
        for name in names:
            setattr(args, name, False)
    if patched:
        check_ddp_settings(args, checkpointing_nested=uses_offloaded_checkpoint(model.modules()))
    if getattr(args, "bf16", False) and not _bf16_available():
        raise ValueError(
            "bf16=True but this machine has no bf16 support; use fp16=True (GPU) or neither (CPU)"
        )


def _bf16_available() -> bool:
    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    return True  # CPU autocast supports bf16 (slowly)


def restore_adapter_dtypes(model, dtypes: dict) -> None:
    """Undo the TRL trainers' cast of a quantized model's trainable adapters to bf16: it
    fails on GPUs without bf16 (T4) and rounds every optimizer update to 8 mantissa bits.
    PEFT keeps the adapters in float32 and autocast computes in the model's dtype.  (The
    DPO trainer's frozen "ref" adapter, added in its constructor, is not trainable and is
    left as TRL made it.)"""
    for name, param in model.named_parameters():
        dtype = dtypes.get(name)
        if dtype is not None and param.dtype != dtype:
            param.data = param.data.to(dtype)


# Options of TRL's older trainers with no counterpart now that do not change what is trained.
_DROPPED_OPTIONS = {
    "dataset_batch_size": "it only set how many samples a tokenization batch holds",
}


class TrainerSetup:
    """Mixin placed before TRL's trainer class: slothkit's steps around its constructor
    (module docstring).  A trainer here sets the class attributes and calls
    ``_modern_keywords`` then ``_build`` from its ``__init__``."""

    _trl_trainer: type  # TRL's trainer class, whose constructor ``_build`` runs
    _config_class: type  # the config it takes (slothkit.trl.configs)
    _method: str  # the key of slothkit.trl.defaults' defaults for it ("sft", "dpo", ...)
    _renames: dict = {}  # trainer keywords that the config reads under another name

    def _modern_keywords(self, model, args, kwargs: dict):
        """(args, kwargs) for TRL's constructor from the older keywords, with slothkit's
        config (slothkit.trl.defaults) where none is given."""
        owner, trl_trainer, config_class = type(self).__name__, self._trl_trainer, self._config_class
        kwargs = dict(kwargs)
        if "tokenizer" in kwargs:
            if kwargs.get("processing_class") is not None:
                raise ValueError(f"{owner}: got both tokenizer= and processing_class=; keep processing_class")
            kwargs["processing_class"] = kwargs.pop("tokenizer")
            say_once(
                f"{owner}(tokenizer=...) is written {owner}(processing_class=...) in TRL 1.x",
                LegacySpellingWarning,
            )
        accepted = set(inspect.signature(trl_trainer.__init__).parameters) - {"self", "args"}
        fields = field_names(config_class) | set(config_class._extra_keywords)
        options = {}
        for name in [name for name in kwargs if name not in accepted]:
            new = self._renames.get(name, name)
            if name in _DROPPED_OPTIONS:
                kwargs.pop(name)
                say_once(
                    f"{owner}({name}=...) is ignored: {_DROPPED_OPTIONS[name]}; TRL 1.x has no such option",
                    LegacySpellingWarning,
                )
            elif new in fields:
                options[new] = kwargs.pop(name)
                say_once(
                    f"{owner}({name}=...) is written {config_class.__name__}({new}=...) in TRL 1.x; passed on there",
                    LegacySpellingWarning,
                )
        unknown = sorted(set(kwargs) - accepted)
        if unknown:
            raise TypeError(
                f"{owner}() got the keyword(s) {unknown}, which neither TRL's {trl_trainer.__name__} nor its "
                f"{config_class.__name__} accepts; check the spelling against both"
            )
        if args is None:
            return default_config(self._method, config_class, model, **options), kwargs
        return convert_arguments(args, config_class, options, owner), kwargs

    def _check_dataset(self, dataset, tokenizer, args, kwargs: dict, name: str) -> None:
        """Raise ValueError on a record the trainer could not use (slothkit.data.validation)."""
        raise NotImplementedError

    def _build(self, model, args, kwargs: dict) -> None:
        """Check the setup and the datasets, run TRL's constructor, then repair the adapters'
        dtype and make ``train()`` explain an out-of-memory error."""
        import datasets

        from slothkit.data.loading import records_as_dataset

        for argument in ("train_dataset", "eval_dataset"):
            if argument in kwargs:
                kwargs[argument] = records_as_dataset(kwargs[argument], argument)
        tokenizer = kwargs.get("processing_class")
        tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # a processor's own tokenizer
        is_model = model is not None and not isinstance(model, str)
        if is_model and tokenizer is not None:
            check_setup(model, tokenizer, args)
        for name, key in (("training", "train_dataset"), ("evaluation", "eval_dataset")):
            # A dict of evaluation datasets, or a torch dataset, is left to TRL.
            dataset = kwargs.get(key)
            if isinstance(dataset, (datasets.Dataset, datasets.IterableDataset)):
                self._check_dataset(dataset, tokenizer, args, kwargs, name)
        dtypes = {n: p.dtype for n, p in model.named_parameters() if p.requires_grad} if is_model else {}
        self._trl_trainer.__init__(self, model=model, args=args, **kwargs)
        self._non_finite_watch = NonFiniteWatch(self)
        if is_model:
            restore_adapter_dtypes(model, dtypes)
            explain_out_of_memory(self, model)

    def training_step(self, model, inputs, *args, **kwargs):
        loss = super().training_step(model, inputs, *args, **kwargs)
        self._non_finite_watch.after_micro_batch(model, inputs, loss)
        return loss

    def log(self, logs, *args, **kwargs):
        super().log(logs, *args, **kwargs)
        self._non_finite_watch.after_log(logs)  # after: the NaN is in the log history too
