"""TRL on slothkit models: configs with defaults that fit the hardware, and trainer
constructors that check the data first.

    from slothkit.trainers import sft_config, sft_trainer
    trainer = sft_trainer(model, tokenizer, dataset, args=sft_config(model, max_steps=60))
    trainer.train()

How the trainers meet slothkit's fused model (TRL >= 1.16):

* SFT, DPO and GRPO give the model TRL's own fused LM head (``trl.trainer.utils.
  add_fused_lm_head``): the loss, log-probabilities, entropy and accuracy are computed in
  tiles from the last hidden state, so the (batch, seq, vocab) logits are never built.
  The decoder layers still run slothkit's kernels; only the head's cross-entropy is TRL's.
* transformers' Trainer calls the model with labels: slothkit's forward returns its fused
  loss and logits=None.  Older TRL SFTTrainers did the same with ``loss_type="nll"`` (the
  default before TRL 1.x made "chunked_nll" the default) and then read ``outputs.logits``
  for their entropy and token-accuracy metrics, which fails on None: hence the version
  floor below (the lowest version tested with slothkit).
* Gradient accumulation: both paths divide the summed token losses by the number of
  trainable tokens of the whole accumulated batch (``num_items_in_batch``), so 2 x batch 1
  trains like batch 2.

Defaults that differ from TRL's, and why:

* checkpointing off (``activation_checkpointing=False``, ``gradient_checkpointing`` before
  transformers 5): FastModel.get_peft_model already set up checkpointing (offloaded by
  default); the Trainer's would replace it with plain checkpointing.
* ``bf16`` / ``fp16`` follow the model's compute dtype (TRL's default bf16=True fails on a
  T4 and is slow on a CPU); ``optim="adamw_8bit"`` when bitsandbytes and a GPU are there.
* ``max_length`` = the model's ``max_seq_length``; longer samples are truncated to it
  (keeping the start) by TRL, and samples left without a trainable token are dropped.
* The trainer constructors here keep the adapters in the dtype get_peft_model gave them
  (float32): TRL's trainers cast a quantized model's adapters to bf16.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import warnings

import torch

from slothkit.engine.inspection import causal_lm_of, compute_dtype, is_4bit_model
from slothkit.engine.loading import pick_dtype

# 1.15 gave SFT, DPO and GRPO the fused LM head (see the module docstring); 1.16 stopped it
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
LEARNING_RATES = {"sft": 2e-4, "dpo": 5e-6, "grpo": 5e-6}  # LoRA rates; full fine-tuning wants less


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
    """``hardware_defaults(model)`` and ``dataloader_pin_memory``: pinned host memory speeds
    copies to a GPU; without one torch warns that it is unused.

    Args:
        model: as ``hardware_defaults``.

    Returns:
        {"bf16": ..., "fp16": ..., "optim": ..., "dataloader_pin_memory": ...}.
    """
    return {**hardware_defaults(model), "dataloader_pin_memory": torch.cuda.is_available()}


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
    trl = require_trl()
    return trl.SFTConfig(
        **{**_defaults("sft", model), **checkpointing_off(trl.SFTConfig, overrides), **overrides}
    )


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
    trl = require_trl()
    return trl.DPOConfig(
        **{**_defaults("dpo", model), **checkpointing_off(trl.DPOConfig, overrides), **overrides}
    )


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
    trl = require_trl()
    defaults = _defaults("grpo", model)
    defaults.pop("max_length", None)
    return trl.GRPOConfig(**{**defaults, **checkpointing_off(trl.GRPOConfig, overrides), **overrides})


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


def check_setup(model, tokenizer, args) -> None:
    """Catch what would fail (or silently misbehave) deep inside a trainer: a tokenizer
    larger than the model's embeddings, bf16 on a machine without it.  Turns off (with a
    warning) ``args.gradient_checkpointing``, which would replace the checkpointing
    ``FastModel.get_peft_model`` set up.

    Args:
        model: the model to train (a PeftModel or a plain model).
        tokenizer: the tokenizer the data was (or will be) tokenized with.
        args: the trainer's config (``trl.SFTConfig``, ``TrainingArguments``, ...);
            may be changed in place.

    Raises:
        ValueError: the tokenizer has more ids than the embeddings have rows, or
            bf16=True without bf16 support.
    """
    causal_lm = causal_lm_of(model)
    rows = causal_lm.get_input_embeddings().weight.shape[0]
    if len(tokenizer) > rows:
        raise ValueError(
            f"the tokenizer has {len(tokenizer)} ids but the model's embeddings {rows} rows; call "
            "get_chat_template(..., model=model) before FastModel.get_peft_model so that they grow together"
        )
    patched = getattr(causal_lm, "_slothkit_architecture", None) is not None or hasattr(
        model, "_slothkit_tokenizer"
    )
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
    if getattr(args, "bf16", False) and not _bf16_available():
        raise ValueError(
            "bf16=True but this machine has no bf16 support; use fp16=True (GPU) or neither (CPU)"
        )


def _bf16_available() -> bool:
    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    return True  # CPU autocast supports bf16 (slowly)


def sft_trainer(model, tokenizer, train_dataset, args=None, eval_dataset=None, **trainer_kwargs):
    """``trl.SFTTrainer`` after checking the data (slothkit.data.validation) and the setup
    (``check_setup``); the adapters keep their dtype, and an out-of-memory error in
    ``train()`` names the settings to change (``explain_out_of_memory``).

    Args:
        model: the model from ``FastModel.get_peft_model``.
        tokenizer: its tokenizer (TRL's processing_class).
        train_dataset: a ``datasets.Dataset`` with a text column
            (``args.dataset_text_field``), conversations ("messages", or ShareGPT's
            "conversations"), "prompt" and "completion" columns, or "input_ids"
            (already tokenized).
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

    trl = require_trl()
    args = sft_config(model) if args is None else args

    def check(dataset, name):
        check_sft_dataset(dataset, tokenizer, text_field=args.dataset_text_field, name=name)

    return _checked_trainer(
        trl.SFTTrainer, model, tokenizer, args, check, train_dataset, eval_dataset, **trainer_kwargs
    )


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

    trl = require_trl()
    args = dpo_config(model) if args is None else args
    return _checked_trainer(
        trl.DPOTrainer,
        model,
        tokenizer,
        args,
        check_preference_dataset,
        train_dataset,
        eval_dataset,
        **trainer_kwargs,
    )


def grpo_trainer(
    model, tokenizer, reward_funcs, train_dataset, args=None, eval_dataset=None, **trainer_kwargs
):
    """``trl.GRPOTrainer`` after checking the prompts and the setup, as ``sft_trainer``.

    Args:
        model: the model from ``FastModel.get_peft_model``.
        tokenizer: its tokenizer (TRL's processing_class).
        reward_funcs: a reward function, a reward model's name, or a list of them, as
            ``trl.GRPOTrainer`` takes.
        train_dataset: a ``datasets.Dataset`` with a "prompt" column (text or
            conversations).
        args: a ``trl.GRPOConfig``; None (default): ``grpo_config(model)``.
        eval_dataset: an evaluation dataset of the same kind (default None).
        **trainer_kwargs: passed to ``trl.GRPOTrainer``.

    Returns:
        The ``trl.GRPOTrainer``.

    Raises:
        ValueError: the data or the setup would fail in training.
    """
    from slothkit.data.validation import check_prompt_dataset

    trl = require_trl()
    args = grpo_config(model) if args is None else args
    return _checked_trainer(
        trl.GRPOTrainer,
        model,
        tokenizer,
        args,
        check_prompt_dataset,
        train_dataset,
        eval_dataset,
        reward_funcs=reward_funcs,
        **trainer_kwargs,
    )


def _checked_trainer(
    trainer_class, model, tokenizer, args, check_dataset, train_dataset, eval_dataset, **trainer_kwargs
):
    """What every constructor here does around TRL's: check the setup and each dataset
    (check_dataset(dataset, name=...)), build the trainer, give the adapters back the
    dtype TRL changed, and make its train() explain an out-of-memory error."""
    check_setup(model, tokenizer, args)
    for name, dataset in (("training", train_dataset), ("evaluation", eval_dataset)):
        if dataset is not None:
            check_dataset(dataset, name=name)
    adapter_dtypes = {name: p.dtype for name, p in model.named_parameters() if p.requires_grad}
    trainer = trainer_class(
        model=model,
        args=args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        **trainer_kwargs,
    )
    _restore_adapter_dtypes(model, adapter_dtypes)
    return explain_out_of_memory(trainer, model)


def _restore_adapter_dtypes(model, dtypes: dict) -> None:
    """Undo the TRL trainers' cast of a quantized model's trainable adapters to bf16: it
    fails on GPUs without bf16 (T4) and rounds every optimizer update to 8 mantissa bits.
    PEFT keeps the adapters in float32 and autocast computes in the model's dtype.  (The
    DPO trainer's frozen "ref" adapter, added in its constructor, is not trainable and is
    left as TRL made it.)"""
    for name, param in model.named_parameters():
        dtype = dtypes.get(name)
        if dtype is not None and param.dtype != dtype:
            param.data = param.data.to(dtype)


class TrainingOutOfMemoryError(torch.cuda.OutOfMemoryError):
    """CUDA ran out of memory in training; the message says which settings to change.
    A torch.cuda.OutOfMemoryError, so code that catches that still catches this."""


def explain_out_of_memory(trainer, model):
    """Make ``trainer.train()`` turn a CUDA out-of-memory error into one that names the
    settings in use and what to change, with the memory planner's figures for this model
    on this GPU. Patches this trainer instance only.

    Args:
        trainer: a transformers Trainer or TRL trainer.
        model: the model it trains.

    Returns:
        The same trainer, whose ``train()`` raises ``TrainingOutOfMemoryError`` (a
        ``torch.cuda.OutOfMemoryError``) with that advice.
    """
    train = trainer.train

    def train_and_explain(*args, **kwargs):
        try:
            return train(*args, **kwargs)
        except torch.cuda.OutOfMemoryError as error:
            if isinstance(error, TrainingOutOfMemoryError):
                raise
            raise TrainingOutOfMemoryError(out_of_memory_advice(trainer.args, model, error)) from error

    trainer.train = train_and_explain
    return trainer


def out_of_memory_advice(args, model, error) -> str:
    from slothkit.plan import plan, shape_from_config

    causal_lm = causal_lm_of(model)
    batch = getattr(args, "per_device_train_batch_size", None)
    accumulation = getattr(args, "gradient_accumulation_steps", 1)
    seq = getattr(args, "max_length", None) or getattr(causal_lm, "max_seq_length", None) or 2048
    mode = "qlora" if is_4bit_model(causal_lm) else "lora"
    lines = [
        f"CUDA ran out of memory while training ({mode}, per_device_train_batch_size={batch}, "
        f"max_length={seq}, gradient_accumulation_steps={accumulation}).",
    ]
    try:
        suggested = plan(
            shape_from_config(causal_lm.config), gpu="auto", seq=seq, batch=batch or 1, mode=mode
        )
    except Exception:  # an architecture the planner cannot read: the advice stands alone
        suggested = None
    if suggested is not None and suggested.gpu_gib:
        lines.append(
            f"The memory planner predicts {suggested.total_gib:.1f} GiB for batch {suggested.batch} x "
            f"{suggested.seq} tokens on this {suggested.gpu_gib:.0f} GiB GPU "
            f"(slothkit plan; its notes: {'; '.join(suggested.notes) or 'none'})."
        )
    lines.append(
        "To fit: lower per_device_train_batch_size and raise gradient_accumulation_steps by the same "
        "factor (the effective batch stays), or lower max_length; load the model with "
        "load_in_4bit=True; keep use_gradient_checkpointing='offload' in FastModel.get_peft_model; "
        "close other processes on the GPU. The original error: " + str(error).splitlines()[0]
    )
    return "\n".join(lines)
