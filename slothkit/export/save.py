"""save_pretrained_merged: write a fine-tuned model as a folder that plain libraries load.

    save_method      what the folder holds                           loads with
    "merged_16bit"   base + LoRA merged, 16-bit safetensors          transformers
    "merged_4bit"    the same, re-quantised to bitsandbytes 4-bit    transformers + bitsandbytes
    "lora"           the adapter only (adapter_config.json, ...)     peft, on top of the base

Every folder also gets the tokenizer (chat template included), generation_config.json with
the EOS ids generation must stop at, and a README.md model card. The folder appears only once
complete (slothkit.export.atomic); a non-empty one is replaced only with overwrite=True, or
when it holds nothing but slothkit's own earlier save of the same save_method, unchanged
(slothkit.export.saved_files).
"""

from __future__ import annotations

import dataclasses
import errno
import os
import pathlib
import tempfile

import torch
from torch import nn

from slothkit.checkpoint.before_loading import nf4_settings, pick_dtype
from slothkit.checkpoint.finite import finite_tensors
from slothkit.core.folder_paths import check_folder_path
from slothkit.core.inspection import causal_lm_of, is_4bit_model, text_tokenizer, weights_dtype
from slothkit.core.model_state import state_of
from slothkit.export import merge
from slothkit.export.atomic import atomic_directory, check_not_an_input, check_target, scratch_directory
from slothkit.export.base_fingerprint import write_base_fingerprint
from slothkit.export.checkpoint_files import write_sharded
from slothkit.export.disk_space import check_free_space, estimated_save_bytes
from slothkit.export.export_types import SAVE_METHODS
from slothkit.export.generation_config import write_generation_config
from slothkit.export.model_card import CardFacts, lora_facts, render

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SIXTEEN_BIT = (torch.bfloat16, torch.float16)


@dataclasses.dataclass
class SaveResult:
    path: pathlib.Path
    save_method: str
    base_model: str | None
    merge_source: str | None  # "16bit", "dequantized_4bit", "original_checkpoint"; None for "lora"
    merged_into: str | None  # the same, in words (also in the model card)
    files: list[str]
    ties_broken: bool = False  # the merged checkpoint unties input and output embeddings


def check_save_method(save_method: str) -> str:
    if save_method not in SAVE_METHODS:
        if "gguf" in str(save_method).lower():
            hint = " (GGUF files are written by save_pretrained_gguf)"
        elif "mxfp4" in str(save_method).lower():  # Unsloth's gpt-oss notebook offers it
            hint = (
                " (slothkit writes no MXFP4 checkpoint: 'merged_16bit' keeps the merged weights in 16 "
                "bits, 'merged_4bit' quantises them to bitsandbytes' NF4)"
            )
        else:
            hint = ""
        raise ValueError(
            f"save_method={save_method!r} is not one of {', '.join(map(repr, SAVE_METHODS))}{hint}"
        )
    return save_method


def input_folders(model: nn.Module, base_weights=None) -> dict[str, str | None]:
    """The local folders a save of `model` reads or came from, which its output must not
    replace: the base checkpoint (the adapter's base_model_name_or_path and the loaded
    config's _name_or_path) and base_weights when it is a path."""
    config = merge.active_lora_config(model)
    folders = {
        "the adapter's base model": getattr(config, "base_model_name_or_path", None) if config else None,
        "the loaded model's checkpoint": getattr(causal_lm_of(model).config, "_name_or_path", None) or None,
    }
    if base_weights not in (None, "auto"):
        folders["base_weights"] = base_weights
    return folders


def tokenizer_of(model: nn.Module):
    """The tokenizer FastModel loaded with ``model``, or None."""
    state = state_of(model)
    return state.tokenizer if state is not None else None


def resolve_tokenizer(model: nn.Module, tokenizer):
    tokenizer = tokenizer if tokenizer is not None else tokenizer_of(model)
    if tokenizer is None:
        raise ValueError(
            "pass the tokenizer (save_pretrained_merged(save_directory, tokenizer, ...)): the saved folder "
            "must hold one for the model to be usable"
        )
    return tokenizer


