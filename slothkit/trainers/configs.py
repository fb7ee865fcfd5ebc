"""TRL configs with slothkit's defaults: precision and optimizer from the hardware and
the model, a LoRA learning rate per method, the Trainer's own checkpointing off."""

from __future__ import annotations

import dataclasses
import importlib.util
import warnings

import torch

from slothkit.distributed import ddp_defaults
from slothkit.engine.inspection import causal_lm_of, compute_dtype
from slothkit.engine.loading import pick_dtype

# 1.15 gave SFT, DPO and GRPO the fused LM head (slothkit.trainers' docstring); 1.16 stopped it
# launching its Triton kernel on CPU tensors.
MIN_TRL_VERSION = "1.16"

COMMON_DEFAULTS = dict(
    output_dir="outputs",
    per_device_train_batch_size=2,
    gradient_accumulation_steps=4,
    warmup_steps=5,
    lr_scheduler_type="linear",
    weight_decay=0.01,
    logging_steps=1,
    seed=3407,
    report_to="none",
)
# LoRA rates; full fine-tuning wants less.  The preference and RL methods move the policy
# a little away from a reference (its own adapters off), so they take small steps; ORPO
# has no reference and an SFT term, and steps a little larger; a reward model's score
# head starts from random (1e-4 is also TRL's RewardConfig default).
LEARNING_RATES = {
    "sft": 2e-4,
    "dpo": 5e-6,
    "orpo": 8e-6,
    "kto": 5e-6,
    "grpo": 5e-6,
    "rloo": 5e-6,
    "reward": 1e-4,
}
# The methods whose config has no max_length: the completions are bounded by
# max_completion_length, the prompts by the data.
_GENERATING = ("grpo", "rloo")


def require_trl():
    """Import trl, checking that it is recent enough for slothkit's fused model.

    Returns:
        The ``trl`` module.

    Raises:
        ImportError: TRL is missing or older than MIN_TRL_VERSION; the message says why
            the version matters and how to upgrade.
    """
    if importlib.util.find_spec("trl") is None:
        raise ImportError(
            f"slothkit's trainers need TRL >= {MIN_TRL_VERSION}: pip install 'trl>={MIN_TRL_VERSION}'"
        )
    import trl
    from packaging.version import Version

    if Version(trl.__version__) < Version(MIN_TRL_VERSION):
        raise ImportError(
            f"TRL {trl.__version__} is too old for slothkit (need >= {MIN_TRL_VERSION}): before 1.15 its "
            "SFTTrainer with loss_type='nll' reads outputs.logits, which slothkit's fused training forward "
            "never builds, and DPO and GRPO build the full logits; 1.15 runs its fused head's Triton kernel "
            f"on CPU tensors. pip install -U 'trl>={MIN_TRL_VERSION}'"
        )
    return trl


def hardware_defaults(model=None) -> dict:
    """The precision and optimizer settings for this machine and model.

    Args:
        model: the model to train; None (default): judged by the machine alone (bf16
            where the GPU has it, fp16 on older GPUs, fp32 on the CPU).

    Returns:
        {"bf16": ..., "fp16": ...} following the model's compute dtype, and "optim":
        "adamw_8bit" on a GPU with bitsandbytes installed, else "adamw_torch".
    """
    on_gpu = torch.cuda.is_available()
    dtype = compute_dtype(model) if model is not None else pick_dtype(None)
    eight_bit = on_gpu and importlib.util.find_spec("bitsandbytes") is not None
    return {
        "bf16": dtype == torch.bfloat16,
        "fp16": dtype == torch.float16,
        "optim": "adamw_8bit" if eight_bit else "adamw_torch",
    }


