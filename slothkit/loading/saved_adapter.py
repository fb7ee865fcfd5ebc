"""Load a saved LoRA adapter folder with FastModel.from_pretrained.

    model.save_pretrained("lora_model"); tokenizer.save_pretrained("lora_model")
    model, tokenizer = FastModel.from_pretrained("lora_model")   # later, or elsewhere

The folder holds adapter_config.json and the adapter's weights (and often the tokenizer),
not a whole model: its adapter_config.json names the base model
(``base_model_name_or_path``).  That base loads through FastModel.from_pretrained with the
same settings, then the adapter onto it as a trainable ``peft.PeftModel``, prepared as
``FastModel.get_peft_model`` prepares a new one, so that training can go on from it or
``FastModel.for_inference`` can generate with it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import warnings

from slothkit.checkpoint.loaded_weights import NewHeadWarning
from slothkit.export.adapter_export import check_adapter_weights, looks_like_repo_id
from slothkit.export.base_fingerprint import check_base_fingerprint
from slothkit.loading.load_model import (
    LoadOptions,
    link_tokenizer,
    load_model,
    load_tokenizer,
    prepare_tokenizer,
)
from slothkit.loading.training_mode import CheckpointingOptions, ready_for_training

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
_POINT_AT_ANOTHER_BASE = "set base_model_name_or_path in {config!r} to the base's folder or Hub id"


def is_adapter_folder(name_or_path) -> bool:
    """Whether `name_or_path` is a local folder holding a PEFT adapter but no model config."""
    path = str(name_or_path)
    return (
        os.path.isdir(path)
        and os.path.isfile(os.path.join(path, "adapter_config.json"))
        and not os.path.isfile(os.path.join(path, "config.json"))
    )


def load_saved_adapter(
    folder: str,
    options: LoadOptions,
    checkpointing: CheckpointingOptions | None = None,
    allow_other_base: bool = False,
):
    """The base model named in `folder`'s adapter_config.json with the adapter on it.

    Args:
        folder: a folder written by ``PeftModel.save_pretrained``.
        options: ``FastModel.from_pretrained``'s options, for the base model.
        checkpointing: as ``FastModel.get_peft_model``; None: its default ("offload").
        allow_other_base: load onto the base even when its weights are not those the
            adapter recorded it was trained on (slothkit.export.base_fingerprint).

    An adapter of a sequence classifier (task_type SEQ_CLS: a reward model) loads the base
    as one, with as many outputs as its saved score head.

    Returns:
        ``(peft_model, tokenizer)``: the tokenizer saved in the folder when there is one
        (set up as from_pretrained sets up the base's), else the base model's.

    Raises:
        FileNotFoundError: adapter_config.json names no base model, or a folder that is
            not there.
        BaseMismatchError: (a ValueError) the base holds other weights than the adapter
            was trained on, and allow_other_base is False.
    """
    from peft import PeftModel

    adapter_config = saved_adapter_config(folder)
    base = checked_adapter_base(folder, allow_other_base)
    if adapter_config.get("task_type") == "SEQ_CLS" and options.num_labels is None:
        options = dataclasses.replace(options, num_labels=_saved_score_outputs(folder))
    with warnings.catch_warnings():
        # The base has no score head, and the adapter brings the one it trained.
        warnings.simplefilter("ignore", NewHeadWarning)
        try:
            model, tokenizer = load_model(base, options)
        except FileNotFoundError as error:  # say whose base it is, and how to point at another
            raise FileNotFoundError(
                f"the adapter {folder!r} names its base model {base!r} (base_model_name_or_path in its "
                f"adapter_config.json), which cannot be loaded: {error}. To use another base, "
                f"{_POINT_AT_ANOTHER_BASE.format(config=os.path.join(folder, 'adapter_config.json'))}"
            ) from None
    if any(os.path.isfile(os.path.join(folder, name)) for name in _TOKENIZER_FILES):
        # The folder's tokenizer carries what training changed (a chat template, new tokens).
        tokenizer = load_tokenizer(folder)
        prepare_tokenizer(tokenizer, options.max_seq_length)
        link_tokenizer(model, tokenizer)
    rows = model.get_input_embeddings().weight.shape[0]
    if len(tokenizer) > rows:  # tokens added in training; the adapter holds their rows
        model.resize_token_embeddings(len(tokenizer))
    peft_model = PeftModel.from_pretrained(model, folder, is_trainable=True)
    return ready_for_training(peft_model, checkpointing or CheckpointingOptions()), tokenizer


def saved_adapter_config(folder: str) -> dict:
    """The folder's adapter_config.json, read."""
    with open(os.path.join(folder, "adapter_config.json")) as handle:
        return json.load(handle)


def checked_adapter_base(folder: str, allow_other_base: bool = False) -> str:
    """The base model the adapter in `folder` names, checked before anything loads: it is
    named, a named folder is there, the adapter's weights are whole, and the base holds the
    weights the adapter recorded it was trained on (unless allow_other_base).

    Raises:
        FileNotFoundError: no base is named, or a named folder is not there.
        BaseMismatchError: (a ValueError) the base holds other weights.
    """
    base = saved_adapter_config(folder).get("base_model_name_or_path")
    if not base:
        raise FileNotFoundError(
            f"{folder!r} holds a LoRA adapter whose adapter_config.json names no base model "
            "(base_model_name_or_path); load the base with FastModel.from_pretrained and the adapter "
            "with peft.PeftModel.from_pretrained(model, folder)"
        )
    _check_base_is_here(folder, base)
    check_adapter_weights(pathlib.Path(folder))  # before the base loads: a cut-short file is named
    check_base_fingerprint(
        folder,
        base,
        allow_other_base,
        f"Set base_model_name_or_path in {os.path.join(folder, 'adapter_config.json')!r} to the base it was "
        "trained on, or pass allow_other_base=True to load it onto this one anyway",
    )
    return base


def _check_base_is_here(folder: str, base: str) -> None:
    """Refuse a base named by path that is not there, as the adapter's base: transformers
    would say only that the model cannot be found (a Hub id is left to it: it may download)."""
    if os.path.isdir(os.path.expanduser(base)) or looks_like_repo_id(base):
        return
    config = os.path.join(folder, "adapter_config.json")
    raise FileNotFoundError(
        f"the adapter {folder!r} names its base model {base!r} (base_model_name_or_path in its "
        f"adapter_config.json), and there is no such folder on this machine; put the base there, or "
        f"{_POINT_AT_ANOTHER_BASE.format(config=config)}"
    )


def _saved_score_outputs(folder: str) -> int:
    """The number of outputs of the score head a SEQ_CLS adapter saved in full
    (modules_to_save): the rows of its weight."""
    from safetensors import safe_open

    path = os.path.join(folder, "adapter_model.safetensors")
    with safe_open(path, framework="pt") as weights:
        for name in weights.keys():
            if name.endswith(("score.weight", "classifier.weight")):
                return weights.get_slice(name).get_shape()[0]
    raise FileNotFoundError(
        f"{folder!r} holds a sequence-classification adapter (task_type SEQ_CLS) without its score head's "
        "weights; pass num_labels= to FastModel.from_pretrained"
    )
