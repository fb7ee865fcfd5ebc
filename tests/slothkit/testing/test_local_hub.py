"""The LocalHub answers the real huggingface_hub client as the Hub would."""

import hashlib
import json
import os
import pathlib
import subprocess
import sys

import pytest
from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi, hf_hub_download
from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError, RevisionNotFoundError

from slothkit.testing.local_hub import LocalHub
from slothkit.testing.local_hub_records import git_blob_oid

REPO = "local-user/scratch"


@pytest.fixture
def api(local_hub):
    api = HfApi(endpoint=local_hub.endpoint, token="hf_writer")
    api.create_repo(REPO)
    return api


def test_create_repo_conflicts_unless_exist_ok(api):
    with pytest.raises(HfHubHTTPError, match="409"):
        api.create_repo(REPO)
    assert api.create_repo(REPO, exist_ok=True).repo_id == REPO
    assert api.model_info(REPO).siblings[0].rfilename == ".gitattributes"


def test_files_by_size_and_pattern_go_regular_or_lfs(api, local_hub, tmp_path):
    small, weights = b"small text\n", bytes(range(256)) * 64
    api.create_commit(REPO, operations=[
        CommitOperationAdd("notes/readme.txt", small),
        CommitOperationAdd("weights/w.safetensors", weights),
    ], commit_message="two files")  # fmt: skip
    # the small text file travels in the commit, the .safetensors through the LFS batch API
    assert sum(method == "PUT" for method, _ in local_hub.requests) == 1

    tree = {f.path: f for f in api.list_repo_tree(REPO, recursive=True)}
    assert tree["notes/readme.txt"].blob_id == git_blob_oid(small) and tree["notes/readme.txt"].lfs is None
    assert tree["weights/w.safetensors"].lfs.sha256 == hashlib.sha256(weights).hexdigest()
    assert {"notes", "weights"} <= set(tree)  # folders listed too
    top = sorted(f.path for f in api.list_repo_tree(REPO))
    assert top == [".gitattributes", "notes", "weights"]
    assert [f.path for f in api.list_repo_tree(REPO, path_in_repo="notes")] == ["notes/readme.txt"]

    path = hf_hub_download(REPO, "weights/w.safetensors", endpoint=local_hub.endpoint, local_dir=tmp_path)
    assert pathlib.Path(path).read_bytes() == weights


def test_commits_are_all_or_nothing_and_check_the_parent(api, local_hub):
    first = api.create_commit(REPO, [CommitOperationAdd("a.txt", b"a")], commit_message="a")
    with pytest.raises(EntryNotFoundError):  # one bad operation: the whole commit is refused
        api.create_commit(REPO, [CommitOperationAdd("b.txt", b"b"), CommitOperationDelete("missing.txt")],
                          commit_message="bad")  # fmt: skip
    assert set(local_hub.files(REPO)) == {".gitattributes", "a.txt"}

    api.create_commit(REPO, [CommitOperationAdd("c.txt", b"c")], commit_message="c")
    with pytest.raises(HfHubHTTPError, match="412"):
        api.create_commit(
            REPO, [CommitOperationAdd("d.txt", b"d")], commit_message="d", parent_commit=first.oid
        )
    assert [c.title for c in api.list_repo_commits(REPO)] == ["c", "a", "initial commit"]
    # older revisions stay readable
    assert set(local_hub.files(REPO, revision=first.oid)) == {".gitattributes", "a.txt"}
    with pytest.raises(RevisionNotFoundError):
        api.model_info(REPO, revision="no-such-branch")


def test_read_token_cannot_write(api, local_hub):
    reader = HfApi(endpoint=local_hub.endpoint, token="hf_reader")
    assert reader.whoami()["auth"]["accessToken"]["role"] == "read"
    with pytest.raises(HfHubHTTPError, match="403"):
        reader.create_commit(REPO, [CommitOperationAdd("x.txt", b"x")], commit_message="x")
    with pytest.raises(HfHubHTTPError, match="Invalid user token"):
        HfApi(endpoint=local_hub.endpoint).whoami(token="hf_wrong")


def test_client_env_names_the_server():
    with LocalHub() as hub:
        env = hub.client_env()
        assert env == {"HF_ENDPOINT": hub.endpoint, "HF_HUB_DISABLE_XET": "1", "HF_TOKEN": hub.token}
        assert hub.endpoint.startswith("http://127.0.0.1:")
        root = hub.root
    assert not root.exists()  # its own temporary folder is removed on stop


def test_a_subprocess_client_configured_by_environment_only(local_hub):
    # How a notebook kernel is pointed at the server: HF_ENDPOINT / HF_HUB_DISABLE_XET / HF_TOKEN
    # set before huggingface_hub is imported. The .safetensors file takes the LFS path.
    code = (
        "from huggingface_hub import HfApi\n"
        "api = HfApi()\n"
        "api.create_repo('local-user/from-kernel', exist_ok=True)\n"
        "api.upload_file(path_or_fileobj=b'x' * 5000, path_in_repo='w.safetensors', repo_id='local-user/from-kernel')\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")} | local_hub.client_env()
    env["HF_TOKEN"] = "hf_writer"
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120, capture_output=True)
    assert local_hub.files("local-user/from-kernel")["w.safetensors"] == b"x" * 5000
    assert any(method == "PUT" for method, _ in local_hub.requests)


def test_the_server_runs_as_its_own_process(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # the tests run offline otherwise
    process = subprocess.Popen([sys.executable, "-m", "slothkit.testing.local_hub", "--root", str(tmp_path)],
                               stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        env = json.loads(process.stdout.readline())
        api = HfApi(endpoint=env["HF_ENDPOINT"], token=env["HF_TOKEN"])
        assert api.whoami()["name"] == "local-user"
        api.create_repo("local-user/standalone")
        assert api.model_info("local-user/standalone").sha
    finally:
        process.terminate()
        assert process.wait(timeout=20) == 0
