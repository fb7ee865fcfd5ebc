"""Faults while saving: a full disk, a read-only folder, a save killed with SIGKILL, and what
the folders look like afterwards (permissions, fsync, leftovers)."""

import errno
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from slothkit.export import atomic as atomic_module
from slothkit.export import save_pretrained_merged
from slothkit.export.atomic import atomic_directory
from slothkit.export.disk_space import megabytes

IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0


def leftovers(target: pathlib.Path) -> list[pathlib.Path]:
    """Hidden siblings that saves to `target` work in (`.NAME.partial-*`, `.NAME.replaced-*`)."""
    return sorted(target.parent.glob(f".{target.name}.partial-*")) + sorted(
        target.parent.glob(f".{target.name}.replaced-*")
    )


def _tree(folder: pathlib.Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_full_disk_mid_save_keeps_the_previous_save(make_lora_model, monkeypatch, tmp_path):
    import safetensors.torch

    model, tokenizer, _ = make_lora_model("llama", seed=40)
    target = tmp_path / "out"
    save_pretrained_merged(model, target, tokenizer, save_method="lora")
    (target / "notes.txt").write_text("mine")
    before = _tree(target)

    def disk_full(tensors, filename, metadata=None):
        pathlib.Path(filename).write_bytes(b"\0" * 4096)  # what fitted before the disk filled
        raise OSError(errno.ENOSPC, "No space left on device", str(filename))

    monkeypatch.setattr(safetensors.torch, "save_file", disk_full)
    with pytest.raises(OSError, match="No space left"):
        save_pretrained_merged(model, target, tokenizer, overwrite=True)
    assert _tree(target) == before
    assert leftovers(target) == []


def test_no_room_for_the_merged_scratch_copy_names_its_folder(make_lora_model, monkeypatch, tmp_path):
    from slothkit.export import save as save_module

    model, tokenizer, _ = make_lora_model("llama", seed=41)

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(save_module, "write_sharded", disk_full)
    scratch = tmp_path / "exports"
    with pytest.raises(OSError, match=f"no space left in '{scratch}'"):
        save_module.merged_plain_model(model, tokenizer, scratch_dir=scratch)
    assert list(scratch.iterdir()) == []  # the scratch copy is gone


def test_the_merged_scratch_copy_for_gguf_goes_beside_the_output(make_lora_model, monkeypatch, tmp_path):
    from slothkit.export import methods

    model, tokenizer, _ = make_lora_model("llama", seed=42)
    seen = {}
    real = methods.merged_plain_model

    def recording(model, tokenizer=None, **kwargs):
        seen.update(kwargs)
        return real(model, tokenizer, **kwargs)

    monkeypatch.setattr(methods, "merged_plain_model", recording)
    monkeypatch.setattr(methods, "_gguf_available", lambda: True)
    calls = []
    fake = type(sys)("slothkit.export.gguf")
    fake.save_pretrained_gguf = lambda model, directory, tokenizer, **kw: calls.append(directory)
    fake.push_to_hub_gguf = lambda *a, **kw: None
    monkeypatch.setitem(sys.modules, "slothkit.export.gguf", fake)
    methods.attach_export_methods(model)
    model.save_pretrained_gguf(tmp_path / "disk" / "gguf", tokenizer)
    assert seen["scratch_dir"] == tmp_path / "disk"  # not TMPDIR
    assert calls == [tmp_path / "disk" / "gguf"]


@pytest.mark.skipif(IS_ROOT, reason="root writes into read-only folders")
def test_a_read_only_folder_is_refused_and_left_as_it_was(make_lora_model, tmp_path):
    model, tokenizer, _ = make_lora_model("llama", seed=43)
    parent = tmp_path / "ro"
    parent.mkdir()
    (parent / "kept.txt").write_text("x")
    parent.chmod(0o555)
    try:
        with pytest.raises(PermissionError):
            save_pretrained_merged(model, parent / "out", tokenizer, save_method="lora")
        assert sorted(p.name for p in parent.iterdir()) == ["kept.txt"]
    finally:
        parent.chmod(0o755)


@pytest.mark.parametrize("umask, mode", [(0o022, 0o755), (0o027, 0o750), (0o077, 0o700)])
def test_saved_folders_follow_the_umask(umask, mode, tmp_path):
    previous = os.umask(umask)
    try:
        with atomic_directory(tmp_path / "out") as staging:
            (staging / "weights.bin").write_bytes(b"w")
    finally:
        os.umask(previous)
    assert (tmp_path / "out").stat().st_mode & 0o777 == mode
    assert (tmp_path / "out" / "weights.bin").stat().st_mode & 0o777 == 0o666 & ~umask


def test_files_and_folders_are_fsynced_before_the_rename(monkeypatch, tmp_path):
    synced, renamed = [], []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    def rename(a, b):
        renamed.append((str(a), str(b), list(synced)))
        real_rename(a, b)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    with atomic_directory(tmp_path / "out") as staging:
        (staging / "a.safetensors").write_bytes(b"a")
        (staging / "sub").mkdir()
        (staging / "sub" / "b.json").write_text("{}")
    [(source, destination, synced_before)] = renamed
    assert destination == str(tmp_path / "out")
    assert {f"{source}/a.safetensors", f"{source}/sub/b.json", f"{source}/sub", source} <= set(synced_before)
    assert synced[-1] == str(tmp_path)  # the parent, so that the rename itself is durable


_SLOW_SAVE = textwrap.dedent(
    """
    import pathlib, sys, time
    from slothkit.export.atomic import atomic_directory

    with atomic_directory(sys.argv[1], overwrite=True) as staging:
        (staging / "model.safetensors").write_bytes(b"\\0" * 3_000_000)
        pathlib.Path(sys.argv[2]).write_text(str(staging))  # tell the test we are mid-save
        time.sleep(120)
    """
)


def _start_slow_save(target: pathlib.Path, ready: pathlib.Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    process = subprocess.Popen([sys.executable, "-c", _SLOW_SAVE, str(target), str(ready)], env=env)
    deadline = time.monotonic() + 60
    while not ready.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"the saving subprocess did not start (exit code {process.poll()})")
        time.sleep(0.05)
    return process


def test_a_save_killed_with_sigkill_is_cleaned_up_by_the_next_save(tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    (target / "model.safetensors").write_bytes(b"previous")
    process = _start_slow_save(target, tmp_path / "ready")
    try:
        [staging] = leftovers(target)
        # While that save lives, another save leaves its staging folder alone.
        assert atomic_module.remove_leftovers(target) == []
        assert staging.is_dir()
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    assert (target / "model.safetensors").read_bytes() == b"previous"  # the old save survived
    assert leftovers(target) == [staging]

    with pytest.warns(UserWarning, match=rf"removed what interrupted saves left: '{staging}' \(3.0 MB\)"):
        with atomic_directory(target, overwrite=True) as new:
            (new / "model.safetensors").write_bytes(b"new")
    assert leftovers(target) == []
    assert (target / "model.safetensors").read_bytes() == b"new"


def test_a_killed_exports_merged_scratch_is_removed_by_the_next_export(make_lora_model, tmp_path):
    """kill -9 during save_pretrained_gguf's merge leaves `.slothkit-merged-*` (the full
    16-bit model) beside the output; the next export removes it, naming it, and leaves a
    scratch folder another export still holds (locked) alone."""
    from slothkit.export.save import merged_plain_model

    model, tokenizer, _ = make_lora_model("llama", seed=44)
    dead = tmp_path / ".slothkit-merged-dead"
    dead.mkdir()
    (dead / "model.safetensors").write_bytes(b"\0" * 1_500_000)
    live = tmp_path / ".slothkit-merged-live"
    live.mkdir()
    held = atomic_module._lock(live)  # an export in progress in another process
    try:
        with pytest.warns(UserWarning, match=rf"removed what interrupted exports left: '{dead}' \(1.5 MB\)"):
            merged_plain_model(model, tokenizer, scratch_dir=tmp_path)
    finally:
        os.close(held)
    assert not dead.exists() and live.is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".slothkit-merged-live"]  # its own is gone too


def test_a_killed_merged_4bit_saves_scratch_is_removed_by_the_next_save(make_lora_model, tmp_path):
    """kill -9 during a merged_4bit save leaves its `.merged-16bit-*` scratch (the whole
    16-bit model) beside the output; the next save removes it, naming it, leaves one that a
    save in progress holds (locked) alone, and removes its own."""
    pytest.importorskip("bitsandbytes")
    model, tokenizer, _ = make_lora_model("mistral", load_in_4bit=True, seed=45)
    dead = tmp_path / ".merged-16bit-dead"
    dead.mkdir()
    (dead / "model.safetensors").write_bytes(b"\0" * 2_500_000)
    live = tmp_path / ".merged-16bit-live"
    live.mkdir()
    held = atomic_module._lock(live)
    try:
        with pytest.warns(UserWarning, match=rf"removed what interrupted exports left: '{dead}' \(2.5 MB\)"):
            save_pretrained_merged(
                model, tmp_path / "q", tokenizer, save_method="merged_4bit", base_weights=None
            )
    finally:
        os.close(held)
    assert not dead.exists() and live.is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".merged-16bit-live", "q"]
    assert (tmp_path / "q" / "config.json").is_file()


