"""What ``LocalHub`` stores: repos, their commits (full snapshots of {path: file entry}),
the failures tests inject; and the git and LFS conventions of the Hub it follows.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re

LFS_SIZE_THRESHOLD = 10 * 1024 * 1024  # the Hub stores files above 10 MB in LFS whatever their name
DEFAULT_GITATTRIBUTES = "".join(
    f"{pattern} filter=lfs diff=lfs merge=lfs -text\n"
    for pattern in ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.ckpt", "*.gguf", "*.model", "*.onnx",
                    "*.h5", "*.msgpack", "*.npy", "*.npz", "*.pkl", "*.tar.*", "*.zip")
)  # fmt: skip


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
