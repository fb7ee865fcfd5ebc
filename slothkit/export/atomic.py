"""Write a directory so that readers see the old contents or the complete new ones, never half.

    with atomic_directory("out/my-model", overwrite=False) as staging:
        write_everything_into(staging)
    # only now does out/my-model exist (or, with overwrite=True, hold the new files)

Everything is written into a temporary sibling (`.my-model.partial-XXXX`, same parent so the
same filesystem, where `rename` is atomic) and moved into place only when the body of the
`with` finishes. An exception, KeyboardInterrupt included, removes the sibling and leaves the
target as it was.

Replacing a non-empty directory: POSIX `rename` cannot move a directory over a non-empty
one, so on Linux the two are swapped with `renameat2(RENAME_EXCHANGE)` (one atomic step), and
the old contents, now at the sibling's name, are deleted afterwards. Where that call is missing
(other systems, old kernels or filesystems without it) the old directory is first renamed
aside, the new one renamed in, and the old one deleted; only a crash between those two renames
can leave the target missing, with the old files still in the `.NAME.replaced-XXXX` sibling.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import pathlib
import shutil
import sys
import tempfile
from collections.abc import Iterator


class DirectoryNotEmptyError(FileExistsError):
    """The target directory already holds files and overwrite was not asked for."""


def is_non_empty_directory(path: pathlib.Path) -> bool:
    return path.is_dir() and any(path.iterdir())


def check_target(target: str | os.PathLike, overwrite: bool) -> pathlib.Path:
    """Refuse a target that would lose data without overwrite=True; return it as a Path.

    Called before any expensive work (merging a model) so that the refusal comes first.
    """
    target = pathlib.Path(target).expanduser()
    if target.exists() and not target.is_dir():
        raise NotADirectoryError(f"{str(target)!r} exists and is a file; the save target must be a directory")
    if is_non_empty_directory(target) and not overwrite:
        raise DirectoryNotEmptyError(
            f"{str(target)!r} is not empty; pass overwrite=True to replace its contents "
            f"(the replacement is atomic), or choose a new directory"
        )
    return target


@contextlib.contextmanager
def atomic_directory(target: str | os.PathLike, overwrite: bool = False) -> Iterator[pathlib.Path]:
    """Yield an empty staging directory that becomes `target` when the block completes."""
    target = check_target(target, overwrite)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
    try:
        yield staging
        # Checked again: another process may have filled the target while we were writing.
        check_target(target, overwrite)
        _move_into_place(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _move_into_place(staging: pathlib.Path, target: pathlib.Path) -> None:
    if not target.exists():
        os.rename(staging, target)
        return
    if not any(target.iterdir()):
        os.rmdir(target)
        os.rename(staging, target)
        return
    if _exchange(staging, target):
        shutil.rmtree(staging)  # holds the old contents now
        return
    aside = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}.replaced-", dir=target.parent))
    os.rmdir(aside)
    os.rename(target, aside)
    try:
        os.rename(staging, target)
    except BaseException:
        os.rename(aside, target)
        raise
    shutil.rmtree(aside)


_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


def _exchange(a: pathlib.Path, b: pathlib.Path) -> bool:
    """Swap two paths atomically (Linux renameat2); False where the system cannot."""
    if not sys.platform.startswith("linux"):
        return False
    libc = _libc()
    renameat2 = getattr(libc, "renameat2", None) if libc is not None else None
    if renameat2 is None:  # glibc < 2.28, musl
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    renameat2.restype = ctypes.c_int
    result = renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    return result == 0  # EINVAL/ENOSYS (filesystem or kernel without it): fall back


def _libc():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name, use_errno=True) if name else None
    except OSError:
        return None
