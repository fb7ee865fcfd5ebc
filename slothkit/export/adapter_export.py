"""Export a saved LoRA adapter folder (what `slothkit export ADAPTER_DIR` does).

    export_adapter("outputs/checkpoint-500", to="merged_16bit", output="merged")
    export_adapter("outputs/adapter", to="gguf", quant="q4_k_m", push="me/my-model-GGUF")

The base model is the one the adapter names (adapter_config.json's base_model_name_or_path),
loaded unquantised from a local folder or the local Hugging Face cache (never downloaded
here), so merges go into the original 16-bit weights even when the adapter was trained with
QLoRA. The tokenizer comes from the adapter folder when it has one (it carries the chat
template used in training), else from the base. Training settings are read from a
trainer_state.json in the adapter folder when there is one.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import tempfile

from slothkit.checkpoint.before_loading import check_local_checkpoint
from slothkit.export.atomic import check_not_an_input, check_target
from slothkit.export.base_fingerprint import check_base_fingerprint
from slothkit.export.disk_space import check_free_space, checkpoint_bytes, checkpoint_parameter_count
from slothkit.export.export_types import EXPORT_TARGETS
from slothkit.export.hub import PushResult, check_repo_id, push_folder_to_hub
from slothkit.export.merge import find_original_checkpoint
from slothkit.export.save import SaveResult, merged_plain_model, save_pretrained_merged


@dataclasses.dataclass
class ExportResult:
    target: str
    output: pathlib.Path | None  # None when only pushed (the local copy was temporary)
    save: SaveResult | object | None  # SaveResult, or what save_pretrained_gguf returned
    push: PushResult | None = None


ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
BASE_MODEL_HELP = "pass base_model=PATH (`--base-model PATH` on the command line)"
OTHER_BASE_HELP = (
    f"Point at the base it was trained on ({BASE_MODEL_HELP}), or pass allow_other_base=True "
    f"to merge it into this one anyway"
)


def read_adapter_config(adapter_dir: str | os.PathLike) -> dict:
    folder = pathlib.Path(adapter_dir).expanduser()
    config_file = folder / "adapter_config.json"
    if not folder.is_dir():
        raise FileNotFoundError(f"{str(folder)!r} is not a folder; pass the folder of a saved LoRA adapter")
    if not config_file.is_file():
        raise FileNotFoundError(
            f"{str(folder)!r} has no adapter_config.json; pass the folder written by model.save_pretrained() "
            f"(or a Trainer checkpoint-N folder) of a LoRA fine-tune"
        )
    if not any((folder / name).is_file() for name in ADAPTER_WEIGHTS):
        raise FileNotFoundError(
            f"{str(folder)!r} has adapter_config.json but no adapter weights ({' or '.join(ADAPTER_WEIGHTS)}); "
            f"the save that wrote it did not finish, or the weights were moved"
        )
    check_adapter_weights(folder)
    try:
        return json.loads(config_file.read_text(encoding="utf-8"))
    except ValueError as error:
        raise ValueError(f"{str(config_file)!r} is not valid JSON ({error})") from None


def check_adapter_weights(folder: pathlib.Path) -> None:
    """Refuse an adapter_model.safetensors that safetensors cannot read (cut short by a save
    that did not finish, or by a copy), naming the file: safetensors' own error ("invalid
    header length") names none. Reading the header checks that every tensor it lists lies
    within the file; no tensor is read."""
    path = folder / ADAPTER_WEIGHTS[0]
    if not path.is_file():
        return
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as weights:
            weights.keys()
    except Exception as error:  # safetensors' SafetensorError is not importable by a stable name
        raise ValueError(
            f"{str(path)!r} is not a complete safetensors file ({error}); the save that wrote it did not "
            f"finish or the file was cut short in a copy: save the adapter again"
        ) from None


def looks_like_repo_id(name: str) -> bool:
    """Whether a base model's name reads as a Hub id (OWNER/NAME) rather than a path."""
    return not name.startswith(("/", ".", "~")) and name.count("/") <= 1 and "\\" not in name


def resolve_base_model(adapter_config: dict, base_model: str | None = None) -> pathlib.Path:
    """The local folder of the base the adapter was trained on."""
    name = base_model or adapter_config.get("base_model_name_or_path")
    if not name:
        raise ValueError(f"adapter_config.json names no base_model_name_or_path; {BASE_MODEL_HELP}")
    local = pathlib.Path(name).expanduser()
    if local.is_dir() and (local / "config.json").is_file():
        check_local_checkpoint(local)
        return local
    cached = find_original_checkpoint(name)
    if cached is not None:
        return cached
    if local.is_dir():
        raise FileNotFoundError(
            f"the base model folder {name!r} has no config.json, so it is no checkpoint; {BASE_MODEL_HELP}"
        )
    if looks_like_repo_id(name):
        fetch = f"download it first (e.g. `huggingface-cli download {name}`) or "
        where = "is not a local checkpoint folder nor in the local Hugging Face cache"
    else:
        fetch, where = "", "is not a local checkpoint folder (no such folder on this machine)"
    raise FileNotFoundError(f"the adapter's base model {name!r} {where}; {fetch}{BASE_MODEL_HELP}")


