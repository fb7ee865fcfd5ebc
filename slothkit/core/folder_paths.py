"""Paths that must be folders: a save target, a cache_dir.

Where a part of such a path exists as a file (``notes.txt/out``, or a cache_dir that is a
file), os.makedirs fails with "[Errno 17] File exists: 'notes.txt'" and open with "Not a
directory", neither saying which part is wrong or what was being made.  These checks name
the file, before any work.
"""

from __future__ import annotations

import os
import pathlib


def check_folder_path(path: str | os.PathLike, what: str) -> None:
    """Refuse a folder path that is a file, or lies under one.

    Args:
        path: the folder to be used or made (it need not exist).
        what: what the folder is, for the message ("the save folder", "cache_dir").

    Raises:
        NotADirectoryError: naming the file in the way.
    """
    full = pathlib.Path(path).expanduser().absolute()
    for part in (full, *full.parents):
        if part.is_dir():  # follows links: a link to a folder is a folder
            return
        if not part.exists():
            continue
        if part == full:
            raise NotADirectoryError(f"{what} {str(full)!r} is a file, not a folder; pass a folder's path")
        raise NotADirectoryError(
            f"{what} {str(full)!r} cannot be made: {str(part)!r} is a file, not a folder; choose a path "
            f"whose folders are folders, or move that file"
        )
