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

What overwrite replaces: with keep_other_files=True, only the files a save writes
(slothkit.export.saved_files: weights, configs, tokenizer, model card, GGUF files) are replaced;
every other file and folder of the old directory (notes, scripts, checkpoints) is carried
into the new one as a hard link (a copy where links are not possible) before the swap.  A
folder is never replaced by a file: a save that writes a file under the name of a folder
there is refused, before the swap.  Without overwrite, a non-empty folder is refused unless
it holds only slothkit's own earlier save of the same method, unchanged
(slothkit.export.saved_files), which is replaced in the same way.

A target that is a symbolic link is saved into the folder the link points to (the link
stays); a target that is a mount point, which cannot be renamed over, is written as
slothkit.export.mount_point says.

Durability and leftovers: every file and the staging directory are fsync'ed before the
rename, and the parent after it, so a power cut leaves the old or the new directory, not an
empty one.  The staging directory gets the permissions of a directory made with the
process's umask (mkdtemp makes it 0700).  While it is written the staging directory holds an
exclusive flock, which the kernel drops when the process dies (kill -9 included); the next
save to the same target removes staging leftovers whose lock it can take, naming each with
its size, and reports `.NAME.replaced-*` ones (they may hold the only copy of a save).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
import pathlib
import shutil
import sys
import tempfile
import warnings
from collections.abc import Iterator

from slothkit.core.folder_paths import check_folder_path
from slothkit.core.notices import SettingChangedWarning, say_once
from slothkit.export.model_card import CARD_MARKER
from slothkit.export.mount_point import STAGING_PREFIX, is_mount_point, move_staged_entries, staged_leftovers
from slothkit.export.saved_files import earlier_save_method, holds_only_an_earlier_save, is_saved_file

try:
    import fcntl
except ImportError:  # Windows: leftovers are reported, not removed
    fcntl = None


class DirectoryNotEmptyError(FileExistsError):
    """The target directory already holds files and overwrite was not asked for."""


class OverlappingPathsError(ValueError):
    """The output folder is, contains, or lies inside a folder the save reads from."""


def is_non_empty_directory(path: pathlib.Path, ignoring: pathlib.Path | None = None) -> bool:
    return path.is_dir() and any(entry != ignoring for entry in path.iterdir())


def check_target(
    target: str | os.PathLike,
    overwrite: bool,
    ignoring: pathlib.Path | None = None,
    *,
    replacing: str | None = None,
) -> pathlib.Path:
    """Refuse a target that would lose data without overwrite=True; return it as a Path.

    Called before any expensive work (merging a model) so that the refusal comes first.

    Args:
        target: the folder a save writes.
        overwrite: a non-empty folder may be replaced.
        ignoring: a save's own staging folder inside the target (a mount point).
        replacing: the save method of the save; a folder that holds only slothkit's own
            earlier save of that method, unchanged, is replaced without overwrite
            (slothkit.export.saved_files), said once per folder.
    """
    target = pathlib.Path(target).expanduser()
    if target.is_symlink():
        # A link to a folder (a mounted drive's folder linked into the working directory):
        # the save goes where it points and the link stays. Renaming over the link itself
        # would replace it with a folder, or fail ("Not a directory").
        target = target.resolve()
    check_folder_path(target, "the save folder")
    here = pathlib.Path.cwd().resolve()
    if target.resolve() == here or target.resolve() in here.parents:
        # The save builds the folder beside it and renames it into place, which would take
        # the working directory out from under this process (EBUSY, or a deleted cwd).
        raise OverlappingPathsError(
            f"{str(target)!r} is {'the folder' if target.resolve() == here else 'a folder that holds the folder'} "
            f"this process works in ({str(here)!r}); a save replaces its folder whole: save into a "
            f"subfolder, e.g. {str(target / 'model')!r}"
        )
    if is_non_empty_directory(target, ignoring) and not overwrite:
        if replacing is not None and holds_only_an_earlier_save(target, replacing, ignoring):
            say_once(
                f"slothkit: {str(target)!r} held only slothkit's earlier {replacing} save: this save replaces it "
                f"(atomically, once complete); save into another folder to keep both",
                SettingChangedWarning,
            )
            return target
        earlier = earlier_save_method(target)
        if replacing is not None and earlier is not None and earlier != replacing:
            holds = f"holds slothkit's earlier {earlier} save, and this one is {replacing}"
        else:
            holds = "is not empty"
        raise DirectoryNotEmptyError(
            f"{str(target)!r} {holds}; pass overwrite=True to replace its contents "
            f"(the replacement is atomic), or choose a new directory"
        )
    return target


