"""Which files in a folder are slothkit's saves, and which are the user's.

SAVED_FILE_PATTERNS names the kinds of file a save writes: an overwrite replaces those and
keeps every other file (slothkit.export.atomic).

A folder that holds slothkit's own earlier save of one method, unchanged, and nothing else
is replaced by a save of the same method without overwrite=True (re-running a notebook's
save cell gives the newer save, as it would anywhere).  It counts as such only when all of
these hold, so that no file of the user's can be in it:

- README.md is slothkit's model card (model_card.CARD_MARKER) and its title names the same
  save_method.  Only the same method: a merged model is not replaced by an adapter or the
  reverse, and a 16-bit merge not by a 4-bit one, whose weights cannot give the 16-bit ones
  back.  Those need overwrite=True.
- Every other entry is a plain file of a kind a save writes, and no GGUF file or Modelfile
  (save_pretrained_gguf adds those beside a merged model; a merged save does not write them
  again, so replacing the folder would drop them).
- Nothing changed after the save.  The card is the last file a save writes, so no other
  file is newer than it; and it is written right after the others, so a card much newer
  than the newest other file (more than CARD_WRITTEN_WITHIN_S) has been edited.  A tokenizer
  saved into the folder afterwards, a hand-edited config or a copy that did not keep the
  times all make the folder the user's.

An adapter saved beside a full model (``model.save_pretrained`` into the folder of a merged
save) makes transformers load the base model named in adapter_config.json with the adapter
instead of the merged weights: full_model_files finds such a folder so that the save is
refused (slothkit.export.methods).
"""

from __future__ import annotations

import fnmatch
import os
import pathlib

from slothkit.export.base_fingerprint import FINGERPRINT_FILE
from slothkit.export.model_card import card_save_method

# The files a slothkit save writes: an overwrite replaces these and keeps everything else.
SAVED_FILE_PATTERNS = (
    "*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json", "*.gguf",
    "Modelfile", "Modelfile.*", "adapter_config.json", "config.json", "generation_config.json",
    "README.md", "README.slothkit.md", "chat_template.jinja", "chat_template.json", "tokenizer.json",
    "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "tokenizer.model",
    "vocab.json", "merges.txt", FINGERPRINT_FILE,
)  # fmt: skip
# Saved kinds that a save_pretrained_merged save does not write itself.
GGUF_FILE_PATTERNS = ("*.gguf", "Modelfile", "Modelfile.*")
# The weights of a full (transformers) checkpoint, as opposed to an adapter's.
FULL_MODEL_WEIGHT_PATTERNS = (
    "model.safetensors", "model-*-of-*.safetensors", "model.safetensors.index.json",
    "pytorch_model.bin", "pytorch_model-*-of-*.bin", "pytorch_model.bin.index.json",
)  # fmt: skip
CARD_WRITTEN_WITHIN_S = 60


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)


def is_saved_file(name: str) -> bool:
    """A file name of the kinds a slothkit save writes (SAVED_FILE_PATTERNS)."""
    return _matches(name, SAVED_FILE_PATTERNS)


def earlier_save_method(folder: pathlib.Path) -> str | None:
    """The save method slothkit's model card in `folder` names; None without one."""
    card = folder / "README.md"
    if not card.is_file() or card.is_symlink():
        return None
    try:
        return card_save_method(card.read_text(encoding="utf-8", errors="replace"))
    except OSError:
        return None


def holds_only_an_earlier_save(
    folder: pathlib.Path, save_method: str, ignoring: pathlib.Path | None = None
) -> bool:
    """True when `folder` holds slothkit's own earlier `save_method` save, unchanged, and
    nothing else (module docstring).

    Args:
        folder: an existing, non-empty folder.
        save_method: the method of the save about to be written ("merged_16bit", ...).
        ignoring: an entry to pass over (a save's own staging folder inside a mount point).
    """
    if earlier_save_method(folder) != save_method:
        return False
    card = folder / "README.md"
    try:
        card_stat = os.lstat(card)
        newest_other = 0
        for entry in folder.iterdir():
            if entry == card or entry == ignoring:
                continue
            if entry.is_symlink() or not entry.is_file():
                return False
            if not is_saved_file(entry.name) or _matches(entry.name, GGUF_FILE_PATTERNS):
                return False
            newest_other = max(newest_other, os.lstat(entry).st_mtime_ns)
    except OSError:  # unreadable, or changed while read: the user's
        return False
    return newest_other <= card_stat.st_mtime_ns <= newest_other + CARD_WRITTEN_WITHIN_S * 10**9


def full_model_files(folder: str | os.PathLike) -> list[str]:
    """The names of a full checkpoint's config and weights in `folder` (a merged save, a
    transformers model); [] where it holds no config.json with such weights."""
    folder = pathlib.Path(folder).expanduser()
    if not (folder / "config.json").is_file():
        return []
    weights = sorted(
        entry.name
        for entry in folder.iterdir()
        if entry.is_file() and _matches(entry.name, FULL_MODEL_WEIGHT_PATTERNS)
    )
    return ["config.json", *weights] if weights else []
