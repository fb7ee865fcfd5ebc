"""A fingerprint of the base weights an adapter was trained on, saved beside the adapter.

A LoRA adapter holds only the low-rank updates; adapter_config.json names its base by path
or Hub id.  A folder at that path may later hold other weights of the same shapes (another
fine-tune of the same model, a base re-downloaded at a newer revision, a folder overwritten),
and PEFT then merges or loads the adapter onto them without a word: a model that is neither.

When slothkit saves an adapter (``model.save_pretrained`` of a model from
``FastModel.get_peft_model``, a Trainer's checkpoints included, and
``save_pretrained_merged(..., save_method="lora")``), it writes FINGERPRINT_FILE: for a few
fixed tensors of the base checkpoint (evenly spaced in the sorted list of its names), a
SHA-256 of their first, middle and last rows as float32, read from the base's safetensors
files without loading the rest.  Exporting the adapter or loading it with
``FastModel.from_pretrained`` reads the same rows of the base it is put on and refuses other
values, unless ``allow_other_base=True``.  Floating values are hashed as float32, so a
float16 base re-saved in float32 matches; a base rounded to a narrower dtype does not, and
needs allow_other_base.

Adapters without the file (written by PEFT alone) and bases that are not local safetensors
checkpoints (a Hub id not in the local cache, .bin weights) are not checked.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib

import torch

from slothkit.checkpoint.finite import listing
from slothkit.export.checkpoint_files import SafetensorsCheckpoint
from slothkit.export.merge import base_model_name, local_checkpoint_folder

FINGERPRINT_FILE = "base_fingerprint.json"
_TENSORS = 4  # base tensors fingerprinted


class BaseMismatchError(ValueError):
    """The base an adapter is put on holds other weights than the one it was trained on."""


def base_fingerprint(base: str | os.PathLike) -> dict[str, str] | None:
    """{tensor name: SHA-256 of its fingerprinted rows} of the checkpoint `base` (a folder
    or a cached Hub id), or None where it is no local safetensors checkpoint."""
    folder = local_checkpoint_folder(str(base))
    if folder is None:
        return None
    try:
        checkpoint = SafetensorsCheckpoint(folder)
    except FileNotFoundError:  # .bin weights, or no weights at all: nothing to read cheaply
        return None
    names = sorted(checkpoint.names())
    if not names:
        return None
    chosen = sorted({names[round(i * (len(names) - 1) / (_TENSORS - 1))] for i in range(_TENSORS)})
    return {name: _rows_digest(checkpoint, name) for name in chosen}


def _rows_digest(checkpoint: SafetensorsCheckpoint, name: str) -> str:
    shape = checkpoint.shape_of(name)
    rows = sorted({0, shape[0] // 2, shape[0] - 1}) if shape and shape[0] else []
    values = checkpoint.rows(name, rows)
    if values.is_floating_point():
        values = values.float()
    digest = hashlib.sha256(repr(shape).encode())
    digest.update(values.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def write_base_fingerprint(model, directory: str | os.PathLike) -> None:
    """Write FINGERPRINT_FILE for the base of `model` (a PEFT model) into the adapter folder
    `directory`; where the base cannot be read, remove one an earlier save left there, which
    would describe another base.  Writing it twice for one save is harmless."""
    path = pathlib.Path(directory) / FINGERPRINT_FILE
    name = base_model_name(model)
    tensors = base_fingerprint(name) if name else None
    if tensors is None:
        path.unlink(missing_ok=True)
        return
    record = {
        "written_by": "slothkit: the base weights this adapter was trained on (see slothkit.export.base_fingerprint)",
        "base_model": name,
        "tensors": tensors,
    }
    path.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")


def check_base_fingerprint(
    adapter: str | os.PathLike, base: str | os.PathLike, allow_other_base: bool, advice: str
) -> None:
    """Refuse to put the adapter in folder `adapter` on `base` when the fingerprint the
    adapter recorded does not match it (module docstring).

    Args:
        adapter: the adapter folder.
        base: the base checkpoint it is to be merged into or loaded onto (folder or Hub id).
        allow_other_base: skip the check.
        advice: how the caller's user points at another base or allows this one.

    Raises:
        BaseMismatchError: naming the base, the tensors that differ and ``advice``.
    """
    recorded_file = pathlib.Path(adapter) / FINGERPRINT_FILE
    if allow_other_base or not recorded_file.is_file():
        return
    try:
        recorded = json.loads(recorded_file.read_text(encoding="utf-8"))["tensors"]
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(
            f"{str(recorded_file)!r} is damaged ({error}); delete it to use the adapter without the base check"
        ) from None
    folder = local_checkpoint_folder(str(base))
    if folder is None:
        return
    try:
        checkpoint = SafetensorsCheckpoint(folder)
    except FileNotFoundError:
        return
    differ = [
        name if name in checkpoint else f"{name} (not in it)"
        for name, digest in recorded.items()
        if name not in checkpoint or _rows_digest(checkpoint, name) != digest
    ]
    if differ:
        raise BaseMismatchError(
            f"the adapter {str(adapter)!r} was trained on other base weights than {str(base)!r} holds "
            f"({listing(differ)} differ{'s' if len(differ) == 1 else ''} from the base it recorded); "
            f"the result would be neither model. {advice}"
        )
