"""A small local stand-in for the Hugging Face Hub, for tests and notebooks (no network).

It speaks the part of the Hub's HTTP API that `huggingface_hub` uses to publish and fetch a
model repo, so the real client (HfApi, upload_folder, snapshot_download, hf_hub_download)
runs against it unchanged:

    GET  /api/whoami-v2                               token check
    POST /api/repos/create                            create_repo (409 when it exists)
    POST /api/validate-yaml                           README.md metadata check
    GET  /api/models/{repo}[/revision/{rev}]          model_info / repo_info
    POST /api/models/{repo}/preupload/{rev}           "regular" or "lfs" per file, remote oids
    GET  /api/models/{repo}/xet-write-token/{rev}     Xet storage URL and token, when offered
    POST /{repo}.git/info/lfs/objects/batch           LFS batch API (basic transfer)
    PUT  /lfs-upload/{repo}/{sha256}?sig=...          the upload URL the batch hands out
    POST /lfs-verify/{repo}                           LFS verify
    POST /api/models/{repo}/commit/{rev}              NDJSON commit, applied all-or-nothing
    GET  /api/models/{repo}/tree/{rev}[/{path}]       list_repo_tree (recursive or not)
    GET  /api/models/{repo}/commits/{rev}             list_repo_commits
    HEAD/GET /{repo}/resolve/{rev}/{path}             downloads (Range supported)

Model repos only. Files are stored content-addressed under a temporary folder (blobs/ by
sha256) and each commit is a full snapshot {path: blob}, so any revision can be read back.

Uploads of large files: huggingface_hub >= 1.0 sends them through the Xet protocol whenever
the `hf_xet` package is installed, and that protocol (a chunk store) is not served here; the
client must run with Xet disabled (HF_HUB_DISABLE_XET=1 before import, or
`huggingface_hub.constants.HF_HUB_DISABLE_XET = True`) and then uses the LFS batch API above.
`offer_xet_with_stalled_storage()` makes the hub offer Xet storage that accepts connections
and never answers (a Hub whose Xet storage stalls), for a client that leaves Xet on.
`LocalHub.client_env()` gives the variables for a subprocess (a notebook kernel), and
`LocalHub.patched_client()` sets the same in this process.

    with LocalHub() as hub, hub.patched_client():
        HfApi(endpoint=hub.endpoint, token=hub.token).create_repo("local-user/demo")

Failures can be injected to test retries: `hub.fail_next("POST", r"/commit/", status=500)`;
a request that is never answered: `stall_next`; the whole server stopped (SIGSTOP: no answers,
connects that never complete) or killed mid-request (SIGKILL: connection reset, later
connects refused): `freeze_at`, `kill_at`.

The Hub API's operations are in ``local_hub_api``, the HTTP plumbing and the routes in
``local_hub_http``, the stored records (repos, commits, files) in ``local_hub_records``.
"""

from __future__ import annotations

import contextlib
import datetime
import fnmatch
import hashlib
import hmac
import http.server
import itertools
import json
import os
import pathlib
import re
import secrets
import shutil
import socket
import tempfile
import threading

from slothkit.testing.local_hub_api import HubAPI
from slothkit.testing.local_hub_http import _Handler
from slothkit.testing.local_hub_records import (
    DEFAULT_GITATTRIBUTES,
    LFS_SIZE_THRESHOLD,
    HubError,
    _Commit,
    _Entry,
    _Failure,
    _Repo,
    git_blob_oid,
    lfs_pointer,
)

DEFAULT_USER = "local-user"
DEFAULT_TOKEN = "hf_local_write_token"


