"""A small local stand-in for the Hugging Face Hub, for tests and notebooks (no network).

It speaks the part of the Hub's HTTP API that `huggingface_hub` uses to publish and fetch a
model repo, so the real client (HfApi, upload_folder, snapshot_download, hf_hub_download)
runs against it unchanged:

    GET  /api/whoami-v2                               token check
    POST /api/repos/create                            create_repo (409 when it exists)
    POST /api/validate-yaml                           README.md metadata check
    GET  /api/models/{repo}[/revision/{rev}]          model_info / repo_info
    POST /api/models/{repo}/preupload/{rev}           "regular" or "lfs" per file, remote oids
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
`LocalHub.client_env()` gives the variables for a subprocess (a notebook kernel), and
`LocalHub.patched_client()` sets the same in this process.

    with LocalHub() as hub, hub.patched_client():
        HfApi(endpoint=hub.endpoint, token=hub.token).create_repo("local-user/demo")

Failures can be injected to test retries: `hub.fail_next("POST", r"/commit/", status=500)`.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
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
import tempfile
import threading
from urllib.parse import parse_qs, quote, unquote, urlsplit

DEFAULT_USER = "local-user"
DEFAULT_TOKEN = "hf_local_write_token"
LFS_SIZE_THRESHOLD = 10 * 1024 * 1024  # the Hub stores files above 10 MB in LFS whatever their name
DEFAULT_GITATTRIBUTES = "".join(
    f"{pattern} filter=lfs diff=lfs merge=lfs -text\n"
    for pattern in ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.ckpt", "*.gguf", "*.model", "*.onnx",
                    "*.h5", "*.msgpack", "*.npy", "*.npz", "*.pkl", "*.tar.*", "*.zip")
)  # fmt: skip

_REPO = r"(?P<repo>[\w.-]+/[\w.-]+)"


def git_blob_oid(content: bytes) -> str:
    """Git's object id of a blob: sha1 of 'blob <size>\\0<content>'."""
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


