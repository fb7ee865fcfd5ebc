"""The save cell's helpers (the cell itself calls the save methods): the listing of what it
wrote, and whether a vision notebook writes GGUF for its model."""

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


def image_text_gguf_wanted(model, save_gguf: bool) -> bool:
    """Whether a vision notebook writes (and pushes) GGUF files: SAVE_GGUF is on and slothkit
    writes the model's image-text family (slothkit.export.gguf.image_text.gguf_refusal).

    For a refused family it prints why (on the process that saves), whatever SAVE_GGUF says:
    the save cell asks once and the publish cell reads its answer, so the reason shows once.

    Args:
        model: the notebook's model (a PeftModel or the image-text model itself).
        save_gguf: the Config cell's SAVE_GGUF.
    """
    from slothkit.core.distributed import is_main_process
    from slothkit.core.inspection import causal_lm_of
    from slothkit.export.gguf.image_text import gguf_refusal

    refusal = gguf_refusal(causal_lm_of(model).config.model_type)
    if refusal is not None and is_main_process():
        asked = " (SAVE_GGUF is on)" if save_gguf else ""
        print(f"GGUF files are not written{asked}: {refusal}")
    return save_gguf and refusal is None