def test_a_set_aside_folder_is_reported_not_removed(tmp_path):
    # `.NAME.replaced-*` may hold the only copy of a save (a crash between two renames).
    aside = tmp_path / ".out.replaced-abc"
    aside.mkdir()
    (aside / "model.safetensors").write_bytes(b"\0" * 2_000_000)
    with pytest.warns(UserWarning, match=rf"check them and delete them when done: '{aside}' \(2.0 MB\)"):
        with atomic_directory(tmp_path / "out") as staging:
            (staging / "x").write_text("x")
    assert (aside / "model.safetensors").stat().st_size == 2_000_000


def test_a_read_only_filesystem_is_refused_and_left_as_it_was(make_lora_model, monkeypatch, tmp_path):
    # As root, permissions do not stop writes; a read-only mount does (EROFS), simulated here.
    model, tokenizer, _ = make_lora_model("llama", seed=44)
    (tmp_path / "kept.txt").write_text("x")

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(tmp_path))

    monkeypatch.setattr(atomic_module.tempfile, "mkdtemp", read_only)
    with pytest.raises(OSError, match=rf"cannot save there: '{tmp_path}' is on a read-only filesystem"):
        save_pretrained_merged(model, tmp_path / "out", tokenizer, save_method="lora")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept.txt"]


