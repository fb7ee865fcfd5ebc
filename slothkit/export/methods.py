"""Bind the export functions onto one model instance as the methods users know.

    attach_export_methods(model)
    model.save_pretrained_merged("out", tokenizer, save_method="merged_16bit")
    model.push_to_hub_merged("me/my-model", tokenizer, save_method="lora", token=...)
    model.save_pretrained_gguf("out-gguf", tokenizer, quantization_method="q4_k_m")
    model.push_to_hub_gguf("me/my-model-GGUF", tokenizer, quantization_method="q4_k_m")

Only the instance gets the attributes (types.MethodType); no class is patched. The methods
are those the export types name (slothkit.export.export_types), each once. The GGUF
methods call `slothkit.export.gguf.save_pretrained_gguf` / `push_to_hub_gguf`, imported when
called (and attached only when that module is installed), with the model merged first
(`merged_plain_model`): the GGUF writer takes a plain 16-bit model.  A PEFT model's
``save_pretrained`` (what Trainer checkpoints call too) is PEFT's, followed by writing the
fingerprint of the base weights beside the adapter (slothkit.export.base_fingerprint); into
a folder that holds a full model (a merged save) it is refused, as adapter files there
would hide the merged weights from transformers.
"""

from __future__ import annotations

import importlib
import importlib.util
import pathlib
import sys
import types

from torch import nn

from slothkit.compat.unsloth_options import gguf_method_keyword, gguf_push_arguments
from slothkit.core.folder_paths import check_folder_path
from slothkit.core.inspection import causal_lm_of, is_4bit_model
from slothkit.export.atomic import DirectoryNotEmptyError
from slothkit.export.base_fingerprint import write_base_fingerprint
from slothkit.export.export_types import EXPORT_TYPES, GGUF_MODULE
from slothkit.export.save import merged_plain_model, resolve_tokenizer
from slothkit.export.saved_files import full_model_files
from slothkit.models.image_text import is_image_text_config


def _gguf_available() -> bool:
    if sys.modules.get(GGUF_MODULE) is not None:
        return True
    try:
        return importlib.util.find_spec(GGUF_MODULE) is not None
    except (ImportError, ValueError):
        return False


def needs_merging(model: nn.Module) -> bool:
    """A LoRA (PEFT) model, or one with 4-bit weights: GGUF writers take a plain 16-bit model."""
    return hasattr(model, "peft_config") or is_4bit_model(model)


def _gguf_save_directory(name: str, args: tuple, kwargs: dict) -> pathlib.Path | None:
    """The output folder of a save_pretrained_gguf call; None for a push."""
    if name != "save_pretrained_gguf":
        return None
    directory = args[0] if args else kwargs.get("save_directory")
    return None if directory is None else pathlib.Path(directory).expanduser().absolute()


def _gguf_method(name: str):
    def method(model, *args, **kwargs):
        kwargs = gguf_method_keyword(kwargs)
        if name == "push_to_hub_gguf":
            args, kwargs = gguf_push_arguments(args, kwargs)
        module = importlib.import_module(GGUF_MODULE)
        function = getattr(module, name, None)
        if function is None:
            raise AttributeError(f"{GGUF_MODULE} has no {name}(); this slothkit build cannot export GGUF")
        directory = _gguf_save_directory(name, args, kwargs)
        if directory is not None:  # before the merge, which writes beside it
            check_folder_path(directory, "the save folder")
        # The tokenizer may be left out (Unsloth's FastModel spelling): the model's own.
        if len(args) < 2 and kwargs.get("tokenizer") is None:
            kwargs["tokenizer"] = resolve_tokenizer(model, None)
        tokenizer = args[1] if len(args) > 1 else kwargs["tokenizer"]
        config = getattr(causal_lm_of(model), "config", None)
        if is_image_text_config(config):  # a refused family is refused before the merge
            from slothkit.export.gguf.mmproj import check_projector_family

            check_projector_family(config)
        if needs_merging(model):
            # The temporary merged checkpoint goes beside the GGUF output folder (on the disk
            # the user chose for it), or in the system's temporary folder for a push.
            scratch_dir = directory.parent if directory is not None else None
            model = merged_plain_model(model, tokenizer, scratch_dir=scratch_dir)
        return function(model, *args, **kwargs)

    method.__name__ = name
    method.__doc__ = f"Merges a LoRA/4-bit model first, then calls {GGUF_MODULE}.{name}(model, ...)."
    return method


def export_functions() -> dict:
    """The save and push function of every export type (export_types), by name, each once:
    GGUF's through ``_gguf_method`` and only where that module is installed."""
    functions = {}
    for export in EXPORT_TYPES.values():
        for name in (export.save, export.push):
            if name in functions:
                continue
            if export.module != GGUF_MODULE:
                functions[name] = export.function(name)
            elif _gguf_available():
                functions[name] = _gguf_method(name)
    return functions


def attach_export_methods(model: nn.Module) -> nn.Module:
    """Give `model` (a peft.PeftModel or a transformers model) save_pretrained_merged and
    push_to_hub_merged methods (and the GGUF ones where available); returns the model."""
    methods = export_functions()
    if hasattr(model, "peft_config"):
        methods["save_pretrained"] = _save_pretrained_recording_the_base(type(model).save_pretrained)
    for name, function in methods.items():
        setattr(model, name, types.MethodType(function, model))
    return model


def _save_pretrained_recording_the_base(save_pretrained):
    """PEFT's save_pretrained (what Trainer checkpoints call too), then the fingerprint of
    the base weights beside the adapter (slothkit.export.base_fingerprint).  A folder that
    holds a full model (a merged save) is refused first: check_no_full_model."""

    def method(model, save_directory, *args, **kwargs):
        check_folder_path(save_directory, "the save folder")
        check_no_full_model(save_directory)
        result = save_pretrained(model, save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", True):  # under DDP, the process that wrote the adapter
            write_base_fingerprint(model, save_directory)
        return result

    method.__name__ = "save_pretrained"
    method.__doc__ = save_pretrained.__doc__
    return method


def check_no_full_model(save_directory) -> None:
    """Refuse to write an adapter into a folder that holds a full model.

    transformers loads a folder with adapter_config.json as the base model named there plus
    the adapter, so an adapter beside merged weights would hide them; PEFT would write it
    there without a word.

    Raises:
        DirectoryNotEmptyError: naming the model's files and the two ways on.
    """
    found = full_model_files(save_directory)
    if not found:
        return
    folder = str(save_directory)
    shown = ", ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
    raise DirectoryNotEmptyError(
        f"{folder!r} holds a full model ({shown}); an adapter saved beside it would make transformers "
        f"load the base model with the adapter instead of these weights. Save the adapter into another "
        f"folder, e.g. model.save_pretrained({pathlib.Path(folder).name + '_lora'!r}), or replace the model "
        f"with the adapter: model.save_pretrained_merged({folder!r}, tokenizer, save_method='lora', "
        f"overwrite=True)"
    )
