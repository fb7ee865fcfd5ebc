"""Training configs that also take the keywords older notebooks write.

Each class here is the transformers or TRL class of the same name with one change: its
constructor first rewrites keywords that newer releases renamed or removed, saying once
(slothkit.core.notices) how they are written now.  The result is the library's own config, so
everything downstream sees an ordinary ``trl.SFTConfig`` (or ``DPOConfig``, ...).

What is translated, for every config:

    warmup_ratio=r            warmup_steps=r: transformers 5 reads a warmup_steps below 1 as
                              the fraction of the training steps, ceil(r * total steps), with
                              the total known when training starts (max_steps, or the epochs
                              times the batches per epoch), as warmup_ratio did
    evaluation_strategy=s     eval_strategy=s
    no_cuda=b                 use_cpu=b
    push_to_hub_token=t       hub_token=t
    group_by_length=True      train_sampling_strategy="group_by_length"
    overwrite_output_dir=...  dropped: transformers' Trainer never read it
    save_safetensors=True     dropped: transformers 5 always writes safetensors
    logging_dir=d             dropped: TensorBoard reads TENSORBOARD_LOGGING_DIR now

and per config: ``max_seq_length`` -> ``max_length`` (SFTConfig); ``max_prompt_length``
(DPOConfig, ORPOConfig, KTOConfig, GRPOConfig, RLOOConfig) and ``max_completion_length``
(KTOConfig), which TRL 1.16 dropped, are kept as attributes that slothkit.trl's trainers
apply (slothkit.trl.preference and slothkit.trl.online say how); GRPOConfig and RLOOConfig
also take Unsloth's ``use_vllm=True``, ``vllm_sampling_params`` and a batch of less than
a whole group (slothkit.trl.online_configs).
"""

from __future__ import annotations

import dataclasses

import transformers

from slothkit.core.notices import LegacySpellingWarning, say_once
from slothkit.trl.library import trl_class
from slothkit.trl.online_configs import translate_online_keywords

# old keyword -> (new keyword, how the value converts); None: dropped when the value is
# the one the library now always uses.
_RENAMED = {
    "evaluation_strategy": "eval_strategy",
    "no_cuda": "use_cpu",
    "push_to_hub_token": "hub_token",
}
_MIRRORED = ("gradient_checkpointing", "gradient_checkpointing_kwargs")
_DROPPED = {
    "overwrite_output_dir": (None, "transformers' Trainer never read it"),
    "save_safetensors": (True, "transformers 5 always saves safetensors"),
    "logging_dir": (None, "TensorBoard reads the TENSORBOARD_LOGGING_DIR environment variable now"),
}