def test_a_hub_that_stops_answering_mid_push_fails_in_time_and_leaves_the_repo(
    local_hub, make_lora_model, tmp_path
):
    from slothkit.export import push_folder_to_hub

    model, tokenizer, _ = make_lora_model("llama", seed=45)
    save_pretrained_merged(model, tmp_path / "export", tokenizer, save_method="lora")
    repo = "local-user/stalled"
    local_hub.stall_next("POST", r"/commit/", seconds=60, times=2)  # every attempt hangs
    start = time.monotonic()
    with pytest.raises(ConnectionError) as error:
        push_folder_to_hub(tmp_path / "export", repo, token="hf_writer", endpoint=local_hub.endpoint,
                           retries=1, retry_wait_s=0, timeout_s=0.5)  # fmt: skip
    assert time.monotonic() - start < 20  # it waited forever before
    message = str(error.value)
    assert f"after 2 attempts: {local_hub.endpoint}/api/models/{repo}/commit/main" in message
    assert "ReadTimeout" in message and "the server stopped answering" in message
    assert set(local_hub.files(repo)) == {".gitattributes"}  # the repo as it was
    from huggingface_hub import get_session

    assert get_session().timeout.read is None  # the shared client is given back as it was


def test_nothing_listening_names_the_url(make_lora_model, tmp_path, monkeypatch):
    import socket

    from huggingface_hub import constants

    from slothkit.export import push_folder_to_hub

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    with socket.socket() as probe:  # a port that nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "config.json").write_text("{}")
    with pytest.raises(
        ConnectionError, match=rf"checking the token failed: http://127.0.0.1:{port}/api/whoami"
    ):
        push_folder_to_hub(tmp_path / "export", "me/x", token="hf_x", endpoint=f"http://127.0.0.1:{port}",
                           timeout_s=2)  # fmt: skip


def test_the_timeouts_hold_for_a_client_built_mid_push(local_hub, make_lora_model, monkeypatch, tmp_path):
    """huggingface_hub closes its shared client after a connection error and builds a new
    one from its factory; the requests after that must still time out."""
    import huggingface_hub

    from slothkit.export import push_folder_to_hub

    model, tokenizer, _ = make_lora_model("llama", seed=46)
    save_pretrained_merged(model, tmp_path / "export", tokenizer, save_method="lora")
    create_repo = huggingface_hub.HfApi.create_repo

    def create_repo_then_drop_the_client(self, *args, **kwargs):
        result = create_repo(self, *args, **kwargs)
        huggingface_hub.close_session()  # as huggingface_hub does after a ConnectError
        return result

    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", create_repo_then_drop_the_client)
    local_hub.stall_next("POST", r"/commit/", seconds=30)
    start = time.monotonic()
    with pytest.raises(ConnectionError, match="ReadTimeout"):
        push_folder_to_hub(tmp_path / "export", "local-user/rebuilt", token="hf_writer",
                           endpoint=local_hub.endpoint, retries=0, timeout_s=0.5)  # fmt: skip
    assert time.monotonic() - start < 15  # the new client waited the full 30 s before
    assert huggingface_hub.get_session().timeout.read is None  # the factory is given back


STALL_S = 2.0  # the push's deadline in these tests: stall_timeout_s


def _push_until_it_gives_up(local_hub, folder, repo, **options):
    """Push `folder`; return the HubConnectionError it ends in and the seconds it took."""
    from slothkit.export import HubConnectionError, push_folder_to_hub

    start = time.monotonic()
    with pytest.raises(HubConnectionError) as error:
        push_folder_to_hub(folder, repo, token="hf_writer", endpoint=local_hub.endpoint, **options)
    return str(error.value), time.monotonic() - start


def test_a_hub_that_freezes_during_the_lfs_upload_gives_up_at_the_stall_deadline(
    local_hub, make_lora_model, tmp_path
):
    """The Hub stops (as with SIGSTOP) while the weights go up: no answer, and no connect
    completes.  The 60 s read timeout, huggingface_hub's six tries of the upload with 10 s
    connect timeouts and slothkit's retries added up to minutes; the deadline ends it."""
    model, tokenizer, _ = make_lora_model("llama", seed=47)
    save_pretrained_merged(model, tmp_path / "export", tokenizer, save_method="lora")
    before = _tree(tmp_path / "export")
    repo = "local-user/frozen"
    local_hub.freeze_at("PUT", r"/lfs-upload/")
    message, elapsed = _push_until_it_gives_up(local_hub, tmp_path / "export", repo, stall_timeout_s=STALL_S)
    assert STALL_S <= elapsed < STALL_S + 1.5  # took over 150 s before
    assert f"pushing to {repo} gave up: nothing was sent to or received from the Hub for 2 s" in message
    assert f"last request: PUT {local_hub.endpoint}/lfs-upload/{repo}/" in message
    assert "Timeout: timed out (the server stopped answering)" in message
    assert "sig=" not in message  # the upload URL's signature (a credential) is left out
    assert "No upload had been confirmed. Nothing was committed: the repo is as it was." in message
    assert "Push again to resume" in message
    assert set(local_hub.files(repo)) == {".gitattributes"}
    assert _tree(tmp_path / "export") == before


def test_a_frozen_hub_whose_connects_never_complete_gives_up_at_the_stall_deadline(
    local_hub, make_lora_model, monkeypatch, tmp_path
):
    """huggingface_hub lists the repo (GET .../tree/main) with timeout=None, which overrides
    the client's timeouts: a connect to a stopped server waited for the operating system's
    limit (over two minutes), once per try."""
    import huggingface_hub

    model, tokenizer, _ = make_lora_model("llama", seed=48)
    save_pretrained_merged(model, tmp_path / "export", tokenizer, save_method="lora")
    before = _tree(tmp_path / "export")
    create_repo = huggingface_hub.HfApi.create_repo

    def create_repo_then_the_hub_stops(self, *args, **kwargs):
        result = create_repo(self, *args, **kwargs)
        local_hub.freeze()  # its accept backlog is full: a connect never completes
        huggingface_hub.close_session()  # the listing opens a new connection
        return result

    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", create_repo_then_the_hub_stops)
    repo = "local-user/unreachable"
    message, elapsed = _push_until_it_gives_up(local_hub, tmp_path / "export", repo, stall_timeout_s=STALL_S)
    assert elapsed < STALL_S + 1.5  # hung until the test was stopped before
    assert f"last request: GET {local_hub.endpoint}/api/models/{repo}/tree/main (ConnectTimeout" in message
    assert local_hub.requests[-1] == ("POST", "/api/repos/create")  # nothing reached the server after
    assert set(local_hub.files(repo)) == {".gitattributes"}
    assert _tree(tmp_path / "export") == before


