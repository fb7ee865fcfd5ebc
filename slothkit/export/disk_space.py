"""Will the export fit on its disk? Checked before the work, and said plainly when a disk fills.

Before a save loads or merges anything, its size is estimated and compared with the free
space of the filesystem it goes to (shutil.disk_usage of the nearest folder that exists):

    merged_16bit   parameters x bytes per element of the saved dtype
    merged_4bit    the same (the 16-bit scratch copy bitsandbytes quantises from)
                   + parameters x 0.5
    lora           the adapter's tensors
    GGUF           per file, the bytes of every tensor in its type (exact: the writer's plan);
                   from a checkpoint not yet loaded, parameters x the bytes per weight of
                   the method's smallest type (Q4_K: 144 bytes per 256 weights)

The estimates leave out what is small or may not be written (tokenizer, model card, a head
stored once for two tied embeddings), so they err low: a save is refused only when even
that does not fit, never one that would have fitted.
"""

from __future__ import annotations

import errno
import os
import pathlib
import re
import shutil

import torch
from torch import nn

from slothkit.core.inspection import causal_lm_of, is_4bit_parameter

# numpy's tofile (which GGUFWriter writes tensors with) reports a short write without an errno.
_SHORT_WRITE = re.compile(r"\d+ requested and \d+ written")


class NotEnoughSpaceError(OSError):
    """The export does not fit in the free space of its filesystem (errno ENOSPC)."""

    def __init__(self, message: str):
        super().__init__(errno.ENOSPC, message)

    def __str__(self) -> str:
        return self.strerror  # the message alone, without OSError's "[Errno 28]"


def megabytes(size: float) -> str:
    """Bytes as '295 B', '5 kB', '812 MB' or '3.4 GB' (decimal units, as disk tools show them)."""
    if size >= 1e9:
        return f"{size / 1e9:.1f} GB"
    if size >= 1e6:
        return f"{size / 1e6:.0f} MB"
    return f"{size / 1e3:.0f} kB" if size >= 1e3 else f"{size:.0f} B"


def free_space(path: str | os.PathLike) -> tuple[pathlib.Path, int]:
    """(the nearest existing folder of `path`, the bytes free on its filesystem)."""
    path = pathlib.Path(path).expanduser().absolute()
    folder = next(p for p in (path, *path.parents) if p.is_dir())
    return folder, shutil.disk_usage(folder).free


def check_free_space(path: str | os.PathLike, needed: int, what: str) -> None:
    """Refuse a save whose estimated size exceeds the free space where it goes.

    Args:
        path: where the save writes (need not exist yet).
        needed: the estimated bytes, a lower bound (module docstring).
        what: the save, for the message ("the merged_16bit checkpoint").

    Raises:
        NotEnoughSpaceError: with both figures and the folder.
    """
    folder, free = free_space(path)
    if needed > free:
        raise NotEnoughSpaceError(
            f"not enough space in {str(folder)!r} for {what}: it needs about {megabytes(needed)} and "
            f"{megabytes(free)} are free; free some space or write to a folder on a larger disk",
        )


def is_disk_full(error: BaseException) -> bool:
    """An OSError that means the disk (or the user's quota) is full."""
    if not isinstance(error, OSError):
        return False
    return error.errno in (errno.ENOSPC, errno.EDQUOT) or bool(_SHORT_WRITE.search(str(error)))


def parameter_count(model: nn.Module) -> int:
    """The base model's weights, counted once each: 4-bit weights by their logical shape,
    without LoRA adapters and without modules_to_save copies (the merge writes one)."""
    seen, total = set(), 0
    for name, param in causal_lm_of(model).named_parameters():
        if "lora_" in name or ".modules_to_save." in name or id(param) in seen:
            continue
        seen.add(id(param))
        total += param.quant_state.shape.numel() if is_4bit_parameter(param) else param.numel()
    return total


def estimated_save_bytes(model: nn.Module, save_method: str, dtype: torch.dtype) -> int:
    """A lower bound of what save_pretrained_merged writes (module docstring).

    Args:
        model: the model to save.
        save_method: "merged_16bit", "merged_4bit" or "lora".
        dtype: the dtype the merged weights are stored in.
    """
    if save_method == "lora":
        return sum(
            p.numel() * p.element_size() for n, p in causal_lm_of(model).named_parameters() if "lora_" in n
        )
    merged = parameter_count(model) * torch.empty((), dtype=dtype).element_size()
    if save_method == "merged_4bit":
        merged += parameter_count(model) // 2
    return merged


def checkpoint_parameter_count(folder: str | os.PathLike) -> int:
    """The parameters of a safetensors checkpoint, read from its headers (no tensor loaded)."""
    from safetensors import safe_open

    total = 0
    for file in sorted(pathlib.Path(folder).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                shape = handle.get_slice(name).get_shape()
                total += int(torch.Size(shape).numel())
    return total


def checkpoint_bytes(folder: str | os.PathLike) -> int:
    """The size of a checkpoint's weight files."""
    folder = pathlib.Path(folder)
    return sum(p.stat().st_size for pattern in ("*.safetensors", "*.bin") for p in folder.glob(pattern))