def translate_training_keywords(kwargs: dict, owner: str, fields: set[str], extras=()) -> dict:
    """Rewrite the keywords of a TrainingArguments-like constructor that transformers 5 and
    TRL 1.x renamed or removed (module docstring), saying once for each how it is written now.

    Args:
        kwargs: the keywords as given; not changed.
        owner: the class name, for the notices and errors ("SFTConfig").
        fields: the keywords the class accepts.
        extras: keywords kept as attributes beside the fields (max_prompt_length).

    Returns:
        The translated keywords.

    Raises:
        ValueError: a value that cannot be translated (the message says what to write).
    """
    kwargs = dict(kwargs)
    if "warmup_ratio" in kwargs:
        ratio = kwargs.pop("warmup_ratio")
        steps = kwargs.get("warmup_steps", 0)
        if not 0 <= ratio < 1:
            raise ValueError(
                f"warmup_ratio={ratio!r}; transformers 5 takes the fraction as warmup_steps in [0, 1) "
                "(a warmup_steps of 1 or more is a number of steps): write warmup_steps=<a number of steps>"
            )
        if steps:
            say_once(
                f"{owner}(warmup_ratio={ratio}, warmup_steps={steps}): warmup_steps wins, as it did when "
                f"both were given; transformers 5 has no warmup_ratio: write warmup_steps={steps} alone",
                LegacySpellingWarning,
            )
        else:
            kwargs["warmup_steps"] = ratio
            say_once(
                f"{owner}(warmup_ratio={ratio}) is written warmup_steps={ratio} in transformers 5: a value "
                "below 1 is the fraction of the training steps, rounded up once the total is known "
                "(max_steps, or num_train_epochs times the batches per epoch)",
                LegacySpellingWarning,
            )
    for old, new in _RENAMED.items():
        if old in kwargs:
            if new in kwargs:
                raise ValueError(
                    f"{owner}: got both {old}= and {new}=; {old} is the old name of {new}: keep {new}"
                )
            kwargs[new] = kwargs.pop(old)
            say_once(f"{owner}({old}=...) is written {new}=... now", LegacySpellingWarning)
    if "group_by_length" in kwargs:
        if kwargs.pop("group_by_length"):
            kwargs["train_sampling_strategy"] = "group_by_length"
        say_once(
            f"{owner}(group_by_length=True) is written train_sampling_strategy='group_by_length' in transformers 5",
            LegacySpellingWarning,
        )
    for old, (kept_value, reason) in _DROPPED.items():
        if old in kwargs:
            value = kwargs.pop(old)
            if kept_value is not None and value != kept_value:
                raise ValueError(
                    f"{owner}({old}={value!r}) is not possible any more: {reason}; leave {old} out"
                )
            say_once(f"{owner}({old}=...) is ignored: {reason}; leave it out", LegacySpellingWarning)
    if "max_seq_length" in kwargs and "max_length" in fields:
        if "max_length" in kwargs:
            raise ValueError(
                f"{owner}: got both max_seq_length= and max_length=; max_seq_length is the old name: keep max_length"
            )
        kwargs["max_length"] = kwargs.pop("max_seq_length")
        say_once(f"{owner}(max_seq_length=...) is written max_length=... in TRL 1.x", LegacySpellingWarning)
    unknown = sorted(set(kwargs) - fields - set(extras))
    if unknown:
        raise TypeError(
            f"{owner}() got the keyword(s) {unknown}, which neither it nor slothkit's translation of older "
            "names accepts; check the spelling against the class's fields"
        )
    return kwargs


def field_names(cls) -> set[str]:
    """The constructor keywords of a dataclass config."""
    return {f.name for f in dataclasses.fields(cls) if f.init}


def _init_translated(self, base, args, kwargs, online: bool = False) -> None:
    """What every config here does: translate, build the library's config, and keep the
    keywords it has no field for (``_extra_keywords``) as attributes.  ``online``: GRPO
    and RLOO, which also take Unsloth's additions (slothkit.trl.online_configs)."""
    extras = type(self)._extra_keywords
    kwargs = translate_training_keywords(kwargs, type(self).__name__, field_names(base), extras)
    if online:
        kwargs = translate_online_keywords(kwargs, type(self).__name__, base)
    defaults = {f.name: f.default for f in dataclasses.fields(base)}
    if defaults.get("bf16", False) is None and "bf16" not in kwargs and not kwargs.get("fp16"):
        # TRL's configs default to bf16=True, which transformers refuses on a CPU or a GPU
        # without bf16: default to it only where it runs.
        from slothkit.checkpoint.before_loading import is_bfloat16_supported

        kwargs["bf16"] = is_bfloat16_supported()
    kept = {name: kwargs.pop(name, None) for name in extras}
    base.__init__(self, *args, **kwargs)
    for name, value in kept.items():
        setattr(self, name, value)


class TrainingArguments(transformers.TrainingArguments):
    """``transformers.TrainingArguments`` that also takes warmup_ratio and the other older
    keywords listed in the module docstring.

    Args:
        *args: passed on (output_dir).
        **kwargs: any ``transformers.TrainingArguments`` keyword, or an older one translated
            as the module docstring says.
    """

    _extra_keywords = ()

    def __init__(self, *args, **kwargs):
        _init_translated(self, transformers.TrainingArguments, args, kwargs)


def _config_class(name: str, doc: str, extra_keywords=(), online: bool = False):
    base = trl_class(name)

    def __init__(self, *args, **kwargs):
        _init_translated(self, base, args, kwargs, online)

    namespace = {
        "__init__": __init__,
        "__doc__": doc,
        "__module__": __name__,
        "_extra_keywords": extra_keywords,
    }
    return type(name, (base,), namespace)