def test_a_hub_killed_mid_upload_ends_in_a_hub_connection_error_within_the_deadline(
    local_hub, make_lora_model, tmp_path
):
    """Connections reset, then refused: huggingface_hub tried the upload six times with pauses
    of 1 to 8 s (24 s a push attempt) before; now its retries stop where a pause would
    outlast the deadline (here after two tries and 3 s)."""
    model, tokenizer, _ = make_lora_model("llama", seed=49)
    save_pretrained_merged(model, tmp_path / "export", tokenizer, save_method="lora")
    before = _tree(tmp_path / "export")
    repo = "local-user/killed"
    local_hub.kill_at("PUT", r"/lfs-upload/")
    message, elapsed = _push_until_it_gives_up(local_hub, tmp_path / "export", repo, stall_timeout_s=10)
    assert elapsed < 10
    assert f"pushing to {repo} gave up: a request failed with " in message
    assert "s left of stall_timeout_s=10, too little for the pause before another try" in message
    assert f"{local_hub.endpoint}/lfs-upload/{repo}/" in message and "sig=" not in message
    assert "ConnectError" in message  # the last try found nothing listening
    assert set(local_hub.files(repo)) == {".gitattributes"}
    assert _tree(tmp_path / "export") == before


def test_a_hub_that_takes_each_retry_and_never_answers_gives_up_at_a_deadline_past_the_timeout(
    local_hub, make_lora_model, tmp_path
):
    """A stopped Hub whose kernel still completes connects takes every retry's request into
    its buffers and never answers.  With the defaults' structure, a deadline longer than the
    per-request timeout (180 s and 60 s; here 10 s and 1 s, still past huggingface_hub's 8 s
    pause), each retry's bytes restarted the clock: the deadline never came, and the push
    ended after every retry of huggingface_hub's and slothkit's (over 80 s here; still
    retrying after 360 s at the defaults)."""
    model, tokenizer, _ = make_lora_model("llama", seed=52)
    save_pretrained_merged(model, tmp_path / "export", tokenizer, save_method="lora")
    before = _tree(tmp_path / "export")
    repo = "local-user/taken-never-answered"
    local_hub.stall_next("PUT", r"/lfs-upload/", seconds=600, times=1000)  # every try of the upload
    stall_s, timeout_s = 10.0, 1.0
    message, elapsed = _push_until_it_gives_up(
        local_hub, tmp_path / "export", repo, timeout_s=timeout_s, stall_timeout_s=stall_s
    )
    assert elapsed < stall_s + 1.5
    assert f"pushing to {repo} gave up: " in message
    assert f"stall_timeout_s={stall_s:g}" in message or f"for {stall_s:g} s (stall_timeout_s)" in message
    assert f"last request: PUT {local_hub.endpoint}/lfs-upload/{repo}/" in message
    assert "No upload had been confirmed. Nothing was committed: the repo is as it was." in message
    assert set(local_hub.files(repo)) == {".gitattributes"}  # the remote as it was
    assert _tree(tmp_path / "export") == before


def test_an_upload_the_storage_refuses_is_a_hub_connection_error_naming_the_file(
    local_hub, make_lora_model, tmp_path
):
    """huggingface_hub wraps a failed file upload in a bare RuntimeError("Error while
    uploading 'NAME' to the Hub."), which reached the user as it was."""
    model, tokenizer, _ = make_lora_model("llama", seed=50)
    save_pretrained_merged(model, tmp_path / "export", tokenizer, save_method="lora")
    repo = "local-user/refused"
    local_hub.fail_next("PUT", r"/lfs-upload/", status=400)
    message, _ = _push_until_it_gives_up(local_hub, tmp_path / "export", repo)
    assert (
        f"uploading {tmp_path / 'export'} to {repo} (Error while uploading 'adapter_model.safetensors' to "
        f"the Hub) failed: {local_hub.endpoint}/lfs-upload/{repo}/"
    ) in message
    assert "HTTP 400" in message and "sig=" not in message
    assert set(local_hub.files(repo)) == {".gitattributes"}


def test_pushing_again_after_a_stalled_commit_sends_no_file_twice(local_hub, make_lora_model, tmp_path):
    """What the stall report promises: the next push sends only the files the Hub lacks, and
    a commit that did not land is made."""
    from slothkit.export import push_folder_to_hub

    model, tokenizer, _ = make_lora_model("llama", seed=51)
    save_pretrained_merged(model, tmp_path / "export", tokenizer, save_method="lora")
    repo = "local-user/resumed"
    local_hub.stall_next("POST", r"/commit/", seconds=30)
    message, elapsed = _push_until_it_gives_up(local_hub, tmp_path / "export", repo, stall_timeout_s=STALL_S)
    assert elapsed < STALL_S + 1.5
    weights = (tmp_path / "export" / "adapter_model.safetensors").stat().st_size
    assert f"Before that, the Hub's storage had confirmed 1 upload(s), {megabytes(weights)}." in message
    assert "The commit was sent and not answered: it may have landed." in message
    uploads = [request for request in local_hub.requests if request[0] == "PUT"]
    assert len(uploads) == 1
    push_folder_to_hub(tmp_path / "export", repo, token="hf_writer", endpoint=local_hub.endpoint)
    assert [request for request in local_hub.requests if request[0] == "PUT"] == uploads
    assert set(local_hub.files(repo)) == {".gitattributes", *_tree(tmp_path / "export")}