def _check_dtype(dtype):
    if dtype is None or dtype in DTYPES:
        return dtype
    return pick_dtype(dtype)  # names such as "bfloat16"; raises naming the accepted ones


def merged_16bit_dtype(model: nn.Module, dtype: torch.dtype | None = None) -> torch.dtype:
    """The dtype a merged_16bit save stores: `dtype` when given, else the model's own 16-bit
    dtype (its weights'), else bfloat16.  A model held in float32 (as on a CPU) has lost the
    dtype it was published in (transformers sets config.dtype to the loaded one), and
    bfloat16 keeps float32's range, so no weight that fits float32 overflows.

    Raises:
        ValueError: `dtype` is not 16-bit.
    """
    if dtype is not None:
        if dtype not in SIXTEEN_BIT:
            raise ValueError(
                f"save_method='merged_16bit' stores 16-bit weights and dtype={dtype} is not 16-bit; "
                "accepted: torch.bfloat16, torch.float16, or None for the model's own 16-bit dtype "
                "(bfloat16 for a model held in float32)"
            )
        return dtype
    own = weights_dtype(model)
    return own if own in SIXTEEN_BIT else torch.bfloat16


@torch.no_grad()
def write_merged_checkpoint(
    model: nn.Module, directory: pathlib.Path, source: merge.MergeSource, max_shard_size, dtype=None
) -> tuple[list[str], merge.MergeReport, torch.dtype]:
    """Merged weights and config.json into `directory`; (files, report, saved dtype)."""
    report = merge.MergeReport(source)
    saved_dtypes: set[torch.dtype] = set()

    def cast(items):
        for name, tensor in items:
            if dtype is not None and tensor.is_floating_point():
                tensor = tensor.to(dtype)
            if tensor.is_floating_point():
                saved_dtypes.add(tensor.dtype)
            yield name, tensor

    merged = finite_tensors(merge.merged_tensors(model, source, report), "the merged checkpoint", dtype)
    files = write_sharded(cast(merged), directory, max_shard_size)
    # The dtype the checkpoint is stored in; mixed only if the base itself was.
    main_dtype = dtype or (saved_dtypes.pop() if len(saved_dtypes) == 1 else weights_dtype(model))
    merge.save_config(model, directory, main_dtype, untie=report.ties_broken)
    return files + ["config.json"], report, main_dtype


def bnb_4bit_config_for(model: nn.Module, compute_dtype: torch.dtype):
    """Quantisation settings for merged_4bit: those the base was loaded with, else NF4 with
    double quantisation (QLoRA's)."""
    from transformers import BitsAndBytesConfig

    settings = nf4_settings(compute_dtype)
    existing = getattr(causal_lm_of(model).config, "quantization_config", None)
    if existing is not None:
        existing = existing.to_dict() if hasattr(existing, "to_dict") else dict(existing)
        if existing.get("load_in_4bit"):
            settings["bnb_4bit_quant_type"] = existing.get("bnb_4bit_quant_type", "nf4")
            settings["bnb_4bit_use_double_quant"] = bool(existing.get("bnb_4bit_use_double_quant", True))
    return BitsAndBytesConfig(**settings)


def _model_device(model: nn.Module) -> torch.device:
    return next(causal_lm_of(model).parameters()).device


def write_requantized_checkpoint(
    model: nn.Module, directory: pathlib.Path, source: merge.MergeSource, max_shard_size, dtype=None
) -> tuple[list[str], merge.MergeReport, object]:
    """Merge into a scratch 16-bit checkpoint, load it back quantised by transformers +
    bitsandbytes (so the result is exactly what their loader produces), save that.

    The scratch copy (the whole 16-bit model) is locked while in use; one a killed save
    left beside the output is removed, naming it, by the next."""
    from transformers import AutoModelForCausalLM

    with scratch_directory(".merged-16bit-", directory.parent) as scratch:
        _, report, saved_dtype = write_merged_checkpoint(model, scratch, source, max_shard_size, dtype)
        quantization = bnb_4bit_config_for(model, saved_dtype)
        device = _model_device(model)
        device_map = {"": device.index or 0} if device.type == "cuda" else None
        quantized = AutoModelForCausalLM.from_pretrained(
            scratch, dtype=saved_dtype, quantization_config=quantization, device_map=device_map
        )
        quantized.save_pretrained(directory, max_shard_size=max_shard_size)
        del quantized
    files = sorted(p.name for p in directory.iterdir())
    return files, report, quantization


