"""Publishing through the real huggingface_hub client to a LocalHub on 127.0.0.1."""

import json

import pytest
import torch
from huggingface_hub import HfApi, snapshot_download
from transformers import AutoModelForCausalLM

from slothkit.export import HubAuthError, push_folder_to_hub, push_to_hub_merged, save_pretrained_merged

SAME = 1e-4
REPO = "local-user/tiny-finetune"


def _download(hub, repo_id, tmp_path, name="download"):
    return snapshot_download(repo_id, endpoint=hub.endpoint, token="hf_writer", local_dir=tmp_path / name)


def _repo_files(hub, repo_id=REPO):
    return set(hub.files(repo_id))


@pytest.mark.parametrize("arch,save_method", [("llama", "merged_16bit"), ("gemma", "lora")])
def test_push_download_load_round_trip(arch, save_method, local_hub, make_lora_model, input_ids, logits,
                                       relative_error, assert_merged_16bit, tmp_path):  # fmt: skip
    model, tokenizer, path = make_lora_model(arch, seed=20)
    result = push_to_hub_merged(model, REPO, tokenizer, save_method=save_method, token="hf_writer",
                                endpoint=local_hub.endpoint, private=True)  # fmt: skip
    assert result.repo_id == REPO and result.save.save_method == save_method
    assert _repo_files(local_hub) == {".gitattributes", *result.files}
    assert [c["title"] for c in local_hub.commits(REPO)] == [
        f"Upload {save_method} model with slothkit",
        "initial commit",
    ]
    # the weights went through the LFS batch API, the small files inline in the commit
    assert ("POST", f"/{REPO}.git/info/lfs/objects/batch") in local_hub.requests
    assert any(method == "PUT" and path.startswith("/lfs-upload/") for method, path in local_hub.requests)

    folder = _download(local_hub, REPO, tmp_path)
    if save_method == "lora":
        from peft import PeftModel

        base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        loaded = PeftModel.from_pretrained(base, folder)
        assert relative_error(logits(loaded, input_ids), logits(model, input_ids)) < SAME
    else:
        assert_merged_16bit(folder, model, tokenizer, logits(model, input_ids))
    card = (tmp_path / "download" / "README.md").read_text()
    assert f"`{save_method}`" in card and str(path) in card


def test_private_repo_is_hidden_without_a_token(local_hub, make_lora_model):
    model, tokenizer, _ = make_lora_model("llama")
    push_to_hub_merged(model, REPO, tokenizer, save_method="lora", token="hf_writer",
                       endpoint=local_hub.endpoint, private=True)  # fmt: skip
    from huggingface_hub.errors import RepositoryNotFoundError

    with pytest.raises(RepositoryNotFoundError):
        HfApi(endpoint=local_hub.endpoint).model_info(REPO, token=False)
    assert HfApi(endpoint=local_hub.endpoint).model_info(REPO, token="hf_writer").private is True


@pytest.mark.parametrize(
    "token,message",
    [
        (None, "no Hugging Face token found"),
        ("hf_not_a_real_token", "rejected the token"),
        ("hf_reader", "read-only"),
    ],
    ids=["missing", "invalid", "read-only"],
)
def test_token_problems_say_how_to_log_in(token, message, local_hub, make_lora_model, monkeypatch, tmp_path):
    from slothkit.export import save as save_module

    model, tokenizer, _ = make_lora_model("llama")
    merges = []
    monkeypatch.setattr(save_module, "write_merged_checkpoint", lambda *a, **k: merges.append(1))
    with pytest.raises(HubAuthError, match=message) as error:
        push_to_hub_merged(model, REPO, tokenizer, token=token, endpoint=local_hub.endpoint)
    for advice in ("huggingface-cli login", "HF_TOKEN", "token="):
        assert advice in str(error.value)
    assert merges == []  # checked before any merging
    assert ("POST", "/api/repos/create") not in local_hub.requests