def test_a_client_the_users_factory_keeps_leaves_the_push_as_it_came(local_hub, tmp_path):
    """A factory may hand out one client for good; the push's timeouts and deadline (its
    transports) must not stay on it, or a later request would meet a deadline long past."""
    import huggingface_hub
    from huggingface_hub.utils import _http

    from slothkit.export import push_folder_to_hub

    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "config.json").write_text("{}")
    previous = _http._GLOBAL_CLIENT_FACTORY
    client = _http.default_client_factory()
    transport = client._transport
    huggingface_hub.set_client_factory(lambda: client)
    try:
        push_folder_to_hub(tmp_path / "export", "local-user/kept", token="hf_writer",
                           endpoint=local_hub.endpoint, stall_timeout_s=STALL_S)  # fmt: skip
    finally:
        huggingface_hub.set_client_factory(previous)
    assert client._transport is transport and client.timeout.read is None


def test_a_stall_timeout_that_is_not_positive_is_refused(tmp_path):
    from slothkit.export import push_folder_to_hub

    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "config.json").write_text("{}")
    with pytest.raises(
        ValueError, match=r"stall_timeout_s=0: expected a positive number of seconds, or None"
    ):
        push_folder_to_hub(tmp_path / "export", "me/x", token="hf_x", stall_timeout_s=0)


def _plain_tiny(arch: str = "llama"):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from slothkit.testing import tiny_model_path

    path = tiny_model_path(arch)
    return AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)


@pytest.mark.parametrize(
    "save_method, poison, value, expected",
    [
        ("merged_16bit", "lora_B", float("nan"), r"model\.layers\.0\.self_attn\.q_proj\.weight \(NaN\)"),
        ("merged_16bit", "embed_tokens", float("inf"), r"model\.embed_tokens\.weight \(Inf\)"),
        ("lora", "lora_B", float("nan"), r"q_proj\.lora_B\.weight \(NaN\)"),
    ],
)
def test_nan_or_inf_weights_are_refused_and_the_previous_save_kept(
    make_lora_model, tmp_path, save_method, poison, value, expected
):
    import torch

    from slothkit.checkpoint.finite import NonFiniteWeightsError

    model, tokenizer, _ = make_lora_model("llama", seed=47)
    target = tmp_path / "out"
    save_pretrained_merged(model, target, tokenizer, save_method=save_method)
    before = _tree(target)
    with torch.no_grad():
        name, param = next((n, p) for n, p in model.named_parameters() if poison in n)
        param.view(-1)[3] = value
    with pytest.raises(
        NonFiniteWeightsError, match=rf"refusing to write .*: 1 tensor\(s\) .*{expected}.*nothing was written"
    ):
        save_pretrained_merged(model, target, tokenizer, save_method=save_method, overwrite=True)
    assert _tree(target) == before and leftovers(target) == []


def test_every_bad_tensor_is_named_and_float16_overflow_is_caught(make_lora_model, tmp_path):
    import torch

    from slothkit.checkpoint.finite import NonFiniteWeightsError

    model, tokenizer, _ = make_lora_model("llama", seed=48)
    with torch.no_grad():
        for layer in model.base_model.model.model.layers:
            layer.mlp.down_proj.base_layer.weight[0, 0] = float("nan")
    with pytest.raises(NonFiniteWeightsError) as error:
        save_pretrained_merged(model, tmp_path / "nan", tokenizer)
    message = str(error.value)
    assert message.count("mlp.down_proj.weight (NaN)") == len(model.base_model.model.model.layers)
    assert "\n" not in message and not (tmp_path / "nan").exists()

    model, tokenizer, _ = make_lora_model("llama", seed=49)
    with torch.no_grad():
        model.base_model.model.model.norm.weight[0] = 1e6  # finite in float32, Inf in float16
    with pytest.raises(
        NonFiniteWeightsError, match=r"model\.norm\.weight \(beyond float16's range \(65504\)\).*bfloat16"
    ):
        save_pretrained_merged(model, tmp_path / "f16", tokenizer, dtype=torch.float16)
    save_pretrained_merged(model, tmp_path / "bf16", tokenizer, dtype=torch.bfloat16)  # fits there


@pytest.mark.parametrize(
    "method, value, expected", [("q8_0", float("nan"), "NaN"), ("f16", 1e5, "beyond float16")]
)
def test_gguf_export_refuses_nan_inf_and_float16_overflow(tmp_path, method, value, expected):
    import torch

    from slothkit.checkpoint.finite import NonFiniteWeightsError
    from slothkit.export.gguf import save_pretrained_gguf

    model, tokenizer = _plain_tiny()
    target = tmp_path / "gguf"
    save_pretrained_gguf(model, target, tokenizer, method, verify=False)
    before = _tree(target)
    with torch.no_grad():
        model.model.layers[1].self_attn.o_proj.weight[2, 5] = value
    with pytest.raises(
        NonFiniteWeightsError, match=rf"the GGUF file .*blk\.1\.attn_output\.weight \({expected}"
    ):
        save_pretrained_gguf(model, target, tokenizer, method, verify=False, overwrite=True)
    assert _tree(target) == before and leftovers(target) == []