def _check_adapter_weights(model: nn.Module) -> None:
    """Refuse an adapter with NaN or Inf weights (slothkit.checkpoint.finite) before PEFT writes it."""
    from peft.utils import get_peft_model_state_dict

    for _ in finite_tensors(get_peft_model_state_dict(model).items(), "the LoRA adapter"):
        pass


def _write_merged_16bit(model, staging, source, max_shard_size, dtype) -> tuple[merge.MergeReport, str]:
    _, report, saved_dtype = write_merged_checkpoint(model, staging, source, max_shard_size, dtype)
    return report, f"{str(saved_dtype).removeprefix('torch.')} safetensors, not quantised"


def _write_merged_4bit(model, staging, source, max_shard_size, dtype) -> tuple[merge.MergeReport, str]:
    _, report, quantization = write_requantized_checkpoint(model, staging, source, max_shard_size, dtype)
    double = ", double quantisation" if quantization.bnb_4bit_use_double_quant else ""
    compute = str(quantization.bnb_4bit_compute_dtype).removeprefix("torch.")
    return (
        report,
        f"bitsandbytes 4-bit {quantization.bnb_4bit_quant_type.upper()}{double}, compute dtype {compute}",
    )


def _write_adapter(model, staging, source, max_shard_size, dtype) -> tuple[None, str]:
    _check_adapter_weights(model)
    model.save_pretrained(str(staging))
    write_base_fingerprint(model, staging)  # also for a model save_pretrained does not write it for
    base = "4-bit (bitsandbytes)" if is_4bit_model(model) else "16-bit"
    return None, f"LoRA adapter weights; the base was {base} during training"


# What writes the weights (and config) of each export type save_pretrained_merged writes
# (slothkit.export.export_types.SAVE_METHODS) into the staging folder: (the merge's report,
# None for no merge; the model card's line on the weights).
FOLDER_WRITERS = {
    "merged_16bit": _write_merged_16bit,
    "merged_4bit": _write_merged_4bit,
    "lora": _write_adapter,
}


def _training_facts(model: nn.Module, training_settings: dict | None) -> dict | None:
    facts = dict(training_settings or {})
    state = state_of(model)
    max_seq_length = state.max_seq_length if state is not None else None
    if max_seq_length is not None:
        facts.setdefault("max_seq_length", max_seq_length)
    if is_4bit_model(model):
        facts.setdefault("base loaded as", "bitsandbytes 4-bit (QLoRA)")
    return facts or None