def test_env_token_is_used(local_hub, make_lora_model, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_writer")
    model, tokenizer, _ = make_lora_model("llama")
    result = push_to_hub_merged(model, REPO, tokenizer, save_method="lora", endpoint=local_hub.endpoint)
    assert "adapter_model.safetensors" in _repo_files(local_hub) and result.commit_oid


def test_failed_commit_then_retry_leaves_exactly_the_intended_files(local_hub, make_lora_model, tmp_path):
    model, tokenizer, _ = make_lora_model("mistral", seed=21)
    saved = save_pretrained_merged(model, tmp_path / "export", tokenizer)
    local_hub.fail_next("POST", r"/commit/", status=500)  # after the LFS uploads, at the commit
    with pytest.raises(Exception, match="500"):
        push_folder_to_hub(
            tmp_path / "export", REPO, token="hf_writer", endpoint=local_hub.endpoint, retries=0
        )
    assert _repo_files(local_hub) == {".gitattributes"}  # nothing partial is visible
    assert len(local_hub.commits(REPO)) == 1

    uploads_before = sum(method == "PUT" for method, _ in local_hub.requests)
    result = push_folder_to_hub(
        tmp_path / "export", REPO, token="hf_writer", endpoint=local_hub.endpoint, retries=0
    )
    assert _repo_files(local_hub) == {".gitattributes", *saved.files}
    assert len(local_hub.commits(REPO)) == 2
    assert sum(method == "PUT" for method, _ in local_hub.requests) == uploads_before  # blobs were kept
    assert (
        local_hub.files(REPO)["model.safetensors"] == (tmp_path / "export" / "model.safetensors").read_bytes()
    )

    # The same push again (say, after a lost reply) makes no second commit.
    again = push_folder_to_hub(tmp_path / "export", REPO, token="hf_writer", endpoint=local_hub.endpoint)
    assert again.commit_oid == result.commit_oid and len(local_hub.commits(REPO)) == 2


def test_failed_large_file_upload_is_retried_automatically(local_hub, make_lora_model, tmp_path):
    model, tokenizer, _ = make_lora_model("llama", seed=22)
    saved = save_pretrained_merged(model, tmp_path / "export", tokenizer, save_method="lora")
    # 507 is not among the statuses huggingface_hub retries itself; slothkit's retry handles it.
    local_hub.fail_next("PUT", r"^/lfs-upload/", status=507)
    push_folder_to_hub(tmp_path / "export", REPO, token="hf_writer", endpoint=local_hub.endpoint,
                       retries=1, retry_wait_s=0)  # fmt: skip
    assert _repo_files(local_hub) == {".gitattributes", *saved.files}
    assert len(local_hub.commits(REPO)) == 2
    # one LFS file (the adapter weights): the refused upload, then the retried one
    assert sum(method == "PUT" for method, _ in local_hub.requests) == 2


def test_pushing_another_export_replaces_the_previous_one(local_hub, make_lora_model, tmp_path):
    model, tokenizer, _ = make_lora_model("llama", seed=23)
    api = HfApi(endpoint=local_hub.endpoint, token="hf_writer")
    push_to_hub_merged(
        model, REPO, tokenizer, save_method="merged_16bit", token="hf_writer", endpoint=local_hub.endpoint
    )
    api.upload_file(path_or_fileobj=b"gguf bytes", path_in_repo="model-Q4_K_M.gguf", repo_id=REPO)
    lora = push_to_hub_merged(
        model, REPO, tokenizer, save_method="lora", token="hf_writer", endpoint=local_hub.endpoint
    )
    # config.json and model.safetensors of the merged export are gone; the unrelated GGUF stays
    assert _repo_files(local_hub) == {".gitattributes", "model-Q4_K_M.gguf", *lora.files}
    config = json.loads(local_hub.files(REPO)["adapter_config.json"])
    assert config["r"] == 4


def test_offline_mode_is_named_not_crashed(monkeypatch):
    from huggingface_hub import HfApi, constants

    from slothkit.export.hub import resolve_token

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ConnectionError, match="HF_HUB_OFFLINE"):
        resolve_token("hf_anything", HfApi())


@pytest.mark.parametrize(
    "repo_id", ["user/..", "user/.", "..", "../x", "user/a/b", "", "user/", "user/my model", None]
)
def test_an_invalid_repo_id_is_refused_before_any_request_or_save(
    repo_id, local_hub, make_lora_model, monkeypatch, tmp_path
):
    from slothkit.export import save as save_module
    from slothkit.export.gguf import push_to_hub_gguf
    from slothkit.export.gguf import writer as gguf_writer

    model, tokenizer, _ = make_lora_model("llama")
    saves = []
    monkeypatch.setattr(save_module, "write_merged_checkpoint", lambda *a, **k: saves.append("merged"))
    monkeypatch.setattr(gguf_writer, "save_pretrained_gguf", lambda *a, **k: saves.append("gguf"))
    folder = tmp_path / "saved"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    pushes = {
        "push_to_hub_merged": lambda: push_to_hub_merged(
            model, repo_id, tokenizer, token="hf_writer", endpoint=local_hub.endpoint
        ),
        "push_to_hub_gguf": lambda: push_to_hub_gguf(
            model, repo_id, tokenizer, token="hf_writer", endpoint=local_hub.endpoint
        ),
        "push_folder_to_hub": lambda: push_folder_to_hub(
            folder, repo_id, token="hf_writer", endpoint=local_hub.endpoint
        ),
    }
    for name, push in pushes.items():
        with pytest.raises(ValueError) as error:
            push()
        message = str(error.value)
        assert message.startswith(f"repo_id {repo_id!r} is not a Hub repo id"), (name, message)
        assert '"user-or-org/name"' in message and "'-', '_' or '.'" in message and "\n" not in message
    assert local_hub.requests == [] and saves == []  # no whoami, no merge, no GGUF written