def test_a_k_quant_export_whose_rows_cannot_hold_k_quants_says_what_the_file_holds(tmp_path):
    import collections
    import warnings

    import gguf

    from slothkit.export.gguf import save_pretrained_gguf

    model, tokenizer = _plain_tiny()  # 64-wide rows: no K-quant block (256) fits
    with pytest.warns(UserWarning) as caught:
        [path, _] = save_pretrained_gguf(model, tmp_path / "q4", tokenizer, "q4_k_m", verify=False)
    [message] = [str(w.message) for w in caught if "fell back" in str(w.message)]
    reader = gguf.GGUFReader(path)
    held = collections.Counter(t.tensor_type.name for t in reader.tensors if len(t.shape) > 1)
    assert "Q4_K" not in held  # what the label promises, the file does not hold
    holding = ", ".join(f"{count} {name}" for name, count in held.most_common())
    assert f"{sum(held.values())} of {sum(held.values())} weight matrices" in message
    assert f"its weight matrices are {holding}, no Q4_K tensor at all" in message
    assert "labelled Q4_K_M all the same, as llama.cpp's llama-quantize" in message and "\n" not in message
    assert reader.fields["general.file_type"].contents() == int(gguf.LlamaFileType.MOSTLY_Q4_K_M)

    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*fell back")  # Q8_0's 32-blocks fit: no warning
        save_pretrained_gguf(model, tmp_path / "q8", tokenizer, "q8_0", verify=False)


def _general_name(path) -> str:
    import gguf

    return gguf.GGUFReader(path).fields["general.name"].contents()


def test_gguf_files_and_their_general_name_are_named_after_the_model(make_lora_model, tmp_path):
    import copy

    from slothkit.export.gguf import save_pretrained_gguf

    # A LoRA model is merged through a scratch folder first: its name must not leak out.
    model, tokenizer, base = make_lora_model("llama", seed=50)
    assert base.name.startswith("llama-")  # the tiny-model cache's folder: llama-<hash>
    [path, modelfile] = model.save_pretrained_gguf(
        tmp_path / "gguf", tokenizer, quantization_method="q8_0", verify=False
    )
    assert path.name == "llama.Q8_0.gguf"  # was gguf.Q8_0.gguf, then llama-<hash>.Q8_0.gguf
    assert _general_name(path) == "llama"  # was .slothkit-merged-XXXXXXXX
    assert modelfile.read_text().startswith("FROM ./llama.Q8_0.gguf\n")

    plain, tokenizer = _plain_tiny()
    cases = {
        "HuggingFaceTB/SmolLM2-135M-Instruct": "SmolLM2-135M-Instruct",
        "/root/.cache/huggingface/hub/models--org--Llama-3.2-1B/snapshots/0123abcd": "Llama-3.2-1B",
        "/data/checkpoints/my-llama/": "my-llama",
        "": "my-export",  # no name: the output folder's
        "/tmp/tmpa1b2c3d4": "my-export",  # a temporary folder's name is never used
        "/work/.slothkit-merged-x8y7": "my-export",
        # slothkit's caches add a content hash and the stored dtype to the model's name
        "/root/.cache/slothkit/real-models/smollm2-135m-instruct-b179c9523d0e-float32": "smollm2-135m-instruct",
        "/root/.cache/slothkit/real-models/gemma-3-270m-a5fd3b62230a-bfloat16": "gemma-3-270m",
        "/tmp/slothkit-tiny-models-k2j4/mistral-0c9e1d2f3a4b": "mistral",
        "/data/checkpoints/run-202501311200": "run-202501311200",  # a date, not a hash
        "/data/checkpoints/Llama-3-8B-float16": "Llama-3-8B-float16",  # a dtype alone stays
    }
    for i, (name_or_path, expected) in enumerate(cases.items()):
        named = copy.copy(plain)
        named.config = copy.deepcopy(plain.config)
        named.config._name_or_path = name_or_path
        [path, _] = save_pretrained_gguf(
            named, tmp_path / str(i) / "my-export", tokenizer, "f16", verify=False
        )
        assert (path.name, _general_name(path)) == (f"{expected}.F16.gguf", expected), name_or_path


def _disk_with_free(monkeypatch, free: int):
    import collections
    import shutil

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**12, 10**12 - free, free))


