"""slothkit's defaults for TRL's configs, as config factories: ``sft_config(model, ...)``
is an ``SFTConfig`` (slothkit.trl's, so the older keywords are taken too) with the
settings below; the trainers in slothkit.trl build their config with these when given
none.

    from slothkit.trl import SFTTrainer
    from slothkit.trl.defaults import sft_config
    trainer = SFTTrainer(model=model, processing_class=tokenizer, train_dataset=dataset,
                         args=sft_config(model, max_steps=60))

Defaults that differ from TRL's, and why:

* checkpointing off (``activation_checkpointing=False``, ``gradient_checkpointing`` before
  transformers 5): FastModel.get_peft_model already set up checkpointing (offloaded by
  default); the Trainer's would replace it with plain checkpointing.
* ``bf16`` / ``fp16`` follow the model's compute dtype (TRL's default bf16=True fails on a
  T4 and is slow on a CPU); ``optim="adamw_8bit"`` when bitsandbytes and a GPU are there.
* ``max_length`` = the model's ``max_seq_length``; longer samples are truncated to it
  (keeping the start) by TRL, and samples left without a trainable token are dropped.
  GRPO and RLOO have no max_length: max_completion_length bounds what they generate.
* Under torchrun or accelerate launch (WORLD_SIZE > 1), ``ddp_find_unused_parameters=False``:
  the Trainer would search for unused parameters (a PeftModel is not a PreTrainedModel),
  and the search cannot follow slothkit's offloaded checkpointing (slothkit.core.distributed).
* Learning rates for LoRA, per method (LEARNING_RATES): SFT 2e-4, DPO, KTO, GRPO and RLOO
  5e-6, ORPO 8e-6, reward 1e-4.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import torch

from slothkit.checkpoint.before_loading import pick_dtype
from slothkit.core.distributed import ddp_defaults
from slothkit.core.inspection import compute_dtype
from slothkit.core.model_state import state_of
from slothkit.trl import configs

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
    (WORLD_SIZE > 1), ``ddp_find_unused_parameters=False`` (slothkit.core.distributed says why).

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


def default_config(method: str, config_class, model=None, **overrides):
    """`config_class` built with slothkit's defaults for `method` (module docstring); what
    every factory here and every trainer of slothkit.trl given no config calls.

    Args:
        method: a key of LEARNING_RATES ("sft", "dpo", ...).
        config_class: the config to build (slothkit.trl.configs' ``SFTConfig``, ...).
        model: the model to train, whose compute dtype sets bf16/fp16 and whose
            ``max_seq_length`` sets max_length; None or a model name: this machine's best
            dtype, and TRL's max_length.
        **overrides: any field of `config_class`; they win over the defaults.

    Returns:
        The config.
    """
    model = None if isinstance(model, str) else model
    defaults = {**COMMON_DEFAULTS, "learning_rate": LEARNING_RATES[method], **machine_defaults(model)}
    state = state_of(model) if model is not None else None
    max_seq_length = state.max_seq_length if state is not None else None
    # GRPO's and RLOO's configs have no max_length: max_completion_length bounds what they
    # generate, the data their prompts.
    if max_seq_length is not None and "max_length" in configs.field_names(config_class):
        defaults["max_length"] = max_seq_length
    return config_class(**{**defaults, **checkpointing_off(config_class, overrides), **overrides})


def sft_config(model=None, **overrides):
    """``SFTConfig`` with slothkit's defaults (module docstring), learning rate 2e-4.

    Args:
        model: the model to train, whose compute dtype sets bf16/fp16 and whose
            ``max_seq_length`` sets max_length; None (default): this machine's best
            dtype, and TRL's max_length.
        **overrides: any ``SFTConfig`` field; they win over the defaults.

    Returns:
        The ``SFTConfig``.
    """
    return default_config("sft", configs.SFTConfig, model, **overrides)


def dpo_config(model=None, **overrides):
    """``DPOConfig`` with slothkit's defaults: as ``sft_config``, learning rate 5e-6.

    Args:
        model: as ``sft_config``.
        **overrides: any ``DPOConfig`` field (beta, ...); they win over the defaults.

    Returns:
        The ``DPOConfig``.
    """
    return default_config("dpo", configs.DPOConfig, model, **overrides)


def orpo_config(model=None, **overrides):
    """``ORPOConfig`` (TRL's in trl.experimental.orpo) with slothkit's defaults: as
    ``sft_config``, learning rate 8e-6.

    Args:
        model: as ``sft_config``.
        **overrides: any ``ORPOConfig`` field (beta: the odds-ratio term's weight, ...);
            they win over the defaults.

    Returns:
        The ``ORPOConfig``.
    """
    return default_config("orpo", configs.ORPOConfig, model, **overrides)


def kto_config(model=None, **overrides):
    """``KTOConfig`` with slothkit's defaults: as ``sft_config``, learning rate 5e-6.

    Args:
        model: as ``sft_config``.
        **overrides: any ``KTOConfig`` field (beta, desirable_weight, undesirable_weight,
            ...); they win over the defaults.  KTO's KL estimate pairs each completion
            with another prompt of its batch, so per_device_train_batch_size stays above 1.

    Returns:
        The ``KTOConfig``.
    """
    return default_config("kto", configs.KTOConfig, model, **overrides)


def grpo_config(model=None, **overrides):
    """``GRPOConfig`` with slothkit's defaults: as ``sft_config``, learning rate 5e-6, and
    no max_length (the completions are bounded by max_completion_length, the prompts by
    the data).

    Args:
        model: the model to train, whose compute dtype sets bf16/fp16; None (default):
            this machine's best dtype.
        **overrides: any ``GRPOConfig`` field (num_generations, max_completion_length,
            ...); they win over the defaults.

    Returns:
        The ``GRPOConfig``.
    """
    return default_config("grpo", configs.GRPOConfig, model, **overrides)


def rloo_config(model=None, **overrides):
    """``RLOOConfig`` with slothkit's defaults: as ``grpo_config`` (learning rate 5e-6, no
    max_length).

    Args:
        model: as ``grpo_config``.
        **overrides: any ``RLOOConfig`` field (num_generations, max_completion_length,
            beta, ...); they win over the defaults.

    Returns:
        The ``RLOOConfig``.
    """
    return default_config("rloo", configs.RLOOConfig, model, **overrides)


def reward_config(model=None, **overrides):
    """``RewardConfig`` with slothkit's defaults: as ``sft_config``, learning rate 1e-4
    (the score head starts from random).

    Args:
        model: the reward model to train (``FastModel.from_pretrained(...,
            num_labels=1)``), as ``sft_config``.
        **overrides: any ``RewardConfig`` field (center_rewards_coefficient, ...); they
            win over the defaults.

    Returns:
        The ``RewardConfig``.
    """
    return default_config("reward", configs.RewardConfig, model, **overrides)


def training_arguments(model=None, **overrides):
    """``TrainingArguments`` with ``sft_config``'s defaults (without max_length), for the
    plain transformers Trainer.

    Args:
        model: the model to train, whose compute dtype sets bf16/fp16; None (default):
            this machine's best dtype.
        **overrides: any ``TrainingArguments`` field; they win over the defaults.

    Returns:
        The ``TrainingArguments`` (slothkit.trl's, taking the older keywords too).
    """
    return default_config("sft", configs.TrainingArguments, model, **overrides)