def lfs_pointer(sha256: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


@dataclasses.dataclass(frozen=True)
class _Entry:
    sha256: str
    size: int
    lfs: bool
    git_oid: str  # blob oid of the content (regular) or of the LFS pointer (LFS)


@dataclasses.dataclass
class _Commit:
    oid: str
    parent: str | None
    tree: dict[str, _Entry]
    title: str
    message: str
    date: str
    author: str


@dataclasses.dataclass
class _Repo:
    repo_id: str
    private: bool
    commits: dict[str, _Commit] = dataclasses.field(default_factory=dict)
    refs: dict[str, str] = dataclasses.field(default_factory=dict)

    def resolve(self, revision: str) -> _Commit | None:
        oid = self.refs.get(revision, revision)
        return self.commits.get(oid)


@dataclasses.dataclass
class _Failure:
    method: str
    pattern: re.Pattern
    status: float  # the HTTP status to answer with; for a stall, the seconds to stay silent
    remaining: int


class HubError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


class LocalHub:
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
        self.requests: list[tuple[str, str]] = []  # (method, path) of every request, for tests
        self._repos: dict[str, _Repo] = {}
        self._failures: list[_Failure] = []
        self._stalls: list[_Failure] = []  # status holds the seconds to stall
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
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(timeout=10)
            self._server = None
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

    # --- API --------------------------------------------------------------------------

    def whoami(self, headers) -> dict:
        user = self._user(headers, None)
        if user is None:
            raise HubError(401, "Invalid credentials in Authorization header")
        token = (headers.get("Authorization") or "")[7:].strip()
        role = self.tokens[token][1]
        return {"type": "user", "name": user, "fullname": user, "orgs": [],
                "auth": {"type": "access_token", "accessToken": {"displayName": "local", "role": role}}}  # fmt: skip

    def create_repo(self, headers, body: dict) -> tuple[int, dict]:
        user = self._user(headers, "write")
        if body.get("type", "model") not in (None, "model"):
            raise HubError(400, "this local hub serves model repos only")
        namespace = body.get("organization") or user
        if namespace != user:
            raise HubError(403, f"{user} cannot create repos in {namespace}")
        name = body.get("name") or ""
        if not re.fullmatch(r"[\w.-]+", name):
            raise HubError(400, f"invalid repo name {name!r}")
        repo_id = f"{namespace}/{name}"
        with self._lock:
            url = f"{self.endpoint}/{repo_id}"
            if repo_id in self._repos:
                return 409, {"error": "You already created this model repo", "url": url}
            private = body.get("private")
            if private is None:
                private = body.get("visibility") == "private"
            repo = _Repo(repo_id, bool(private))
            tree = {".gitattributes": self._entry(DEFAULT_GITATTRIBUTES.encode(), lfs=False)}
            repo.refs["main"] = self._new_commit(repo, None, tree, "initial commit", "", user).oid
            self._repos[repo_id] = repo
        return 200, {"url": url, "name": repo_id, "id": repo_id}

    def validate_yaml(self, body: dict) -> tuple[int, dict]:
        content = body.get("content") or ""
        match = re.match(r"^---\n(.*?)\n---", content, flags=re.DOTALL)
        if match is None:
            return 200, {
                "errors": [],
                "warnings": [{"message": "empty or missing yaml metadata in repo card"}],
            }
        try:
            import yaml

            metadata = yaml.safe_load(match.group(1)) or {}
        except ImportError:
            return 200, {"errors": [], "warnings": []}
        except Exception as error:  # yaml.YAMLError
            return 400, {"errors": [{"message": f"invalid YAML: {error}"}]}
        base = metadata.get("base_model") if isinstance(metadata, dict) else None
        for name in [base] if isinstance(base, str) else (base or []):
            if not re.fullmatch(r"[\w.-]+/[\w.-]+", str(name)):
                return 400, {"errors": [{"message": f'"base_model" must be a valid model id, got {name!r}'}]}
        return 200, {"errors": [], "warnings": []}

    def repo_info(self, repo_id: str, revision: str, headers) -> dict:
        with self._lock:
            repo = self._readable(repo_id, headers)
            commit = self._commit(repo, revision)
            return {"id": repo_id, "modelId": repo_id, "author": repo_id.split("/")[0], "sha": commit.oid,
                    "private": repo.private, "lastModified": commit.date, "tags": [], "disabled": False,
                    "siblings": [{"rfilename": path} for path in sorted(commit.tree)]}  # fmt: skip

    def _commit(self, repo: _Repo, revision: str) -> _Commit:
        commit = repo.resolve(revision)
        if commit is None:
            raise HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")
        return commit

    def preupload(self, repo_id: str, revision: str, headers, body: dict) -> dict:
        with self._lock:
            repo = self._writable(repo_id, headers)
            tree = self._commit(repo, revision).tree
            files = []
            for item in body.get("files", []):
                path, size = item["path"], int(item["size"])
                existing = tree.get(path)
                oid = None
                if existing is not None:  # what the client compares its local oid with
                    oid = existing.sha256 if existing.lfs else existing.git_oid
                mode = "lfs" if self._is_lfs_path(tree, path, size) else "regular"
                files.append({"path": path, "uploadMode": mode, "shouldIgnore": False, "oid": oid})
            return {"files": files, "commitOid": self._commit(repo, revision).oid}

    def lfs_batch(self, repo_id: str, headers, body: dict) -> dict:
        with self._lock:
            self._writable(repo_id, headers)
        if body.get("operation") != "upload":
            raise HubError(400, "this local hub serves LFS uploads only (downloads go through /resolve)")
        if "basic" not in body.get("transfers", ["basic"]):
            raise HubError(400, "this local hub supports the 'basic' LFS transfer only")
        objects = []
        for item in body.get("objects", []):
            oid, size = item["oid"], int(item["size"])
            entry = {"oid": oid, "size": size, "authenticated": True}
            blob = self._blob(oid)
            if not (blob.exists() and blob.stat().st_size == size):
                sig = self._lfs_signature(repo_id, oid)
                entry["actions"] = {
                    "upload": {"href": f"{self.endpoint}/lfs-upload/{repo_id}/{oid}?sig={sig}", "header": {}},
                    "verify": {"href": f"{self.endpoint}/lfs-verify/{repo_id}", "header": {}},
                }
            objects.append(entry)
        return {"transfer": "basic", "objects": objects, "hash_algo": "sha256"}

    def lfs_upload(self, repo_id: str, oid: str, query: dict, content: bytes) -> dict:
        # Upload URLs stand for presigned storage URLs: no Authorization, a signature instead.
        expected = self._lfs_signature(repo_id, oid)
        if not hmac.compare_digest(query.get("sig", [""])[0], expected):
            raise HubError(403, "invalid or missing upload signature")
        if hashlib.sha256(content).hexdigest() != oid:
            raise HubError(400, f"uploaded content does not hash to {oid}")
        self._store_blob(content)
        return {}

    def lfs_verify(self, repo_id: str, headers, body: dict) -> dict:
        with self._lock:
            self._writable(repo_id, headers)
        blob = self._blob(body.get("oid", ""))
        if not (blob.exists() and blob.stat().st_size == int(body.get("size", -1))):
            raise HubError(404, f"LFS object {body.get('oid')} was not uploaded")
        return {}

    def commit(self, repo_id: str, revision: str, headers, params: dict, lines: list[dict]) -> dict:
        if params.get("create_pr"):
            raise HubError(400, "this local hub does not support pull requests")
        with self._lock:
            repo = self._writable(repo_id, headers)
            user = self._user(headers, "write")
            head = self._commit(repo, revision)
            if revision not in repo.refs:
                raise HubError(400, f"can only commit to a branch; {revision!r} is not one")
            if not lines or lines[0].get("key") != "header":
                raise HubError(400, "the commit payload must start with a header line")
            header = lines[0]["value"]
            parent = header.get("parentCommit")
            if parent is not None and parent != head.oid:
                raise HubError(412, f"parentCommit {parent} is not the head of {revision} ({head.oid})")
            tree = dict(head.tree)  # applied to a copy: the commit lands whole or not at all
            for line in lines[1:]:
                key, value = line.get("key"), line.get("value", {})
                path = value.get("path", "")
                if key == "file":
                    if value.get("encoding", "base64") != "base64":
                        raise HubError(400, f"unsupported encoding {value.get('encoding')!r} for {path}")
                    content = base64.b64decode(value["content"])
                    tree[path] = self._entry(content, lfs=False)
                elif key == "lfsFile":
                    sha256, size = value["oid"], int(value["size"])
                    blob = self._blob(sha256)
                    if not (blob.exists() and blob.stat().st_size == size):
                        raise HubError(422, f"LFS object {sha256} for {path} has not been uploaded")
                    tree[path] = _Entry(sha256, size, True, git_blob_oid(lfs_pointer(sha256, size)))
                elif key == "deletedFile":
                    if path not in tree:
                        raise HubError(404, f"A file with this name doesn't exist: {path}", "EntryNotFound")
                    del tree[path]
                elif key == "deletedFolder":
                    prefix = path.rstrip("/") + "/"
                    removed = [p for p in tree if p.startswith(prefix)]
                    if not removed:
                        raise HubError(404, f"A folder with this name doesn't exist: {path}", "EntryNotFound")
                    for p in removed:
                        del tree[p]
                else:
                    raise HubError(400, f"unsupported commit operation {key!r}")
            commit = self._new_commit(
                repo, head, tree, header.get("summary", ""), header.get("description", ""), user
            )
            repo.refs[revision] = commit.oid
            return {"commitUrl": f"{self.endpoint}/{repo_id}/commit/{commit.oid}", "commitOid": commit.oid,
                    "pullRequestUrl": None}  # fmt: skip

    def tree(self, repo_id: str, revision: str, path: str, recursive: bool, headers) -> list[dict]:
        with self._lock:
            commit = self._commit(self._readable(repo_id, headers), revision)
            prefix = path.strip("/") + "/" if path.strip("/") else ""
            if prefix and not any(p.startswith(prefix) for p in commit.tree):
                raise HubError(404, f"{path} does not exist at {revision}", "EntryNotFound")
            out, folders = [], set()
            for file_path in sorted(commit.tree):
                if not file_path.startswith(prefix):
                    continue
                rest = file_path[len(prefix) :]
                parts = rest.split("/")
                for depth in range(1, len(parts)):
                    folder = prefix + "/".join(parts[:depth])
                    if folder not in folders and (recursive or depth == 1):
                        folders.add(folder)
                        out.append({"type": "directory", "path": folder,
                                    "oid": hashlib.sha1(f"{commit.oid}:{folder}".encode()).hexdigest()})  # fmt: skip
                if len(parts) > 1 and not recursive:
                    continue
                entry = commit.tree[file_path]
                item = {"type": "file", "path": file_path, "size": entry.size, "oid": entry.git_oid}
                if entry.lfs:
                    item["lfs"] = {"oid": entry.sha256, "size": entry.size,
                                   "pointerSize": len(lfs_pointer(entry.sha256, entry.size))}  # fmt: skip
                out.append(item)
            return out

    def list_commits(self, repo_id: str, revision: str, headers) -> list[dict]:
        with self._lock:
            repo = self._readable(repo_id, headers)
            commit, out = self._commit(repo, revision), []
            while commit is not None:
                out.append({"id": commit.oid, "title": commit.title, "message": commit.message,
                            "date": commit.date, "authors": [{"user": commit.author}]})  # fmt: skip
                commit = repo.commits.get(commit.parent) if commit.parent else None
            return out

    def resolve(self, repo_id: str, revision: str, path: str, headers) -> tuple[_Commit, _Entry]:
        with self._lock:
            commit = self._commit(self._readable(repo_id, headers), revision)
            entry = commit.tree.get(path)
            if entry is None:
                raise HubError(404, f"Entry not found: {path}", "EntryNotFound")
            return commit, entry

    def take_stall(self, method: str, path: str) -> float | None:
        return self.take_failure(method, path, self._stalls)

    def take_failure(self, method: str, path: str, failures: list | None = None) -> int | None:
        with self._lock:
            for failure in self._failures if failures is None else failures:
                if failure.remaining > 0 and failure.method == method and failure.pattern.search(path):
                    failure.remaining -= 1
                    return failure.status
        return None


class _Handler(http.server.BaseHTTPRequestHandler):
    hub: LocalHub  # set on the per-server subclass
    protocol_version = "HTTP/1.1"  # keep-alive, as the client expects; every reply has a length

    def log_message(self, format, *args):  # quiet: tests read hub.requests instead
        pass

    def do_GET(self):
        self._dispatch("GET")

    def do_HEAD(self):
        self._dispatch("HEAD")

    def do_POST(self):
        self._dispatch("POST")

    def do_PUT(self):
        self._dispatch("PUT")

    # --- plumbing ---------------------------------------------------------------------

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _reply(
        self, status: int, body: bytes = b"", headers: dict | None = None, content_type="application/json"
    ):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, status: int, obj, headers: dict | None = None):
        self._reply(status, json.dumps(obj).encode(), headers)

    def _error(self, error: HubError):
        headers = {"X-Error-Message": error.message}
        if error.code:
            headers["X-Error-Code"] = error.code
        self._json(error.status, {"error": error.message}, headers)

    def _dispatch(self, method: str):
        split = urlsplit(self.path)
        path, query = split.path, parse_qs(split.query)
        body = self._body() if method in ("POST", "PUT") else b""
        hub = self.hub
        with hub._lock:
            hub.requests.append((method, path))
        stall = hub.take_stall(method, path)
        if stall is not None:
            hub._stopping.wait(stall)
            self.close_connection = True
            return
        status = hub.take_failure(method, path)
        if status is not None:
            return self._error(HubError(status, f"injected failure for {method} {path}"))
        try:
            self._route(method, path, query, body)
        except HubError as error:
            self._error(error)
        except (KeyError, ValueError, TypeError) as error:
            self._error(HubError(400, f"malformed request: {error!r}"))

    def _route(self, method: str, path: str, query: dict, body: bytes):
        hub, headers = self.hub, self.headers

        def payload() -> dict:
            return json.loads(body or b"{}")

        def match(pattern: str):
            return re.fullmatch(pattern, path)

        if method == "GET" and path == "/api/whoami-v2":
            return self._json(200, hub.whoami(headers))
        if method == "POST" and path == "/api/repos/create":
            status, obj = hub.create_repo(headers, payload())
            return self._json(status, obj)
        if method == "POST" and path == "/api/validate-yaml":
            status, obj = hub.validate_yaml(payload())
            return self._json(status, obj)
        if method == "GET" and (m := match(rf"/api/models/{_REPO}(?:/revision/(?P<rev>[^/]+))?")):
            return self._json(200, hub.repo_info(m["repo"], unquote(m["rev"] or "main"), headers))
        if method == "POST" and (m := match(rf"/api/models/{_REPO}/preupload/(?P<rev>[^/]+)")):
            return self._json(200, hub.preupload(m["repo"], unquote(m["rev"]), headers, payload()))
        if method == "POST" and (m := match(rf"/api/models/{_REPO}/commit/(?P<rev>[^/]+)")):
            lines = [json.loads(line) for line in body.splitlines() if line.strip()]
            params = {k: v[0] for k, v in query.items()}
            return self._json(200, hub.commit(m["repo"], unquote(m["rev"]), headers, params, lines))
        if method == "GET" and (m := match(rf"/api/models/{_REPO}/tree/(?P<rev>[^/]+)(?:/(?P<path>.+))?")):
            recursive = query.get("recursive", ["false"])[0].lower() in ("1", "true")
            items = hub.tree(m["repo"], unquote(m["rev"]), unquote(m["path"] or ""), recursive, headers)
            return self._json(200, items)
        if method == "GET" and (m := match(rf"/api/models/{_REPO}/commits/(?P<rev>[^/]+)")):
            return self._json(200, hub.list_commits(m["repo"], unquote(m["rev"]), headers))
        if method == "POST" and (m := match(rf"/{_REPO}\.git/info/lfs/objects/batch")):
            batch = hub.lfs_batch(m["repo"], headers, payload())
            return self._reply(200, json.dumps(batch).encode(), content_type="application/vnd.git-lfs+json")
        if method == "PUT" and (m := match(rf"/lfs-upload/{_REPO}/(?P<oid>[0-9a-f]{{64}})")):
            return self._json(200, hub.lfs_upload(m["repo"], m["oid"], query, body))
        if method == "POST" and (m := match(rf"/lfs-verify/{_REPO}")):
            return self._json(200, hub.lfs_verify(m["repo"], headers, payload()))
        if method in ("GET", "HEAD") and (m := match(rf"/{_REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)")):
            return self._send_file(m["repo"], unquote(m["rev"]), unquote(m["path"]))
        raise HubError(404, f"no route for {method} {path} on this local hub")

    def _send_file(self, repo_id: str, revision: str, path: str):
        commit, entry = self.hub.resolve(repo_id, revision, path, self.headers)
        content = self.hub._blob(entry.sha256).read_bytes()
        etag = entry.sha256 if entry.lfs else entry.git_oid
        headers = {"X-Repo-Commit": commit.oid, "ETag": f'"{etag}"', "Accept-Ranges": "bytes",
                   "Content-Disposition": f"inline; filename*=UTF-8''{quote(path.rsplit('/', 1)[-1])}"}  # fmt: skip
        if entry.lfs:
            headers["X-Linked-Etag"] = f'"{etag}"'
            headers["X-Linked-Size"] = str(entry.size)
        status = 200
        requested = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", "") or "")
        if requested and self.command == "GET":
            start = int(requested[1])
            end = int(requested[2]) if requested[2] else len(content) - 1
            headers["Content-Range"] = f"bytes {start}-{end}/{len(content)}"
            content, status = content[start : end + 1], 206
        self._reply(status, content, headers, content_type="application/octet-stream")


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
