"""The Hub API's operations on a ``LocalHub``'s repos, one method per endpoint
(``local_hub``'s docstring lists them; ``local_hub_http`` routes requests to them).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import time

from slothkit.testing.local_hub_records import (
    DEFAULT_GITATTRIBUTES,
    HubError,
    _Commit,
    _Entry,
    _Repo,
    git_blob_oid,
    lfs_pointer,
)


class HubAPI:
    """What each endpoint does, as methods of ``LocalHub``, whose storage, auth and lock
    (``_lock``, ``_repos``, ``_blob``, ``_entry``, ``_user``, ``_readable``, ...) they use."""

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

    def xet_write_token(self, repo_id: str, headers) -> tuple[dict, dict]:
        """The Xet storage URL and a write token for it (body and headers), when the hub
        offers Xet (``offer_xet_with_stalled_storage``); hf_xet asks for them itself."""
        self._user(headers, "write")
        if self.xet_storage_url is None:
            raise HubError(404, f"this local hub offers no Xet storage for {repo_id}")
        expires = int(time.time()) + 3600
        body = {"casUrl": self.xet_storage_url, "accessToken": "xet-local-token", "exp": expires}
        return body, {"X-Xet-Cas-Url": self.xet_storage_url, "X-Xet-Access-Token": "xet-local-token",
                      "X-Xet-Token-Expiration": str(expires)}  # fmt: skip

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