def save_pretrained_merged(
    model: nn.Module,
    save_directory: str | os.PathLike,
    tokenizer=None,
    save_method: str = "merged_16bit",
    overwrite: bool = False,
    *,
    base_weights: str | os.PathLike | None = "auto",
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype | str | None = None,
    training_settings: dict | None = None,
) -> SaveResult:
    """Save a fine-tuned model as a folder that plain libraries load (module docstring):
    the weights, the tokenizer, generation_config.json and a model card.

    Also a method of the models ``FastModel.get_peft_model`` returns:
    ``model.save_pretrained_merged(save_directory, tokenizer, ...)``.

    Args:
        model: a ``peft.PeftModel`` with LoRA adapters (16-bit or 4-bit base), or a plain
            transformers model (saved as it is, merged_16bit or merged_4bit).
        save_directory: the folder to write; created with its parents.  It appears only
            once complete.
        tokenizer: the tokenizer to save beside the weights; None (default) takes the one
            ``FastModel.from_pretrained`` returned with the model, and is an error for a
            model without one.
        save_method: "merged_16bit" (default: base and LoRA merged, 16-bit
            safetensors), "merged_4bit" (the same, re-quantised to bitsandbytes 4-bit) or
            "lora" (the adapter only).
        overwrite: replace the model files (weights, configs, tokenizer, model card) of a
            non-empty ``save_directory`` atomically, keeping every other file and folder
            in it (default False: such a folder is refused).  A folder that is, contains
            or lies inside the base checkpoint is always refused.  A folder that holds
            only slothkit's own earlier save of the same ``save_method``, unchanged since,
            is replaced without it, atomically (said once).
        base_weights: for merges from a 4-bit model, where the base weights W come from:
            "auto" (default: the original 16-bit checkpoint when the adapter's
            base_model_name_or_path is one on this machine, else the dequantised 4-bit
            weights), None (always the model's own, dequantised, weights) or the path of
            the original 16-bit checkpoint.  The result and the model card say which was
            used.
        max_shard_size: the largest safetensors file, as bytes (int) or a string such as
            "5GB" (default) or "500MiB"; larger checkpoints are sharded with an index.
        dtype: for merged_16bit, the 16-bit dtype to store the merged weights in:
            torch.bfloat16, torch.float16 or a name such as "bf16"; None (default): the
            model's own 16-bit dtype, bfloat16 for a model held in float32
            (``merged_16bit_dtype``).  The merge itself sums in float32 and rounds once.
            For merged_4bit, the compute dtype of the re-quantised model (float32 too);
            None: the base weights' dtype.
        training_settings: a dict recorded in the model card (learning rate, epochs, ...);
            default None.

    Returns:
        A ``SaveResult``: the folder, the save method, the base model's name, where the
        merge took W from (``merge_source``, ``merged_into``), the files written, and
        whether the input and output embeddings had to be untied.

    Raises:
        ValueError: an unknown save_method or dtype (for merged_16bit, one that is not
            16-bit), "lora" for a model without adapters,
            no tokenizer, or base_weights that is not an unquantised checkpoint.
        FileExistsError: ``save_directory`` is not empty, ``overwrite`` is False and it holds
            more than slothkit's earlier save of this ``save_method``.
        NotEnoughSpaceError: the save's estimated size exceeds the free space of its disk
            (an OSError), found before any merging.
        OverlappingPathsError: ``save_directory`` is, contains or lies inside the base
            checkpoint the model was loaded from (a ValueError).
    """
    check_save_method(save_method)
    target = check_target(save_directory, overwrite, replacing=save_method)
    check_not_an_input(target, input_folders(model, base_weights))
    tokenizer = resolve_tokenizer(model, tokenizer)
    dtype = _check_dtype(dtype)
    if save_method == "merged_16bit":
        dtype = merged_16bit_dtype(model, dtype)
    config = merge.active_lora_config(model)
    if save_method == "lora" and config is None:
        raise ValueError(
            "save_method='lora' needs a model with LoRA adapters (a peft.PeftModel); this model has none"
        )
    source = merge.choose_merge_source(model, base_weights) if save_method != "lora" else None
    check_free_space(
        target,
        estimated_save_bytes(model, save_method, dtype or weights_dtype(model)),
        f"the {save_method} save",
    )

    facts = CardFacts(
        save_method=save_method,
        base_model=merge.base_model_name(model),
        lora=lora_facts(config),
        training=_training_facts(model, training_settings),
        chat_template=bool(getattr(tokenizer, "chat_template", None)),
    )
    with atomic_directory(target, overwrite, keep_other_files=True, replacing=save_method) as staging:
        report, facts.weights = FOLDER_WRITERS[save_method](model, staging, source, max_shard_size, dtype)
        if report is not None:
            facts.merged_into = source.describe()
            if report.ties_broken:
                facts.notes.append(
                    "The input and output embeddings are untied in this checkpoint: the adapter "
                    "(or a trained lm_head) changed one of them."
                )
        tokenizer.save_pretrained(str(staging))  # a processor writes its image processor's files too
        text = text_tokenizer(tokenizer)
        eos = write_generation_config(causal_lm_of(model), text, staging)
        facts.eos_tokens = [str(t) for t in text.convert_ids_to_tokens(eos)]
        (staging / "README.md").write_text(render(facts), encoding="utf-8")
        all_files = sorted(str(p.relative_to(staging)) for p in staging.rglob("*") if p.is_file())

    return SaveResult(
        path=target,
        save_method=save_method,
        base_model=facts.base_model,
        merge_source=source.kind if report is not None else None,
        merged_into=facts.merged_into,
        files=all_files,
        ties_broken=bool(report and report.ties_broken),
    )


