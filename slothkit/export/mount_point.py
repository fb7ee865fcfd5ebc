"""Saving into a folder that is a mount point (a Kaggle or Docker volume, a mounted drive).

slothkit.export.atomic writes a save beside its target and renames it into place; a mount
point cannot be renamed over or swapped (the kernel answers EBUSY), so a save there would
fail after all its work.  Instead the save is written into a hidden staging folder inside
the mount point (`.slothkit.partial-XXXX`, the same filesystem) and its entries are moved
into the folder one by one: each file appears whole (rename), but not all at once, and the
old files the save replaces are removed only after every new one is in place.  What stays
(the user's other files, a README.md that slothkit did not write) follows the same rules as
a save anywhere else.
"""

from __future__ import annotations

import os
import pathlib
import shutil

STAGING_PREFIX = ".slothkit.partial-"


def is_mount_point(target: pathlib.Path) -> bool:
    return target.is_dir() and not target.is_symlink() and os.path.ismount(target)


def staged_leftovers(target: pathlib.Path) -> list[pathlib.Path]:
    """Staging folders that interrupted saves left inside a mount point."""
    if not is_mount_point(target):
        return []
    return sorted(p for p in target.iterdir() if p.name.startswith(STAGING_PREFIX) and p.is_dir())


def move_staged_entries(
    staging: pathlib.Path, target: pathlib.Path, remove_old: str, is_saved_file, keep_users_readme
) -> None:
    """Move the staging folder's entries into `target` (which holds `staging`), then remove
    the old entries the save replaces.

    Args:
        staging: the finished save, inside `target`.
        target: the mount point.
        remove_old: "all" (the save replaces the folder), "saved" (only the kinds a save
            writes) or "none" (the save adds files).
        is_saved_file: the name test for "saved".
        keep_users_readme: slothkit.export.atomic's rule for a README.md slothkit did not
            write, applied as (old folder, staging folder).

    Raises:
        IsADirectoryError: the save wrote a file where `target` holds a folder (nothing moved).
    """
    written = {entry.name for entry in staging.iterdir()}
    for name in written:
        old = target / name
        if old.is_dir() and not old.is_symlink() and not (staging / name).is_dir():
            raise IsADirectoryError(
                f"{str(old)!r} is a folder, and this save writes a file of that name; slothkit does not "
                f"replace a folder with a file: rename or move the folder, or save elsewhere (nothing was "
                f"changed)"
            )
    keep_users_readme(target, staging)
    written = {entry.name for entry in staging.iterdir()}
    old_entries = [e for e in target.iterdir() if e != staging and not e.name.startswith(STAGING_PREFIX)]
    for name in sorted(written):
        source, destination = staging / name, target / name
        if destination.is_dir() and not destination.is_symlink():
            shutil.rmtree(destination)  # a folder this save writes again (rename cannot replace it)
        os.replace(source, destination)
    for entry in old_entries:
        if entry.name in written or remove_old == "none":
            continue
        if remove_old == "saved" and not is_saved_file(entry.name):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    staging.rmdir()
