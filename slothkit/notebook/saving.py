"""The save cell's listing of what it wrote (the cell itself calls the save methods)."""

from __future__ import annotations

import os
from pathlib import Path

from slothkit.export.disk_space import megabytes


def list_files(folder: str | os.PathLike, skip: tuple[str, ...] = ("checkpoints",)) -> list[Path]:
    """Print every file under `folder` with its size, one a line, and return their paths.

    Args:
        folder: the notebook's OUTPUT_DIR.
        skip: top-level folders left out (default the trainer's checkpoints).

    Returns:
        The files listed, sorted by path.
    """
    root = Path(folder)
    files = sorted(
        path for path in root.rglob("*") if path.is_file() and path.relative_to(root).parts[0] not in skip
    )
    names = [str(path.relative_to(root)) for path in files]
    width = max(map(len, names), default=0)
    for name, path in zip(names, files):
        print(f"{name:{width}s}  {megabytes(path.stat().st_size):>8s}")
    return files