def _folder_size(folder: pathlib.Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


@pytest.mark.parametrize("save_method", ["merged_16bit", "lora"])
def test_the_size_estimate_is_a_lower_bound_of_what_a_save_writes(make_lora_model, tmp_path, save_method):
    import torch

    from slothkit.export.disk_space import estimated_save_bytes, parameter_count

    model, tokenizer, _ = make_lora_model("llama", seed=51)
    estimate = estimated_save_bytes(model, save_method, torch.bfloat16)  # merged_16bit of a float32 model
    save_pretrained_merged(model, tmp_path / "out", tokenizer, save_method=save_method)
    written = _folder_size(tmp_path / "out")
    assert 0.5 * written < estimate <= written  # errs low, never refuses a save that fits
    if (
        save_method == "merged_16bit"
    ):  # merged_4bit (bitsandbytes, GPU only): the scratch copy and the 4-bit one
        assert (
            estimated_save_bytes(model, "merged_4bit", torch.bfloat16)
            == estimate + parameter_count(model) // 2
        )


def test_a_save_that_cannot_fit_is_refused_before_any_work(make_lora_model, monkeypatch, tmp_path):
    import torch

    from slothkit.export import save as save_module
    from slothkit.export.disk_space import NotEnoughSpaceError, estimated_save_bytes, megabytes

    model, tokenizer, _ = make_lora_model("llama", seed=52)
    monkeypatch.setattr(save_module, "write_merged_checkpoint", lambda *a, **k: pytest.fail("merged anyway"))
    _disk_with_free(monkeypatch, 100_000)
    needed = megabytes(estimated_save_bytes(model, "merged_16bit", torch.bfloat16))
    with pytest.raises(
        NotEnoughSpaceError,
        match=rf"^not enough space in '{tmp_path}' for the merged_16bit save: it needs about {needed} and "
        r"100 kB are free; free some space or write to a folder on a larger disk$",
    ):
        save_pretrained_merged(model, tmp_path / "out", tokenizer)
    assert list(tmp_path.iterdir()) == []


def test_a_gguf_export_that_cannot_fit_is_refused_before_writing(monkeypatch, tmp_path):
    from slothkit.export.disk_space import NotEnoughSpaceError
    from slothkit.export.gguf import save_pretrained_gguf

    model, tokenizer = _plain_tiny()
    [path, _] = save_pretrained_gguf(model, tmp_path / "probe", tokenizer, ["q8_0"], verify=False)
    size = path.stat().st_size
    _disk_with_free(monkeypatch, size // 2)
    with pytest.raises(NotEnoughSpaceError, match=r"for the GGUF files \(.*\.Q8_0\.gguf\): it needs about"):
        save_pretrained_gguf(model, tmp_path / "out", tokenizer, ["q8_0"], verify=False)
    assert not (tmp_path / "out").exists()
    _disk_with_free(monkeypatch, size)  # the estimate (tensor data only) errs low: this fits
    save_pretrained_gguf(model, tmp_path / "fits", tokenizer, ["q8_0"], verify=False)


def test_an_adapter_export_that_cannot_fit_is_refused_before_loading(make_lora_model, monkeypatch, tmp_path):
    from slothkit.export import adapter_export
    from slothkit.export.disk_space import NotEnoughSpaceError, checkpoint_parameter_count, megabytes

    model, tokenizer, base = make_lora_model("llama", seed=53)
    model.save_pretrained(tmp_path / "adapter")
    monkeypatch.setattr(adapter_export, "load_adapter_model", lambda *a, **k: pytest.fail("loaded anyway"))
    _disk_with_free(monkeypatch, 10_000)
    needed = {
        "merged_16bit": megabytes(2 * checkpoint_parameter_count(base)),  # 16 bits a parameter
        "gguf": megabytes((base / "model.safetensors").stat().st_size),  # the fp32 merged scratch copy
    }
    for to, quant in (("merged_16bit", None), ("gguf", "q4_k_m,q8_0")):
        with pytest.raises(
            NotEnoughSpaceError,
            match=rf"for the {to} export of adapter: it needs about {needed[to]} and 10 kB are free",
        ):
            adapter_export.export_adapter(tmp_path / "adapter", to, quant=quant, output=tmp_path / to)


def test_a_disk_that_fills_inside_the_gguf_writer_is_named(monkeypatch, tmp_path):
    import gguf

    from slothkit.export.disk_space import NotEnoughSpaceError
    from slothkit.export.gguf import save_pretrained_gguf

    model, tokenizer = _plain_tiny()
    target = tmp_path / "gguf"
    save_pretrained_gguf(model, target, tokenizer, "f16", verify=False)
    before = _tree(target)
    written = []
    real = gguf.GGUFWriter.write_tensor_data

    def fills_up(self, tensor, *args, **kwargs):
        if len(written) == 3:
            raise OSError("12288 requested and 8392 written")  # numpy's tofile on a full disk
        written.append(tensor.nbytes)
        return real(self, tensor, *args, **kwargs)

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", fills_up)
    with pytest.raises(
        NotEnoughSpaceError,
        match=rf"no space left in '{tmp_path}/\.gguf\.partial-\w+' while writing .*\.Q8_0\.gguf: it needs "
        r"about \d+ kB and [\d.]+ [kMG]B were free when it was started",
    ) as error:
        save_pretrained_gguf(model, target, tokenizer, "q8_0", verify=False)
    assert "requested and" not in str(error.value)
    assert _tree(target) == before and leftovers(target) == []


def test_a_hub_answering_500_ends_in_one_line_naming_the_url_and_status(local_hub, make_lora_model, tmp_path):
    from slothkit.export import push_folder_to_hub

    model, tokenizer, _ = make_lora_model("llama", seed=54)
    save_pretrained_merged(model, tmp_path / "export", tokenizer, save_method="lora")
    local_hub.fail_next("POST", r"/commit/", status=500, times=5)
    with pytest.raises(ConnectionError) as error:
        push_folder_to_hub(tmp_path / "export", "local-user/failing", token="hf_writer",
                           endpoint=local_hub.endpoint, retries=1, retry_wait_s=0)  # fmt: skip
    message = str(error.value)
    assert (
        f"after 2 attempts: {local_hub.endpoint}/api/models/local-user/failing/commit/main: HTTP 500"
        in message
    )
    assert "\n" not in message  # httpx's own message has a second line (a link to MDN)


def _push_in_a_thread(wait_s: float, **push):
    """Run push_folder_to_hub(**push) in a thread for at most `wait_s`: ("ended", result or
    error), or ("still waiting", None); an Xet transfer cannot be interrupted from here."""
    import threading

    from slothkit.export import push_folder_to_hub

    outcome = []

    def push_and_record():
        try:
            outcome.append(push_folder_to_hub(**push))
        except Exception as error:  # reported to the test
            outcome.append(error)

    thread = threading.Thread(target=push_and_record, daemon=True)
    thread.start()
    thread.join(wait_s)
    return ("still waiting", None) if thread.is_alive() else ("ended", outcome[0])


@pytest.fixture
def xet_left_on(local_hub, monkeypatch):
    """huggingface_hub as a user has it: hf_xet installed and Xet on (the local_hub fixture
    turns it off)."""
    from huggingface_hub import constants

    from slothkit.export import hub_transfers

    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", False)
    hub_transfers.say_uploads_take_lfs.cache_clear()
    return local_hub


def test_a_hub_whose_xet_storage_stalls_is_pushed_to_through_lfs_in_one_commit(
    xet_left_on, make_lora_model, monkeypatch, tmp_path
):
    """huggingface_hub would send the weights through Xet (hf_xet's own HTTP client, outside
    the deadline): the push waited on the stalled storage with no end.  Pushes upload through
    LFS instead, in one commit each, said once; Xet stays on outside them."""
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.utils._runtime import is_xet_available

    hub = xet_left_on
    hub.offer_xet_with_stalled_storage()
    model, tokenizer, _ = make_lora_model("llama", seed=49)
    save_pretrained_merged(model, tmp_path / "export", tokenizer, save_method="lora")
    xet_switch_in_uploads = []
    upload_folder = huggingface_hub.HfApi.upload_folder

    def recording_upload_folder(self, *args, **kwargs):
        xet_switch_in_uploads.append(is_xet_available())  # huggingface_hub's own choice
        return upload_folder(self, *args, **kwargs)

    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", recording_upload_folder)
    push = dict(folder=tmp_path / "export", token="hf_writer", endpoint=hub.endpoint, stall_timeout_s=STALL_S)
    with pytest.warns(UserWarning) as caught:
        for repo in ("local-user/via-lfs", "local-user/via-lfs-again"):
            ended, result = _push_in_a_thread(STALL_S + 10, repo_id=repo, **push)
            assert (ended, type(result).__name__) == ("ended", "PushResult")  # waited with no end before
            assert set(hub.files(repo)) >= {"adapter_model.safetensors", "adapter_config.json"}
            assert len(hub.commits(repo)) == 2  # the repo's first commit and the push's one
    notices = [str(w.message) for w in caught if "not Xet" in str(w.message)]
    assert notices == [
        "slothkit pushes upload large files through the Hub's LFS API, not Xet (hf_xet): hf_xet sends its "
        "transfers through an HTTP client of its own, beyond the push's timeout_s and stall_timeout_s, and "
        "huggingface_hub's Xet path may split a folder over several commits. For Xet's deduplicated "
        "transfers pass use_xet=True to the push (they then run under hf_xet's own timeouts)"
    ]
    assert xet_switch_in_uploads == [False, False] and constants.HF_HUB_DISABLE_XET is False
    paths = [path for _, path in hub.requests]
    assert not any("xet-write-token" in path for path in paths)
    assert any(path.endswith(".git/info/lfs/objects/batch") for path in paths)
    assert any(path.startswith("/lfs-upload/local-user/via-lfs/") for path in paths)


def test_a_hub_that_freezes_during_an_upload_xet_would_have_taken_gives_up_at_the_deadline(
    xet_left_on, make_lora_model, tmp_path
):
    hub = xet_left_on
    hub.offer_xet_with_stalled_storage()
    model, tokenizer, _ = make_lora_model("llama", seed=50)
    save_pretrained_merged(model, tmp_path / "export", tokenizer, save_method="lora")
    hub.freeze_at("PUT", r"/lfs-upload/")
    start = time.monotonic()
    with pytest.warns(UserWarning, match="not Xet"):
        ended, error = _push_in_a_thread(
            STALL_S + 10, folder=tmp_path / "export", repo_id="local-user/frozen-xet", token="hf_writer",
            endpoint=hub.endpoint, stall_timeout_s=STALL_S,
        )  # fmt: skip
    assert ended == "ended" and time.monotonic() - start < STALL_S + 1.5
    assert (
        "pushing to local-user/frozen-xet gave up: nothing was sent to or received from the Hub for 2 s"
        in str(error)
    )
    assert "Nothing was committed: the repo is as it was." in str(error)


def test_use_xet_leaves_huggingface_hubs_choice_of_xet(xet_left_on, make_lora_model, tmp_path):
    """use_xet=True: the push goes to Xet: hf_xet asks for its write token, which this hub
    refuses (it serves no Xet), and no LFS batch is made."""
    import warnings

    from slothkit.export import HubConnectionError

    hub = xet_left_on
    model, tokenizer, _ = make_lora_model("llama", seed=51)
    save_pretrained_merged(model, tmp_path / "export", tokenizer, save_method="lora")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no notice: nothing is switched
        ended, error = _push_in_a_thread(
            STALL_S + 10, folder=tmp_path / "export", repo_id="local-user/via-xet", token="hf_writer",
            endpoint=hub.endpoint, stall_timeout_s=STALL_S, use_xet=True,
        )  # fmt: skip
    assert ended == "ended" and isinstance(error, HubConnectionError)
    paths = [path for _, path in hub.requests]
    assert "/api/models/local-user/via-xet/xet-write-token/main" in paths
    assert not any(path.endswith(".git/info/lfs/objects/batch") for path in paths)