def _has_tokenizer(folder: pathlib.Path) -> bool:
    return (folder / "tokenizer_config.json").is_file() and any(
        (folder / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")
    )


def training_settings_from(adapter_dir: pathlib.Path) -> dict | None:
    """A few facts from a Trainer's trainer_state.json, when present."""
    state_file = adapter_dir / "trainer_state.json"
    if not state_file.is_file():
        return None
    try:
        state = json.loads(state_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    facts = {}
    for key, label in (
        ("global_step", "steps"),
        ("epoch", "epochs"),
        ("train_batch_size", "batch size per device"),
    ):
        if state.get(key) is not None:
            facts[label] = round(state[key], 4) if isinstance(state[key], float) else state[key]
    history = state.get("log_history") or []
    learning_rates = [h["learning_rate"] for h in history if "learning_rate" in h]
    losses = [h["loss"] for h in history if "loss" in h]
    if learning_rates:
        facts["peak learning rate"] = max(learning_rates)
    if losses:
        facts["last logged training loss"] = losses[-1]
    return facts or None


def check_writable(output: str | os.PathLike) -> None:
    """Refuse an output whose nearest existing folder cannot be written, before any work."""
    path = pathlib.Path(output).expanduser().absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise PermissionError(f"cannot write the output {str(path)!r}: {str(existing)!r} is not writable")
    if existing == path and not os.access(path.parent, os.W_OK | os.X_OK):
        # The folder is replaced by a rename in its parent.
        raise PermissionError(f"cannot write the output {str(path)!r}: {str(path.parent)!r} is not writable")


def _check_room_for_the_export(adapter: pathlib.Path, base: pathlib.Path, to: str, quant, output) -> None:
    """Refuse an export that cannot fit on its disk, before the model is loaded.

    The sizes come from the files: a merged_16bit export writes two bytes a parameter of the
    base checkpoint; merged_4bit and GGUF exports first write a merged copy in the base's
    stored dtype (as big as its weights) beside the output, remove it, then write their own
    files (slothkit.export.disk_space).
    """
    where = output if output is not None else tempfile.gettempdir()
    base_bytes = checkpoint_bytes(base)
    if to == "lora":
        needed = sum(p.stat().st_size for p in adapter.iterdir() if p.is_file())
    elif to == "merged_16bit":
        needed = 2 * checkpoint_parameter_count(base)
    elif to == "merged_4bit":
        needed = base_bytes + checkpoint_parameter_count(base) // 2
    else:
        from slothkit.export.gguf import quantization_methods
        from slothkit.export.gguf.tensor_types import smallest_bytes_per_weight

        parameters = checkpoint_parameter_count(base)
        methods = quantization_methods(quant if quant is not None else "q8_0")
        gguf_bytes = sum(int(parameters * smallest_bytes_per_weight(m)) for m in methods)
        needed = max(base_bytes, gguf_bytes)
    check_free_space(where, needed, f"the {to} export of {adapter.name}")


def load_adapter_model(adapter_dir: str | os.PathLike, base_model: str | None = None):
    """(peft model, tokenizer) for an adapter folder, on its unquantised base, in eval mode."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # Here, not at the top: slothkit.checkpoint.loaded_weights reads slothkit.checkpoint.finite, and
    # importing that runs this package's __init__, which imports this module.
    from slothkit.checkpoint.loaded_weights import check_loaded_weights

    folder = pathlib.Path(adapter_dir).expanduser()
    base_path = resolve_base_model(read_adapter_config(folder), base_model)
    base, loading_info = AutoModelForCausalLM.from_pretrained(
        base_path, dtype="auto", output_loading_info=True
    )
    check_loaded_weights(base, loading_info, str(base_path))
    model = PeftModel.from_pretrained(base, folder)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(folder if _has_tokenizer(folder) else base_path)
    return model, tokenizer


def export_adapter(
    adapter_dir: str | os.PathLike,
    to: str,
    quant: str | None = None,
    push: str | None = None,
    output: str | os.PathLike | None = None,
    token: str | None = None,
    *,
    base_model: str | None = None,
    overwrite: bool = False,
    endpoint: str | None = None,
    allow_other_base: bool = False,
) -> ExportResult:
    """Load the adapter on its base and export it.

    Every argument, the paths, the repo id and the quantisation names are checked before
    the model is loaded.

    Args:
        adapter_dir: the folder of a saved LoRA adapter (adapter_config.json and weights).
        to: "merged_16bit", "merged_4bit", "lora" or "gguf".
        quant: GGUF quantisation(s), as save_pretrained_gguf's quantization_method takes
            them (e.g. "q4_k_m", "q4_k_m,q8_0", or QuantizationMethod values); only with
            to="gguf".
        push: a Hub repo id to upload the export to (one commit).
        output: where to write; default ADAPTER_DIR-TO beside the adapter, or a temporary
            folder when pushing only.  Never the adapter or base model folder, nor a folder
            inside or around them.
        token: the Hub token for push; None: the logged-in one.
        base_model: override the base named in adapter_config.json.
        overwrite: replace the model files of a non-empty output folder, keeping its other
            files; not needed to replace an earlier export of the same ``to`` (not GGUF)
            that is all the folder holds (slothkit.export.saved_files).
        endpoint: another Hub's URL for push.
        allow_other_base: merge into the base even when its weights are not those the
            adapter recorded it was trained on (slothkit.export.base_fingerprint); default
            False: refused.

    Returns:
        An ``ExportResult``.

    Raises:
        ValueError: an unknown target or quantisation, a bad repo id, an output that
            overlaps the adapter or base folder, a base with other weights than the
            adapter was trained on (BaseMismatchError).
        FileNotFoundError: no adapter (or no weights) in adapter_dir, or no local base.
        FileExistsError: the output is not empty and overwrite is False.
        NotEnoughSpaceError: the export's estimated size exceeds the free space of its
            disk (an OSError).
        PermissionError: the output cannot be written, or the Hub token is unusable.
    """
    # Every cheap check comes before loading and merging the model.
    if to not in EXPORT_TARGETS:
        raise ValueError(f"--to {to!r} is not one of {', '.join(EXPORT_TARGETS)}")
    if quant is not None and to != "gguf":
        raise ValueError(f"--quant applies to --to gguf only; got --to {to} --quant {quant}")
    if to == "gguf":
        from slothkit.export.gguf import quantization_methods

        if quant is not None:
            quantization_methods(quant)  # raises naming the valid names
    if push is not None:
        check_repo_id(push, "--push")
    folder = pathlib.Path(adapter_dir).expanduser()
    config = read_adapter_config(folder)
    base_path = resolve_base_model(config, base_model)
    check_base_fingerprint(folder, base_path, allow_other_base, OTHER_BASE_HELP)
    if output is None and push is None:
        output = folder.with_name(f"{folder.resolve().name}-{to}")
    if output is not None:
        check_target(output, overwrite, replacing=to if to != "gguf" else None)
        check_not_an_input(output, {"the adapter": folder, "the base model": base_path})
        check_writable(output)

    _check_room_for_the_export(folder, base_path, to, quant, output)

    if push is not None:  # check the token before the slow part
        from huggingface_hub import HfApi

        from slothkit.export.hub import resolve_token

        token = resolve_token(token, HfApi(endpoint=endpoint))

    model, tokenizer = load_adapter_model(folder, base_model)
    settings = training_settings_from(folder)
    with tempfile.TemporaryDirectory(prefix="slothkit-export-") as scratch:
        target = (
            pathlib.Path(output)
            if output is not None
            else pathlib.Path(scratch) / f"{folder.resolve().name}-{to}"
        )
        if to == "gguf":
            from slothkit.export.gguf import save_pretrained_gguf

            kwargs = {"quantization_method": quant} if quant is not None else {}
            # The GGUF writer takes a merged model; its temporary checkpoint goes beside the output.
            plain = merged_plain_model(model, tokenizer, scratch_dir=target.expanduser().absolute().parent)
            saved = save_pretrained_gguf(plain, str(target), tokenizer, overwrite=overwrite, **kwargs)
        else:
            saved = save_pretrained_merged(
                model, target, tokenizer, save_method=to, overwrite=overwrite, training_settings=settings
            )
        pushed = None
        if push is not None:
            pushed = push_folder_to_hub(
                target, push, token=token, endpoint=endpoint, replace_model_files=to != "gguf",
                commit_message=f"Upload {to} export of {folder.resolve().name} with slothkit",
            )  # fmt: skip
    return ExportResult(
        target=to, output=pathlib.Path(output) if output is not None else None, save=saved, push=pushed
    )
