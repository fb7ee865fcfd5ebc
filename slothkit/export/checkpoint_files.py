"""Reading and writing safetensors checkpoints tensor by tensor.

Merged weights are produced one tensor at a time and written in shards as they come, so a
merge never holds a second full copy of the model in memory; reading the original 16-bit
checkpoint goes through `safe_open`, which maps one tensor at a time from disk.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
from collections.abc import Iterable

import torch

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_SAFETENSORS_DTYPES = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F64": torch.float64,
}


def parse_size(size: int | str) -> int:
    """Bytes from 5_000_000, "5GB", "500MB", "2GiB" (decimal and binary units)."""
    if isinstance(size, int) and not isinstance(size, bool):
        if size <= 0:
            raise ValueError(f"max_shard_size must be positive; got {size}")
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", str(size), flags=re.IGNORECASE)
    if match is None:
        raise ValueError(
            f"max_shard_size={size!r}; expected bytes as an int or a string such as '5GB' or '500MiB'"
        )
    number, unit = float(match.group(1)), (match.group(2) or "B").upper()
    scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}[unit]  # fmt: skip
    return max(1, int(number * scale))


def write_sharded(
    tensors: Iterable[tuple[str, torch.Tensor]], directory: pathlib.Path, max_shard_size
) -> list[str]:
    """Write (name, tensor) pairs as `model.safetensors`, or as numbered shards with
    `model.safetensors.index.json` once they exceed max_shard_size; return the file names.

    Shards are written under provisional names as each fills, and renamed to the
    `model-0000i-of-0000n.safetensors` convention at the end, when n is known.
    """
    from safetensors.torch import save_file

    limit = parse_size(max_shard_size)
    shard: dict[str, torch.Tensor] = {}
    shard_bytes = 0
    provisional: list[tuple[str, list[str]]] = []  # (file name, tensor names)
    total_bytes = 0

    def flush():
        nonlocal shard, shard_bytes
        name = f"shard-{len(provisional):05d}.partial.safetensors"
        save_file(shard, str(directory / name), metadata={"format": "pt"})
        provisional.append((name, list(shard)))
        shard, shard_bytes = {}, 0

    for name, tensor in tensors:
        if name in shard or any(name in names for _, names in provisional):
            raise ValueError(f"tensor {name!r} produced twice while writing the checkpoint")
        size = tensor.numel() * tensor.element_size()
        if shard and shard_bytes + size > limit:
            flush()
        # A fresh, contiguous CPU copy: safetensors refuses tensors that share storage (tied weights).
        shard[name] = tensor.detach().to("cpu", copy=True).contiguous()
        shard_bytes += size
        total_bytes += size
    if shard or not provisional:
        flush()

    if len(provisional) == 1:
        os.replace(directory / provisional[0][0], directory / SINGLE_FILE)
        return [SINGLE_FILE]
    count = len(provisional)
    weight_map, files = {}, []
    for i, (partial, names) in enumerate(provisional, start=1):
        final = f"model-{i:05d}-of-{count:05d}.safetensors"
        os.replace(directory / partial, directory / final)
        files.append(final)
        weight_map.update(dict.fromkeys(names, final))
    index = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    return files + [INDEX_FILE]


class SafetensorsCheckpoint:
    """Tensors of a local safetensors checkpoint folder, read one at a time on demand."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = pathlib.Path(folder)
        index = self.folder / INDEX_FILE
        if index.is_file():
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        elif (self.folder / SINGLE_FILE).is_file():
            weight_map = None
        else:
            raise FileNotFoundError(
                f"{str(self.folder)!r} holds no {SINGLE_FILE} or {INDEX_FILE}; the original weights must "
                f"be a safetensors checkpoint (as saved by transformers' save_pretrained)"
            )
        self._handles: dict[str, object] = {}
        if weight_map is None:
            self._weight_map = dict.fromkeys(self._open(SINGLE_FILE).keys(), SINGLE_FILE)
        else:
            missing = sorted({f for f in weight_map.values() if not (self.folder / f).is_file()})
            if missing:
                raise FileNotFoundError(
                    f"{str(self.folder)!r} is missing shards listed in its index: {missing}"
                )
            self._weight_map = weight_map

    def _open(self, file: str):
        from safetensors import safe_open

        if file not in self._handles:
            self._handles[file] = safe_open(str(self.folder / file), framework="pt", device="cpu")
        return self._handles[file]

    def __contains__(self, name: str) -> bool:
        return name in self._weight_map

    def names(self) -> list[str]:
        return list(self._weight_map)

    def dtype_of(self, name: str) -> torch.dtype:
        """The stored dtype, read from the header without loading the tensor."""
        if name not in self._weight_map:
            raise KeyError(f"tensor {name!r} is not in the checkpoint at {str(self.folder)!r}")
        code = self._open(self._weight_map[name]).get_slice(name).get_dtype()
        return _SAFETENSORS_DTYPES.get(code) or self.get(name).dtype

    def get(self, name: str) -> torch.Tensor:
        if name not in self._weight_map:
            raise KeyError(f"tensor {name!r} is not in the checkpoint at {str(self.folder)!r}")
        return self._open(self._weight_map[name]).get_tensor(name)

    def shape_of(self, name: str) -> list[int]:
        """The stored shape, read from the header."""
        if name not in self._weight_map:
            raise KeyError(f"tensor {name!r} is not in the checkpoint at {str(self.folder)!r}")
        return list(self._open(self._weight_map[name]).get_slice(name).get_shape())

    def rows(self, name: str, indices: list[int]) -> torch.Tensor:
        """Rows `indices` of tensor `name` (along its first dimension), read without
        loading the rest; a scalar, or a tensor without rows, whole."""
        if not self.shape_of(name) or not indices:
            return self.get(name)
        stored = self._open(self._weight_map[name]).get_slice(name)
        return torch.cat([stored[i : i + 1] for i in indices])


def is_unquantized_safetensors_checkpoint(folder: pathlib.Path) -> bool:
    """A folder with config.json (no quantization_config) and safetensors weights."""
    config_file = folder / "config.json"
    if not config_file.is_file():
        return False
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if config.get("quantization_config"):
        return False
    return (folder / INDEX_FILE).is_file() or (folder / SINGLE_FILE).is_file()
