"""What every trainer constructor here does around TRL's: check the setup and the data
before the trainer is built, and give the adapters back the dtype TRL changed."""

from __future__ import annotations

import warnings

import torch

from slothkit.distributed import check_ddp_settings
from slothkit.engine.inspection import causal_lm_of
from slothkit.engine.offload_checkpoint import uses_offloaded_checkpoint
from slothkit.trainers.out_of_memory import explain_out_of_memory


def check_setup(model, tokenizer, args) -> None:
    """Catch what would fail (or silently misbehave) deep inside a trainer: a tokenizer
    larger than the model's embeddings, bf16 on a machine without it.  Turns off (with a
    warning) ``args.gradient_checkpointing``, which would replace the checkpointing
    ``FastModel.get_peft_model`` set up; under a launcher (WORLD_SIZE > 1) sets an unset
    ``ddp_find_unused_parameters`` to False (slothkit.distributed.check_ddp_settings).

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


def checked_trainer(
    trainer_class, model, tokenizer, args, check_dataset, train_dataset, eval_dataset, **trainer_kwargs
):
    """What every constructor here does around TRL's: check the setup and each dataset
    (check_dataset(dataset, name=...)), build the trainer, give the adapters back the
    dtype TRL changed, and make its train() explain an out-of-memory error.  A list of
    records is taken as a ``datasets.Dataset`` (slothkit.data.loading.records_as_dataset)."""
    from slothkit.data.loading import records_as_dataset

    check_setup(model, tokenizer, args)
    train_dataset = records_as_dataset(train_dataset, "train_dataset")
    eval_dataset = records_as_dataset(eval_dataset, "eval_dataset")
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
    restore_adapter_dtypes(model, adapter_dtypes)
    return explain_out_of_memory(trainer, model)


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