def machine_defaults(model=None) -> dict:
    """``hardware_defaults(model)``, ``dataloader_pin_memory`` (pinned host memory speeds
    copies to a GPU; without one torch warns that it is unused) and, under a launcher
    (WORLD_SIZE > 1), ``ddp_find_unused_parameters=False`` (slothkit.distributed says why).

    Args:
        model: as ``hardware_defaults``.

    Returns:
        {"bf16": ..., "fp16": ..., "optim": ..., "dataloader_pin_memory": ...}, with
        "ddp_find_unused_parameters" under a launcher.
    """
    return {
        **hardware_defaults(model),
        "dataloader_pin_memory": torch.cuda.is_available(),
        **ddp_defaults(),
    }


def checkpointing_off(config_class, overrides: dict | None = None) -> dict:
    """Turn the Trainer's own checkpointing off (FastModel.get_peft_model set up slothkit's),
    under the name this transformers reads: from 5.x ``activation_checkpointing``, with
    ``gradient_checkpointing`` a deprecated alias that warns whenever it is set, as TRL's
    configs set it by default.

    Args:
        config_class: the config the keyword is for (``trl.SFTConfig``, ``TrainingArguments``).
        overrides: the keywords the user gave; a choice under either name is kept (then
            nothing is returned).

    Returns:
        ``{"activation_checkpointing": False}`` or ``{"gradient_checkpointing": False}``,
        or {} when the user chose.
    """
    overrides = overrides or {}
    if "gradient_checkpointing" in overrides or "activation_checkpointing" in overrides:
        return {}
    fields = {field.name for field in dataclasses.fields(config_class)}
    name = "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"
    return {name: False}


def _defaults(kind: str, model) -> dict:
    defaults = {**COMMON_DEFAULTS, "learning_rate": LEARNING_RATES[kind], **machine_defaults(model)}
    max_seq_length = getattr(causal_lm_of(model), "max_seq_length", None) if model is not None else None
    if max_seq_length is not None:
        defaults["max_length"] = max_seq_length
    return defaults


# TRL 1.16 keeps ORPO in trl.experimental.orpo; every other trainer here is at top level.
_EXPERIMENTAL = {"ORPOConfig": "orpo", "ORPOTrainer": "orpo"}


def trl_class(name: str):
    """TRL's class `name` ("SFTConfig", "ORPOTrainer", ...), wherever this TRL keeps it.

    Args:
        name: the class name.

    Returns:
        The class.
    """
    trl = require_trl()
    if name not in _EXPERIMENTAL:
        return getattr(trl, name)
    import importlib

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TRL's notice that trl.experimental may change
        module = importlib.import_module(f"trl.experimental.{_EXPERIMENTAL[name]}")
    return getattr(module, name)


def _config(kind: str, config_name: str, model, overrides: dict):
    config_class = trl_class(config_name)
    defaults = _defaults(kind, model)
    if kind in _GENERATING:
        defaults.pop("max_length", None)
    return config_class(**{**defaults, **checkpointing_off(config_class, overrides), **overrides})


def sft_config(model=None, **overrides):
    """``trl.SFTConfig`` with slothkit's defaults (module docstring): COMMON_DEFAULTS,
    learning rate 2e-4, and ``hardware_defaults(model)``.

    Args:
        model: the model to train, whose compute dtype sets bf16/fp16 and whose
            ``max_seq_length`` sets max_length; None (default): this machine's best
            dtype, and TRL's max_length.
        **overrides: any ``trl.SFTConfig`` field; they win over the defaults.

    Returns:
        The ``trl.SFTConfig``.
    """
    return _config("sft", "SFTConfig", model, overrides)


def dpo_config(model=None, **overrides):
    """``trl.DPOConfig`` with slothkit's defaults: as ``sft_config``, learning rate 5e-6.

    Args:
        model: the model to train, whose compute dtype sets bf16/fp16 and whose
            ``max_seq_length`` sets max_length; None (default): this machine's best
            dtype, and TRL's max_length.
        **overrides: any ``trl.DPOConfig`` field (beta, ...); they win over the defaults.

    Returns:
        The ``trl.DPOConfig``.
    """
    return _config("dpo", "DPOConfig", model, overrides)


