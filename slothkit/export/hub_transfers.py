"""Which protocol a push uploads large files with: the Hub's LFS API, where the push's
timeouts and stall deadline hold, unless the caller opts into Xet (``use_xet=True``).

huggingface_hub uploads large files through Xet whenever the hf_xet package is installed
(huggingface_hub depends on it) and HF_HUB_DISABLE_XET is unset.  The client alone decides,
at each upload, through ``huggingface_hub.utils._runtime.is_xet_available()``, which reads
``constants.HF_HUB_DISABLE_XET``: ``HfApi.upload_folder`` then hands the folder to
``_upload_pipeline.pipelined_upload`` and ``_commit_api._upload_files`` to
``_upload_xet_files``; no answer of the Hub chooses LFS instead.  hf_xet fetches its write
token and moves the bytes through its own HTTP client (Rust), which slothkit's transport
(hub_client) never sees: a Hub whose Xet storage stopped answering kept a push with
``stall_timeout_s=2`` still waiting after 40 s.  That pipeline also commits a folder in batches
(a failed commit of more than 20 files is split in several), where a push is one commit.

A watchdog cannot end an Xet transfer cleanly: hf_xet runs it on its own threads, reports
progress per file rather than per request, and its abort (``abort_xet_session``) ends the
process's one shared Xet session.  So while slothkit uploads, ``HF_HUB_DISABLE_XET`` is set
and huggingface_hub takes its LFS path: one commit, every request through the watched
transport.  The Hub takes LFS uploads for every repo, Xet-backed ones included.  This is
said once per process.  ``use_xet=True`` leaves huggingface_hub's choice: Xet's
deduplicated, usually faster transfers, under hf_xet's own timeouts instead of
``stall_timeout_s``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import threading
import warnings

_lock = threading.Lock()
_lfs_uploads = 0  # uploads in this process that hold Xet off
_switch_before: bool = False  # HF_HUB_DISABLE_XET as it was when the first of them began


def huggingface_hub_would_use_xet() -> bool:
    """Whether huggingface_hub would upload through Xet: hf_xet is installed and
    HF_HUB_DISABLE_XET is unset."""
    from huggingface_hub import constants

    return not constants.HF_HUB_DISABLE_XET and importlib.util.find_spec("hf_xet") is not None


@contextlib.contextmanager
def upload_protocol(use_xet: bool):
    """Uploads in the block take the LFS path, unless `use_xet` (module docstring).  Pushes
    running at once in several threads share the switch: it is put back as it was when the
    last of them ends."""
    global _lfs_uploads, _switch_before
    from huggingface_hub import constants

    with _lock:
        hold = not use_xet and (_lfs_uploads > 0 or huggingface_hub_would_use_xet())
        if hold:
            if _lfs_uploads == 0:
                _switch_before = constants.HF_HUB_DISABLE_XET
                constants.HF_HUB_DISABLE_XET = True
            _lfs_uploads += 1
    if not hold:
        yield
        return
    say_uploads_take_lfs()
    try:
        yield
    finally:
        with _lock:
            _lfs_uploads -= 1
            if _lfs_uploads == 0:
                constants.HF_HUB_DISABLE_XET = _switch_before


@functools.cache
def say_uploads_take_lfs() -> None:
    warnings.warn(
        "slothkit pushes upload large files through the Hub's LFS API, not Xet (hf_xet): hf_xet sends "
        "its transfers through an HTTP client of its own, beyond the push's timeout_s and stall_timeout_s, "
        "and huggingface_hub's Xet path may split a folder over several commits. For Xet's deduplicated "
        "transfers pass use_xet=True to the push (they then run under hf_xet's own timeouts)",
        stacklevel=2,
    )