def check_not_an_input(target: str | os.PathLike, inputs: dict[str, str | os.PathLike | None]) -> None:
    """Refuse an output folder that is, contains, or lies inside a folder being read.

    Replacing such a folder would delete the input (an adapter exported onto itself, a merge
    written over its base checkpoint) even before the new files are complete.

    Args:
        target: the output folder.
        inputs: {what it is ("the adapter", "the base model"): its folder}; None values and
            paths that are not existing folders are skipped.

    Raises:
        OverlappingPathsError: naming the input and how the two overlap.
    """
    out = pathlib.Path(target).expanduser().resolve()
    for label, folder in inputs.items():
        if folder is None:
            continue
        folder = pathlib.Path(folder).expanduser()
        if not folder.is_dir():
            continue
        folder = folder.resolve()
        if out == folder:
            how = "is"
        elif folder in out.parents:
            how = "is inside"
        elif out in folder.parents:
            how = "contains"
        else:
            continue
        raise OverlappingPathsError(
            f"the output folder {str(out)!r} {how} {label} {str(folder)!r}, which this export reads; "
            f"writing there could destroy it. Choose an output folder outside {str(folder)!r}"
        )


@contextlib.contextmanager
def atomic_directory(
    target: str | os.PathLike,
    overwrite: bool = False,
    *,
    keep_other_files: bool = False,
    keep_unwritten_files: bool = False,
    replacing: str | None = None,
) -> Iterator[pathlib.Path]:
    """Yield an empty staging directory that becomes `target` when the block completes.

    Args:
        target: the directory to write.
        overwrite: replace a non-empty `target` (refused otherwise).
        keep_other_files: when replacing, carry over the old directory's files and folders
            that do not match SAVED_FILE_PATTERNS and that the block did not write.
        keep_unwritten_files: carry over every file and folder the block did not write,
            saved kinds included: a save that adds files to a folder (GGUF files of
            another quantisation beside earlier ones).
        replacing: the save method written; replaces slothkit's own earlier save of that
            method without overwrite (check_target).
    """
    target = check_target(target, overwrite, replacing=replacing)
    in_mount_point = is_mount_point(target)  # cannot be renamed over: staged inside it
    if not in_mount_point:
        target.parent.mkdir(parents=True, exist_ok=True)
    remove_leftovers(target)
    if in_mount_point:
        prefix, parent = STAGING_PREFIX, target
    else:
        prefix, parent = f".{target.name}.partial-", target.parent
    staging = _make_staging(prefix, parent)
    lock = _lock(staging)
    try:
        yield staging
        # Checked again: another process may have filled the target while we were writing.
        check_target(target, overwrite, ignoring=staging, replacing=replacing)
        os.chmod(staging, 0o777 & ~_umask())
        if in_mount_point:
            _fsync_tree(staging)
            remove_old = "none" if keep_unwritten_files else "saved" if keep_other_files else "all"
            move_staged_entries(staging, target, remove_old, is_saved_file, _keep_users_readme)
            _fsync_directory(target)
            return
        if (keep_other_files or keep_unwritten_files) and target.is_dir():
            _carry_other_files(target, staging, saved_kinds_too=keep_unwritten_files)
        _fsync_tree(staging)
        _move_into_place(staging, target)
        _fsync_directory(target.parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        if lock is not None:
            os.close(lock)


def _make_staging(prefix: str, parent: pathlib.Path) -> pathlib.Path:
    """A new staging folder in `parent`; a read-only filesystem or a folder without write
    permission named as such."""
    try:
        return pathlib.Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    except OSError as error:
        if error.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            reason = "is on a read-only filesystem" if error.errno == errno.EROFS else "is not writable"
            raise type(error)(
                error.errno, f"cannot save there: {str(parent)!r} {reason}; choose a folder you can write to"
            ) from None
        raise


@contextlib.contextmanager
def scratch_directory(prefix: str, parent: str | os.PathLike | None) -> Iterator[pathlib.Path]:
    """A temporary folder ``PARENT/PREFIXxxxx``, locked while in use and removed after.

    Scratch folders of the same prefix that a killed process left in ``parent`` (unlocked)
    are removed first, with a warning naming each and its size, as remove_leftovers does
    for staging folders; one still locked belongs to a save in progress and stays.
    """
    parent = pathlib.Path(parent if parent is not None else tempfile.gettempdir())
    if fcntl is not None and parent.is_dir():
        stale = [
            (entry, _size(entry))
            for entry in sorted(parent.iterdir())
            if entry.name.startswith(prefix)
            and entry.is_dir()
            and not entry.is_symlink()
            and _unlocked(entry)
        ]
        for entry, _ in stale:
            shutil.rmtree(entry, ignore_errors=True)
        if stale:
            warnings.warn(
                "removed what interrupted exports left: "
                + ", ".join(f"{str(entry)!r} ({_megabytes(size)})" for entry, size in stale),
                stacklevel=3,
            )
    folder = pathlib.Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    lock = _lock(folder)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        if lock is not None:
            os.close(lock)


def _keep_users_readme(old: pathlib.Path, staging: pathlib.Path) -> None:
    """A README.md in the old folder that slothkit did not write is the user's: it stays, and
    the new model card goes beside it as README.slothkit.md (said once per save)."""
    readme, card = old / "README.md", staging / "README.md"
    if not (readme.is_file() and card.is_file()) or readme.is_symlink():
        return
    try:
        text = readme.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return
    if CARD_MARKER in text:
        return  # an earlier slothkit card: replaced like every saved file
    os.replace(card, staging / "README.slothkit.md")
    _link_or_copy(readme, card)
    warnings.warn(
        f"kept your {str(readme)!r}; slothkit's model card for this save is README.slothkit.md beside it "
        f"(a Hub push shows README.md: merge the two if the card should be seen there)",
        stacklevel=4,
    )


def _carry_other_files(old: pathlib.Path, staging: pathlib.Path, saved_kinds_too: bool = False) -> None:
    """Carry the old folder's entries that this save did not write into the staging folder.

    Raises:
        IsADirectoryError: the save wrote a file where the old folder holds a folder (a
            user's folder named like a saved file): the folder is not replaced.
    """
    _keep_users_readme(old, staging)
    for entry in old.iterdir():
        destination = staging / entry.name
        if destination.exists() or destination.is_symlink():
            if entry.is_dir() and not entry.is_symlink() and not destination.is_dir():
                raise IsADirectoryError(
                    f"{str(entry)!r} is a folder, and this save writes a file of that name; slothkit does not "
                    f"replace a folder with a file: rename or move the folder, or save elsewhere (nothing was "
                    f"changed)"
                )
            continue  # written by this save: the new file wins
        if entry.is_symlink():
            os.symlink(os.readlink(entry), destination)
        elif entry.is_dir():
            shutil.copytree(entry, destination, symlinks=True, copy_function=_link_or_copy)
        elif saved_kinds_too or not is_saved_file(entry.name):
            _link_or_copy(entry, destination)


def _link_or_copy(source, destination) -> None:
    try:
        os.link(source, destination)
    except OSError:  # another filesystem, or one without hard links
        shutil.copy2(source, destination)


def _umask() -> int:
    mask = os.umask(0o022)  # os.umask only reads by setting; restored at once
    os.umask(mask)
    return mask


def _fsync_tree(root: pathlib.Path) -> None:
    for folder, _, files in os.walk(root):
        for name in files:
            path = os.path.join(folder, name)
            if os.path.islink(path):
                continue
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_directory(pathlib.Path(folder))


def _fsync_directory(folder: pathlib.Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # systems that cannot open a directory (Windows)
        return
    try:
        os.fsync(fd)
    except OSError as error:
        if error.errno not in (errno.EINVAL, errno.EBADF):  # filesystems without directory fsync
            raise
    finally:
        os.close(fd)


def _lock(folder: pathlib.Path) -> int | None:
    """An exclusive flock on `folder`, held until the returned descriptor is closed."""
    if fcntl is None:
        return None
    fd = os.open(folder, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def _size(folder: pathlib.Path) -> int:
    total = 0
    for path in folder.rglob("*"):
        with contextlib.suppress(OSError):
            if path.is_file() and not path.is_symlink():
                total += path.stat().st_size
    return total


def leftovers(target: str | os.PathLike) -> list[pathlib.Path]:
    """Staging (`.NAME.partial-*`) and set-aside (`.NAME.replaced-*`) folders that saves to
    `target` left beside it."""
    target = pathlib.Path(target).expanduser()
    if not target.parent.is_dir():
        return []
    prefixes = (f".{target.name}.partial-", f".{target.name}.replaced-")
    beside = (
        p
        for p in target.parent.iterdir()
        if p.name.startswith(prefixes) and p.is_dir() and not p.is_symlink()
    )
    return sorted([*beside, *staged_leftovers(target)])


def remove_leftovers(target: str | os.PathLike) -> list[tuple[pathlib.Path, int]]:
    """Remove the staging folders that interrupted saves to `target` left beside it, and
    warn naming each with its size.  A staging folder whose lock is still held belongs to a
    save in progress and stays.  A `.NAME.replaced-*` folder may hold the only copy of an
    earlier save (a crash between two renames, module docstring), and without flock
    (Windows) a staging folder cannot be told from a live one: those are reported, not
    removed.

    Args:
        target: the directory a save is about to write.

    Returns:
        (folder, bytes) of each leftover removed.
    """
    removed, kept = [], []
    for folder in leftovers(target):
        size = _size(folder)
        if ".partial-" in folder.name and fcntl is not None and _unlocked(folder):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append((folder, size))
        elif ".replaced-" in folder.name or fcntl is None:
            kept.append((folder, size))
    if removed:
        warnings.warn(
            "removed what interrupted saves left: "
            + ", ".join(f"{str(folder)!r} ({_megabytes(size)})" for folder, size in removed),
            stacklevel=3,
        )
    if kept:
        warnings.warn(
            "interrupted saves left these folders; check them and delete them when done: "
            + ", ".join(f"{str(folder)!r} ({_megabytes(size)})" for folder, size in kept),
            stacklevel=3,
        )
    return removed


def _unlocked(folder: pathlib.Path) -> bool:
    """True when no living process holds the folder's lock (its save died)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # closing drops the lock taken here


def _megabytes(size: int) -> str:
    return f"{size / 1e6:.1f} MB"


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