class LocalHub(HubAPI):
    """The server: `start()` it (or use it as a context manager), point clients at `endpoint`."""

    def __init__(
        self,
        root: str | os.PathLike | None = None,
        tokens: dict[str, tuple[str, str]] | None = None,
        lfs_threshold: int = LFS_SIZE_THRESHOLD,
    ):
        """tokens: {token: (user name, "write" or "read")}; default one write token for DEFAULT_USER."""
        self._own_root = root is None
        self.root = (
            pathlib.Path(root) if root is not None else pathlib.Path(tempfile.mkdtemp(prefix="slothkit-hub-"))
        )
        (self.root / "blobs").mkdir(parents=True, exist_ok=True)
        self.tokens = dict(tokens) if tokens is not None else {DEFAULT_TOKEN: (DEFAULT_USER, "write")}
        self.lfs_threshold = lfs_threshold
        self.xet_storage_url: str | None = None  # offer_xet_with_stalled_storage
        self.requests: list[tuple[str, str]] = []  # (method, path) of every request, for tests
        self._repos: dict[str, _Repo] = {}
        self._failures: list[_Failure] = []
        self._stalls: list[_Failure] = []  # status holds the seconds to stall
        self._freezes: list[_Failure] = []  # process-level faults: status unused
        self._kills: list[_Failure] = []
        self.frozen = threading.Event()  # stopped: nothing is answered or accepted any more
        self.killed = threading.Event()  # dead: connections are reset, connects refused
        self._backlog_fillers: list[socket.socket] = []
        self._stopping = threading.Event()
        self._lock = threading.RLock()
        self._secret = secrets.token_bytes(16)
        self._counter = itertools.count()
        self._server: http.server.ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # --- lifecycle -----------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        if self._server is None:
            raise RuntimeError("the LocalHub is not started; call start() or use it in a with-block")
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def token(self) -> str:
        """A write token (the first one configured)."""
        return next(t for t, (_, role) in self.tokens.items() if role == "write")

    def start(self) -> LocalHub:
        handler = type("Handler", (_Handler,), {"hub": self})
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)  # a free port
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.05},
            name="slothkit-local-hub",
            daemon=True,
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()  # stalled requests end now
        if self._server is not None:
            self._server.shutdown()  # a no-op when a freeze or a kill already stopped the loop
            self._server.server_close()
            self._thread.join(timeout=10)
            self._server = None
        for filler in self._backlog_fillers:
            filler.close()
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> LocalHub:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def client_env(self) -> dict[str, str]:
        """Environment for a subprocess that should talk to this server (set before it imports
        huggingface_hub)."""
        return {"HF_ENDPOINT": self.endpoint, "HF_HUB_DISABLE_XET": "1", "HF_TOKEN": self.token}

    @contextlib.contextmanager
    def patched_client(self):
        """Point this process's huggingface_hub at the server (ENDPOINT, Xet off), then restore."""
        from huggingface_hub import constants

        names = ("ENDPOINT", "HUGGINGFACE_CO_URL_TEMPLATE", "HF_HUB_DISABLE_XET")
        saved = {name: getattr(constants, name) for name in names}
        # The download URL template is built from ENDPOINT when the module is imported.
        values = (self.endpoint, self.endpoint + "/{repo_id}/resolve/{revision}/{filename}", True)
        for name, value in zip(names, values):
            setattr(constants, name, value)
        try:
            yield self
        finally:
            for name, value in saved.items():
                setattr(constants, name, value)

    # --- test helpers -----------------------------------------------------------------

    def offer_xet_with_stalled_storage(self) -> None:
        """Answer Xet write-token requests with the URL of a storage server that accepts
        connections and never answers, as a Hub whose Xet storage stalls; the Xet protocol
        itself is not served."""
        storage = socket.socket()
        storage.bind(("127.0.0.1", 0))
        storage.listen(64)  # the kernel completes connects; nothing ever reads them
        self._backlog_fillers.append(storage)  # closed by stop()
        host, port = storage.getsockname()
        self.xet_storage_url = f"http://{host}:{port}"

    def fail_next(self, method: str, path_pattern: str, status: int = 500, times: int = 1) -> None:
        """Answer the next `times` requests matching (method, regex on the path) with `status`."""
        with self._lock:
            self._failures.append(_Failure(method.upper(), re.compile(path_pattern), status, times))

    def stall_next(self, method: str, path_pattern: str, seconds: float = 600.0, times: int = 1) -> None:
        """Stop answering the next `times` requests matching (method, regex on the path): read
        the request, then send nothing for `seconds` (or until stop()) and close the
        connection, as a server that hangs mid-upload does."""
        with self._lock:
            self._stalls.append(_Failure(method.upper(), re.compile(path_pattern), seconds, times))

    def freeze_at(self, method: str, path_pattern: str) -> None:
        """At the next request matching (method, regex on the path), stop as a process sent
        SIGSTOP does: that request and every later one on an open connection get no answer
        (until stop()), and new connections are never accepted: the accept backlog is filled,
        so a connect waits for the operating system's connect timeout (minutes)."""
        with self._lock:
            self._freezes.append(_Failure(method.upper(), re.compile(path_pattern), 0, 1))

    def kill_at(self, method: str, path_pattern: str) -> None:
        """At the next request matching (method, regex on the path), die as a process sent
        SIGKILL does: read part of the request's body, reset the connection (and any other
        that sends a request), close the listening socket so later connects are refused."""
        with self._lock:
            self._kills.append(_Failure(method.upper(), re.compile(path_pattern), 0, 1))

    def files(self, repo_id: str, revision: str = "main") -> dict[str, bytes]:
        """{path: content} of a revision."""
        with self._lock:
            commit = self._repo(repo_id).resolve(revision)
            if commit is None:
                raise KeyError(f"{repo_id} has no revision {revision!r}")
            return {path: self._blob(entry.sha256).read_bytes() for path, entry in commit.tree.items()}

    def commits(self, repo_id: str, revision: str = "main") -> list[dict]:
        """Commits reachable from `revision`, newest first: {"oid", "title", "files"}."""
        with self._lock:
            repo = self._repo(repo_id)
            commit, out = repo.resolve(revision), []
            while commit is not None:
                out.append({"oid": commit.oid, "title": commit.title, "files": sorted(commit.tree)})
                commit = repo.commits.get(commit.parent) if commit.parent else None
            return out

    def take_stall(self, method: str, path: str) -> float | None:
        return self.take_failure(method, path, self._stalls)

    def take_freeze(self, method: str, path: str) -> bool:
        return self.take_failure(method, path, self._freezes) is not None

    def take_kill(self, method: str, path: str) -> bool:
        return self.take_failure(method, path, self._kills) is not None

    def freeze(self) -> None:
        """Stop accepting connections and fill the accept backlog (see freeze_at)."""
        self.frozen.set()
        self._server.shutdown()  # the accept loop ends; the listening socket stays open
        host, port = self._server.server_address[:2]
        # The kernel completes handshakes until the backlog is full, then drops new SYNs.
        for _ in range(self._server.request_queue_size + 2):
            filler = socket.socket()
            filler.settimeout(0.2)
            try:
                filler.connect((host, port))
            except OSError:  # the backlog is full: this connect is the first that hangs
                filler.close()
                break
            self._backlog_fillers.append(filler)

    def kill(self) -> None:
        """Close the listening socket: later connects are refused (see kill_at)."""
        self.killed.set()
        self._server.shutdown()
        self._server.socket.close()

    def take_failure(self, method: str, path: str, failures: list | None = None) -> int | None:
        with self._lock:
            for failure in self._failures if failures is None else failures:
                if failure.remaining > 0 and failure.method == method and failure.pattern.search(path):
                    failure.remaining -= 1
                    return failure.status
        return None

    # --- storage ----------------------------------------------------------------------

    def _blob(self, sha256: str) -> pathlib.Path:
        return self.root / "blobs" / sha256

    def _store_blob(self, content: bytes) -> str:
        sha256 = hashlib.sha256(content).hexdigest()
        path = self._blob(sha256)
        if not path.exists():
            partial = path.with_name(f"{sha256}.{next(self._counter)}.partial")
            partial.write_bytes(content)
            os.replace(partial, path)
        return sha256

    def _repo(self, repo_id: str) -> _Repo:
        repo = self._repos.get(repo_id)
        if repo is None:
            raise HubError(404, f"Repository {repo_id} not found", "RepoNotFound")
        return repo

    def _new_commit(self, repo: _Repo, parent: _Commit | None, tree, title, message, author) -> _Commit:
        date = datetime.datetime.now(datetime.timezone.utc).isoformat().replace("+00:00", "Z")
        seed = json.dumps([parent.oid if parent else None, sorted((p, e.sha256) for p, e in tree.items()),
                           title, message, date, next(self._counter)])  # fmt: skip
        commit = _Commit(hashlib.sha1(seed.encode()).hexdigest(), parent.oid if parent else None,
                         tree, title, message, date, author)  # fmt: skip
        repo.commits[commit.oid] = commit
        return commit

    def _entry(self, content: bytes, lfs: bool) -> _Entry:
        sha256 = self._store_blob(content)
        git_oid = git_blob_oid(lfs_pointer(sha256, len(content)) if lfs else content)
        return _Entry(sha256, len(content), lfs, git_oid)

    def _is_lfs_path(self, tree: dict[str, _Entry], path: str, size: int) -> bool:
        if size > self.lfs_threshold:
            return True
        attributes = tree.get(".gitattributes")
        text = self._blob(attributes.sha256).read_text() if attributes else DEFAULT_GITATTRIBUTES
        for line in text.splitlines():
            fields = line.split()
            if "filter=lfs" not in fields[1:]:
                continue
            if fnmatch.fnmatch(path, fields[0]) or fnmatch.fnmatch(path.rsplit("/", 1)[-1], fields[0]):
                return True
        return False

    def _lfs_signature(self, repo_id: str, sha256: str) -> str:
        return hmac.new(self._secret, f"{repo_id}/{sha256}".encode(), "sha256").hexdigest()

    # --- auth -------------------------------------------------------------------------

    def _user(self, headers, required: str | None) -> str | None:
        """The caller's user name; raises 401/403 when `required` ("read"/"write") is not met."""
        value = headers.get("Authorization") or ""
        token = value[7:].strip() if value.lower().startswith("bearer ") else None
        if token is None:
            if required == "write":
                raise HubError(401, "Authorization header is required for this operation")
            return None
        if token not in self.tokens:
            raise HubError(401, "Invalid credentials in Authorization header")
        user, role = self.tokens[token]
        if required == "write" and role != "write":
            raise HubError(
                403, f"The token of {user} has the '{role}' role; this operation needs a write token"
            )
        return user

    def _readable(self, repo_id: str, headers) -> _Repo:
        repo = self._repo(repo_id)
        user = self._user(headers, None)
        if repo.private and user != repo_id.split("/")[0]:
            raise HubError(404, f"Repository {repo_id} not found", "RepoNotFound")
        return repo

    def _writable(self, repo_id: str, headers) -> _Repo:
        user = self._user(headers, "write")
        repo = self._repo(repo_id)
        if repo_id.split("/")[0] != user:
            raise HubError(403, f"{user} cannot write to {repo_id}")
        return repo


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> None:
    """`python -m slothkit.testing.local_hub`: serve until interrupted, for a notebook run by hand or
    a test harness in another process. Prints the client environment as one JSON line."""
    import argparse
    import signal

    parser = argparse.ArgumentParser(
        description="A local stand-in for the Hugging Face Hub (127.0.0.1 only)."
    )
    parser.add_argument("--root", help="folder to store repos in (default: a temporary one, removed on exit)")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)  # a plain `kill` stops it as Ctrl-C does
    with LocalHub(root=args.root) as hub:
        print(json.dumps(hub.client_env()), flush=True)
        try:
            threading.Event().wait()
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
