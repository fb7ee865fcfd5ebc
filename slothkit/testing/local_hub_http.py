"""The HTTP side of ``LocalHub``: read each request, answer injected failures and stalls,
route it to the hub's API method (``local_hub_api``), and write the reply.
"""

from __future__ import annotations

import http.server
import json
import re
import socket
import struct
from typing import TYPE_CHECKING
from urllib.parse import parse_qs, quote, unquote, urlsplit

from slothkit.testing.local_hub_records import HubError

if TYPE_CHECKING:
    from slothkit.testing.local_hub import LocalHub

_REPO = r"(?P<repo>[\w.-]+/[\w.-]+)"


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
        hub = self.hub
        with hub._lock:
            hub.requests.append((method, path))
        if hub.killed.is_set() or hub.take_kill(method, path):
            return self._die()
        if hub.frozen.is_set() or hub.take_freeze(method, path):
            return self._freeze()
        body = self._body() if method in ("POST", "PUT") else b""
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

    def _freeze(self):
        """No answer, ever (until the hub stops); the body is left unread, as a stopped
        process leaves it in the socket's buffer."""
        if not self.hub.frozen.is_set():
            self.hub.freeze()
        self.hub._stopping.wait()
        self.close_connection = True

    def _die(self):
        """Read part of the body (the process dies mid-upload), then reset the connection."""
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length // 2)
        if not self.hub.killed.is_set():
            self.hub.kill()
        # SO_LINGER with a zero timeout: close() sends a reset, as the kernel does for a killed process.
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.close_connection = True

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
        if method == "GET" and (m := match(rf"/api/models/{_REPO}/xet-write-token/(?P<rev>[^/]+)")):
            body, token_headers = hub.xet_write_token(m["repo"], headers)
            return self._json(200, body, token_headers)
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
