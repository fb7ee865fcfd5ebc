"""GGUF export of Gemma 2 (llama.cpp's gemma2 architecture) on the tiny random checkpoint of
slothkit.testing: two layers, the first sliding (window 16), the second global, with the
attention scores soft-capped at 50 and the output logits at 30. The file is read back with
gguf.GGUFReader and run by llama.cpp on a prompt far longer than the window, so that which
layer slides, and both soft-caps, decide the logits."""

import functools
import importlib.util
import math

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from slothkit.export.gguf import verify as gguf_verify
from slothkit.export.gguf import write_gguf
from slothkit.export.gguf.tensor_types import quantization_method
from slothkit.export.gguf.verify import verify_gguf
from slothkit.testing import CORPUS, tiny_model_path

T = gguf.GGMLQuantizationType
METHODS = ("f16", "bf16", "q8_0", "q4_0", "q4_k_m", "q5_k_m", "q6_k")
SIZES = dict(hidden_size=256, intermediate_size=512)  # every row a multiple of 256 (K-quants)
LONG = CORPUS[:400]  # 173 tokens: ten times the window
PROMPTS = (LONG, "Sloths move slowly because")
LAYER_TENSORS = (
    "attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "post_attention_norm",
    "ffn_norm", "ffn_gate", "ffn_up", "ffn_down", "post_ffw_norm",
)  # fmt: skip
needs_llama_cpp = pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None,
    reason="llama-cpp-python is not installed (pip install 'slothkit[gguf]'); it runs the GGUF files",
)


@functools.cache
def tiny():
    path = tiny_model_path("gemma2", **SIZES)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    return model.eval(), AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """exported(method) -> path of the GGUF file, written once per module."""
    root = tmp_path_factory.mktemp("gemma2-gguf")

    @functools.cache
    def get(method):
        model, tokenizer = tiny()
        return write_gguf(model, root / f"gemma2.{method}.gguf", tokenizer, quantization_method(method))

    return get


def field(reader, key):
    return reader.fields[key].contents()


def _stored(reader, name):
    t = next(t for t in reader.tensors if t.name == name)
    values = gguf.quants.dequantize(np.array(t.data), t.tensor_type)
    return torch.from_numpy(np.array(values, dtype=np.float32)).reshape(
        tuple(reversed([int(n) for n in t.shape]))
    )


# ---------------------------------------------------------------------------------------
# The file, read back
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["f16", "q4_k_m"])
def test_metadata_and_tensors(method, exported):
    model, tokenizer = tiny()
    reader = gguf.GGUFReader(exported(method))
    assert field(reader, "general.architecture") == "gemma2"
    assert field(reader, "gemma2.block_count") == 2
    assert (
        field(reader, "gemma2.attention.key_length") == field(reader, "gemma2.attention.value_length") == 256
    )
    assert field(reader, "gemma2.rope.freq_base") == 10_000.0
    assert field(reader, "gemma2.attention.sliding_window") == 16
    assert field(reader, "gemma2.attention.sliding_window_pattern") == [True, False]  # True: slides
    assert field(reader, "gemma2.attn_logit_softcapping") == 50.0
    assert field(reader, "gemma2.final_logit_softcapping") == 30.0
    assert field(reader, "tokenizer.ggml.model") == "llama"
    assert field(reader, "tokenizer.ggml.bos_token_id") == tokenizer.bos_token_id

    tensors = {t.name: t for t in reader.tensors}
    names = {"token_embd.weight", "output_norm.weight"}  # no output.weight: the head is tied
    names |= {f"blk.{i}.{t}.weight" for i in range(2) for t in LAYER_TENSORS}
    assert set(tensors) == names
    for name, tensor in tensors.items():
        if name.endswith("_norm.weight"):
            assert tensor.tensor_type == T.F32, name