@torch.no_grad()
def merged_plain_model(
    model: nn.Module, tokenizer=None, *, base_weights="auto", dtype=None, scratch_dir=None
) -> nn.Module:
    """A plain transformers model (no adapters, not quantised) holding the merged weights, for
    writers that take a model rather than a folder (GGUF); an image-text model's whole
    (AutoModelForImageTextToText: vision tower, projector and language model). Built by writing the merged
    checkpoint to a temporary folder and loading it back, as save_pretrained_merged(...,
    "merged_16bit") writes it but in the base weights' own dtype (float32 stays float32, so
    that GGUF types are quantised from unrounded weights and an F32 file is exact); the
    generation config keeps the EOS list of write_generation_config.

    Args:
        model: a ``peft.PeftModel`` with LoRA adapters, or a 4-bit model.
        tokenizer: the tokenizer, for the EOS list of the generation config.
        base_weights: where W comes from, as for ``save_pretrained_merged``.
        dtype: the merged weights' dtype: torch.float32, torch.bfloat16, torch.float16 or
            a name; None (default): the base weights' own.
        scratch_dir: the folder the temporary checkpoint (the full merged model) is written
            under; None (default): the system's temporary folder (TMPDIR).  Callers that
            write an export pass the export's parent folder, so that the space needed is
            on the filesystem the user chose.

    Raises:
        OSError: the scratch folder has no room; the message names it.
    """
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from slothkit.export.generation_config import generation_config_with_eos
    from slothkit.models.image_text import is_image_text_config

    source = merge.choose_merge_source(model, base_weights)
    dtype = _check_dtype(dtype)
    if scratch_dir is not None:
        check_folder_path(scratch_dir, "the folder for the temporary merged checkpoint")
    check_free_space(
        scratch_dir if scratch_dir is not None else tempfile.gettempdir(),
        estimated_save_bytes(model, "merged_16bit", dtype or weights_dtype(model)),
        "the temporary merged checkpoint (the full 16-bit model, written before the GGUF files)",
    )
    if scratch_dir is not None:
        pathlib.Path(scratch_dir).mkdir(parents=True, exist_ok=True)
    # Locked while in use: a later export removes one a killed export left (atomic.py).
    with scratch_directory(".slothkit-merged-", scratch_dir) as scratch:
        try:
            _, _, saved_dtype = write_merged_checkpoint(model, pathlib.Path(scratch), source, "5GB", dtype)
        except OSError as error:
            if error.errno != errno.ENOSPC:
                raise
            raise OSError(
                error.errno,
                f"no space left in {str(pathlib.Path(scratch).parent)!r} for the temporary merged "
                f"checkpoint (the full 16-bit model, written before the GGUF files); free space "
                f"there or write the export to a folder on a larger disk",
            ) from error
        # An image-text model comes back whole (vision tower, projector, language model).
        image_text = is_image_text_config(getattr(causal_lm_of(model), "config", None))
        loader = AutoModelForImageTextToText if image_text else AutoModelForCausalLM
        plain = loader.from_pretrained(scratch, dtype=saved_dtype)
    plain.generation_config = generation_config_with_eos(causal_lm_of(model), text_tokenizer(tokenizer))
    # Loaded from the scratch folder, it would carry that folder's name; GGUF files and
    # their general.name are named after the model (the base's name, as the card says).
    plain.config._name_or_path = merge.base_model_name(model) or ""
    plain.eval()
    return plain