def orpo_config(model=None, **overrides):
    """``trl.experimental.orpo.ORPOConfig`` with slothkit's defaults: as ``sft_config``,
    learning rate 8e-6.

    Args:
        model: the model to train, whose compute dtype sets bf16/fp16 and whose
            ``max_seq_length`` sets max_length; None (default): this machine's best
            dtype, and TRL's max_length.
        **overrides: any ``ORPOConfig`` field (beta: the odds-ratio term's weight,
            ...); they win over the defaults.

    Returns:
        The ``ORPOConfig``.
    """
    return _config("orpo", "ORPOConfig", model, overrides)


def kto_config(model=None, **overrides):
    """``trl.KTOConfig`` with slothkit's defaults: as ``sft_config``, learning rate 5e-6.

    Args:
        model: the model to train, whose compute dtype sets bf16/fp16 and whose
            ``max_seq_length`` sets max_length; None (default): this machine's best
            dtype, and TRL's max_length.
        **overrides: any ``trl.KTOConfig`` field (beta, desirable_weight,
            undesirable_weight, ...); they win over the defaults.  KTO's KL estimate
            pairs each completion with another prompt of its batch, so
            per_device_train_batch_size stays above 1.

    Returns:
        The ``trl.KTOConfig``.
    """
    return _config("kto", "KTOConfig", model, overrides)


def grpo_config(model=None, **overrides):
    """``trl.GRPOConfig`` with slothkit's defaults: as ``sft_config``, learning rate 5e-6,
    and no max_length (the completions are bounded by max_completion_length, the prompts
    by the data).

    Args:
        model: the model to train, whose compute dtype sets bf16/fp16; None (default):
            this machine's best dtype.
        **overrides: any ``trl.GRPOConfig`` field (num_generations,
            max_completion_length, ...); they win over the defaults.

    Returns:
        The ``trl.GRPOConfig``.
    """
    return _config("grpo", "GRPOConfig", model, overrides)


def rloo_config(model=None, **overrides):
    """``trl.RLOOConfig`` with slothkit's defaults: as ``grpo_config`` (learning rate
    5e-6, no max_length).

    Args:
        model: the model to train, whose compute dtype sets bf16/fp16; None (default):
            this machine's best dtype.
        **overrides: any ``trl.RLOOConfig`` field (num_generations,
            max_completion_length, beta, ...); they win over the defaults.

    Returns:
        The ``trl.RLOOConfig``.
    """
    return _config("rloo", "RLOOConfig", model, overrides)


def reward_config(model=None, **overrides):
    """``trl.RewardConfig`` with slothkit's defaults: as ``sft_config``, learning rate
    1e-4 (the score head starts from random).

    Args:
        model: the reward model to train (``FastModel.from_pretrained(...,
            num_labels=1)``), whose compute dtype sets bf16/fp16 and whose
            ``max_seq_length`` sets max_length; None (default): this machine's best
            dtype, and TRL's max_length.
        **overrides: any ``trl.RewardConfig`` field (center_rewards_coefficient, ...);
            they win over the defaults.

    Returns:
        The ``trl.RewardConfig``.
    """
    return _config("reward", "RewardConfig", model, overrides)


def training_arguments(model=None, **overrides):
    """``transformers.TrainingArguments`` with ``sft_config``'s defaults (without
    max_length), for the plain transformers Trainer.

    Args:
        model: the model to train, whose compute dtype sets bf16/fp16; None (default):
            this machine's best dtype.
        **overrides: any ``TrainingArguments`` field; they win over the defaults.

    Returns:
        The ``transformers.TrainingArguments``.
    """
    from transformers import TrainingArguments

    defaults = _defaults("sft", model)
    defaults.pop("max_length", None)
    return TrainingArguments(**{**defaults, **checkpointing_off(TrainingArguments, overrides), **overrides})