def test_every_norm_holds_one_plus_w(exported):
    """Gemma2RMSNorm scales by (1 + w), llama.cpp's by w: each of the four per-layer norms and
    the final one is stored as 1 + w, in F32; projections are stored unpermuted."""
    model, _ = tiny()
    reader = gguf.GGUFReader(exported("f16"))
    layer = model.model.layers[1]
    norms = {
        "blk.1.attn_norm.weight": layer.input_layernorm,
        "blk.1.post_attention_norm.weight": layer.post_attention_layernorm,
        "blk.1.ffn_norm.weight": layer.pre_feedforward_layernorm,
        "blk.1.post_ffw_norm.weight": layer.post_feedforward_layernorm,
        "output_norm.weight": model.model.norm,
    }
    for name, module in norms.items():
        assert torch.equal(_stored(reader, name), module.weight.detach().float() + 1), name
    q = layer.self_attn.q_proj.weight.detach()
    assert torch.allclose(_stored(reader, "blk.1.attn_q.weight"), q, rtol=1e-3, atol=1e-4)


# ---------------------------------------------------------------------------------------
# llama.cpp runs the files
# ---------------------------------------------------------------------------------------


@needs_llama_cpp
@pytest.mark.parametrize("method", METHODS)
def test_llama_cpp_logits_and_greedy_tokens_match_hf(method, exported):
    model, tokenizer = tiny()
    path = exported(method)
    exact = verify_gguf(path, model, tokenizer, method, prompts=PROMPTS, reference="gguf_weights")
    assert exact.logit_error < gguf_verify.GGUF_WEIGHTS_TOLERANCE and exact.greedy_tokens == 12
    assert exact.weight_error < gguf_verify.WEIGHT_TOLERANCES[method]
    report = verify_gguf(path, model, tokenizer, method, prompts=PROMPTS)
    assert report.logit_error < gguf_verify.TOLERANCES[method]
    assert exact.logit_error <= report.logit_error + 0.01


@needs_llama_cpp
@pytest.mark.parametrize("key", ["attn_logit_softcapping", "final_logit_softcapping"])
def test_llama_cpp_applies_the_files_soft_caps(key, tmp_path, monkeypatch):
    """A model with a tighter cap (2) written as such gives HF's logits again through llama.cpp,
    so llama.cpp reads the cap from the file; against the same model with the default cap,
    the file's logits leave HF's by far more than f16 rounds (measured 0.001 against 0.23)."""
    model, tokenizer = tiny()
    monkeypatch.setattr(model.config, key, 2.0)
    if key == "attn_logit_softcapping":
        for layer in model.model.layers:
            monkeypatch.setattr(layer.self_attn, key, 2.0)
    path = write_gguf(model, tmp_path / "capped.gguf", tokenizer, "f16")
    assert field(gguf.GGUFReader(path), f"gemma2.{key}") == 2.0
    report = verify_gguf(path, model, tokenizer, "f16", prompts=(LONG,))
    assert report.logit_error < gguf_verify.TOLERANCES["f16"]

    default = 50.0 if key == "attn_logit_softcapping" else 30.0
    monkeypatch.setattr(model.config, key, default)
    if key == "attn_logit_softcapping":
        for layer in model.model.layers:
            monkeypatch.setattr(layer.self_attn, key, default)
    tolerance = gguf_verify.TOLERANCES["f16"]
    monkeypatch.setitem(gguf_verify.TOLERANCES, "f16", math.inf)
    wrong = verify_gguf(path, model, tokenizer, "f16", prompts=(LONG,))
    assert wrong.logit_error > 5 * tolerance


# ---------------------------------------------------------------------------------------
# What llama.cpp's gemma2 graph cannot reproduce is refused
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("query_pre_attn_scalar", 128, r"scales queries by 1/sqrt\(256\).*query_pre_attn_scalar is 128"),
        ("final_logit_softcapping", None, "always applies final_logit_softcapping"),
        ("attn_logit_softcapping", None, "always applies attn_logit_softcapping"),
        ("layer_types", ["full_attention", "sliding_attention"], r"slides on the layers i with i % 2 != 1"),
        ("sliding_window", None, "needs the sliding window size"),
    ],
)
def test_attention_llama_cpp_would_compute_differently_is_refused(key, value, match, tmp_path, monkeypatch):
    model, tokenizer = tiny()
    monkeypatch.setattr(model.config, key, value)
    with pytest.raises((ValueError, NotImplementedError), match=match):
        write_gguf(model, tmp_path / "x.gguf", tokenizer, "f16")
    assert not (tmp_path / "x.gguf").exists()