_DOC = """``{base}`` that also takes the older keywords listed in slothkit.trl.configs{extra}.

    Args:
        *args: passed on (output_dir).
        **kwargs: any ``{base}`` keyword, or an older one translated as slothkit.trl.configs
            says.
    """

SFTConfig = _config_class("SFTConfig", _DOC.format(base="trl.SFTConfig", extra=" (max_seq_length too)"))
DPOConfig = _config_class(
    "DPOConfig",
    _DOC.format(base="trl.DPOConfig", extra=" (max_prompt_length too, applied by DPOTrainer)"),
    ("max_prompt_length",),
)
ORPOConfig = _config_class(
    "ORPOConfig",
    _DOC.format(
        base="trl.experimental.orpo.ORPOConfig", extra=" (max_prompt_length too, applied by ORPOTrainer)"
    ),
    ("max_prompt_length",),
)
KTOConfig = _config_class(
    "KTOConfig",
    _DOC.format(
        base="trl.KTOConfig",
        extra=" (max_prompt_length and max_completion_length too, applied by KTOTrainer)",
    ),
    ("max_prompt_length", "max_completion_length"),
)
RLOOConfig = _config_class(
    "RLOOConfig",
    _DOC.format(
        base="trl.RLOOConfig",
        extra=" (max_prompt_length too, checked by RLOOTrainer, and slothkit.trl.online_configs' keywords)",
    ),
    ("max_prompt_length", "vllm_sampling_params"),
    online=True,
)
RewardConfig = _config_class("RewardConfig", _DOC.format(base="trl.RewardConfig", extra=""))
GRPOConfig = _config_class(
    "GRPOConfig",
    _DOC.format(
        base="trl.GRPOConfig",
        extra=" (max_prompt_length too, checked by GRPOTrainer, and slothkit.trl.online_configs' keywords)",
    ),
    ("max_prompt_length", "vllm_sampling_params"),
    online=True,
)


def convert_arguments(args, config_class, overrides: dict, owner: str):
    """The trainer's config built from `args` (any TrainingArguments) and the options given to
    the trainer itself (`overrides`, which win), keeping every value set in `args`.

    Args:
        args: None, a ``transformers.TrainingArguments`` or a TRL config.
        config_class: the config the trainer takes (one of the classes here).
        overrides: config keywords given to the trainer's constructor, in their current names.
        owner: the trainer's name, for the notice.

    Returns:
        An instance of `config_class`.
    """
    target = next(c for c in config_class.__mro__ if c.__module__ != __name__)  # the library's class
    if args is None:
        return config_class(**overrides)
    if isinstance(args, target) and not overrides:
        return args
    if isinstance(args, config_class):  # a subclass (UnslothTrainingArguments) keeps its class
        config_class = type(args)
    if not isinstance(args, target):
        say_once(
            f"{owner}(args={type(args).__name__}(...)) is written {owner}(args={target.__name__}(...)) in "
            "TRL 1.x; slothkit converted it, keeping every value set",
            LegacySpellingWarning,
        )
    # gradient_checkpointing* mirror activation_checkpointing* in transformers 5 (copying
    # both would warn that the old names are deprecated).
    names = field_names(type(args)) & field_names(target) - set(_MIRRORED)
    values = {name: getattr(args, name) for name in names}
    for name in config_class._extra_keywords:
        if getattr(args, name, None) is not None:
            values[name] = getattr(args, name)
    return config_class(**{**values, **overrides})


class UnslothTrainingArguments(SFTConfig):
    """``SFTConfig`` (with the older keywords above) plus ``embedding_learning_rate``: the
    learning rate of the input and output embeddings' trainable parameters (with
    ``modules_to_save=["embed_tokens", "lm_head"]``), applied by UnslothTrainer.

    Args:
        *args: passed on (output_dir).
        embedding_learning_rate: the embeddings' learning rate; None (default): the same
            as learning_rate.
        **kwargs: as SFTConfig.
    """

    _extra_keywords = ("embedding_learning_rate",)
