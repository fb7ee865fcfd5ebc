"""GGUF export of Gemma 3 (llama.cpp's gemma3 architecture) on the tiny random checkpoint of
slothkit.testing: two layers, the first sliding (window 16, rope base 10,000), the second
global (rope base 1,000,000). The file is read back with gguf.GGUFReader and run by
llama.cpp on a prompt far longer than the window, so that which layer slides, and with
which rope base, decides the logits."""

import dataclasses
import functools
import importlib.util
import math
import types

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from slothkit.export.gguf import attention, write_gguf
from slothkit.export.gguf import verify as gguf_verify
from slothkit.export.gguf.tensor_types import quantization_method
from slothkit.export.gguf.verify import verify_gguf
from slothkit.models import architecture_named
from slothkit.testing import CORPUS, tiny_model_path

T = gguf.GGMLQuantizationType
METHODS = ("f16", "bf16", "q8_0", "q4_0", "q4_k_m", "q5_k_m", "q6_k")
SIZES = dict(hidden_size=256, intermediate_size=512)  # every row a multiple of 256 (K-quants)
LONG = CORPUS[:400]  # 173 tokens: ten times the window
PROMPTS = (LONG, "Sloths move slowly because")
LAYER_TENSORS = (
    "attn_norm", "attn_q", "attn_k", "attn_v", "attn_q_norm", "attn_k_norm", "attn_output",
    "post_attention_norm", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down", "post_ffw_norm",
)  # fmt: skip
needs_llama_cpp = pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None,
    reason="llama-cpp-python is not installed (pip install 'slothkit[gguf]'); it runs the GGUF files",
)


@functools.cache
def tiny():
    path = tiny_model_path("gemma3", **SIZES)
    return AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32
    ).eval(), AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """exported(method) -> path of the GGUF file, written once per module."""
    root = tmp_path_factory.mktemp("gemma3-gguf")

    @functools.cache
    def get(method):
        model, tokenizer = tiny()
        return write_gguf(model, root / f"gemma3.{method}.gguf", tokenizer, quantization_method(method))

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
    assert field(reader, "general.architecture") == "gemma3"
    assert field(reader, "gemma3.block_count") == 2
    assert (
        field(reader, "gemma3.attention.key_length") == field(reader, "gemma3.attention.value_length") == 256
    )
    assert field(reader, "gemma3.rope.freq_base") == 1_000_000.0  # the global layer's
    assert field(reader, "gemma3.rope.freq_base_swa") == 10_000.0  # the sliding layer's
    assert field(reader, "gemma3.attention.sliding_window") == 16
    assert field(reader, "gemma3.attention.sliding_window_pattern") == [True, False]  # True: slides
    assert "gemma3.final_logit_softcapping" not in reader.fields
    assert field(reader, "tokenizer.ggml.model") == "llama"
    assert field(reader, "tokenizer.ggml.bos_token_id") == tokenizer.bos_token_id
    assert field(reader, "tokenizer.ggml.add_bos_token") is True

    tensors = {t.name: t for t in reader.tensors}
    names = {"token_embd.weight", "output_norm.weight"}  # no output.weight: the head is tied
    names |= {f"blk.{i}.{t}.weight" for i in range(2) for t in LAYER_TENSORS}
    assert set(tensors) == names
    for name, tensor in tensors.items():
        if name.endswith("_norm.weight"):
            assert tensor.tensor_type == T.F32, name
    if method == "q4_k_m":  # llama-quantize's mix: the tied embeddings as the output, Q6_K
        assert tensors["token_embd.weight"].tensor_type == T.Q6_K
        assert tensors["blk.0.attn_q.weight"].tensor_type == T.Q4_K
        assert tensors["blk.1.ffn_down.weight"].tensor_type == T.Q6_K  # use_more_bits(1, 2)


def test_every_norm_holds_one_plus_w(exported):
    """Gemma3RMSNorm scales by (1 + w), llama.cpp's by w: each of the six per-layer norms and
    the final one is stored as 1 + w, in F32; projections are stored unpermuted."""
    model, _ = tiny()
    reader = gguf.GGUFReader(exported("f16"))
    layer = model.model.layers[1]
    norms = {
        "blk.1.attn_norm.weight": layer.input_layernorm,
        "blk.1.attn_q_norm.weight": layer.self_attn.q_norm,
        "blk.1.attn_k_norm.weight": layer.self_attn.k_norm,
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
def test_without_the_layer_pattern_llama_cpp_slides_the_wrong_layers(tmp_path, monkeypatch):
    """Written as if llama.cpp applied no per-layer window, the file leaves llama.cpp its
    default (five sliding layers, then a global one): both tiny layers slide, and past the
    window the logits leave HF's by far more than f16 rounds (measured 0.52 against 0.001)."""
    model, tokenizer = tiny()
    record = architecture_named("gemma3")
    wrong = dataclasses.replace(record, gguf=dataclasses.replace(record.gguf, windowed_layers=False))
    path = write_gguf(model, tmp_path / "no-pattern.gguf", tokenizer, "f16", arch=wrong)
    assert "gemma3.attention.sliding_window_pattern" not in gguf.GGUFReader(path).fields
    monkeypatch.setitem(gguf_verify.TOLERANCES, "f16", math.inf)
    report = verify_gguf(path, model, tokenizer, "f16", prompts=(LONG,))
    assert report.logit_error > 0.2  # ten times f16's tolerance


@needs_llama_cpp
def test_llama_cpp_tokenises_like_hf(exported):
    import llama_cpp

    _, tokenizer = tiny()
    llm = llama_cpp.Llama(model_path=str(exported("q8_0")), vocab_only=True, verbose=False)
    try:
        for text in (LONG, "Unseen: naïve café, 東京 ☃", "def add(a, b):\n    return a + b\n"):
            assert llm.tokenize(text.encode(), add_bos=True, special=False) == tokenizer(text)["input_ids"]
    finally:
        llm.close()


# ---------------------------------------------------------------------------------------
# What llama.cpp's gemma3 graph cannot reproduce is refused
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("query_pre_attn_scalar", 128, r"scales queries by 1/sqrt\(256\).*query_pre_attn_scalar is 128"),
        ("final_logit_softcapping", 30.0, "applies no final_logit_softcapping"),
        ("attn_logit_softcapping", 50.0, "applies no attn_logit_softcapping"),
        ("use_bidirectional_attention", True, "attends causally"),
        ("sliding_window", None, "needs the sliding window size"),
    ],
)
def test_attention_llama_cpp_would_compute_differently_is_refused(key, value, match, tmp_path, monkeypatch):
    model, tokenizer = tiny()
    monkeypatch.setattr(model.config, key, value)
    with pytest.raises((ValueError, NotImplementedError), match=match):
        write_gguf(model, tmp_path / "x.gguf", tokenizer, "f16")
    assert not (tmp_path / "x.gguf").exists()


def test_scaled_rope_on_sliding_layers_is_refused(tmp_path, monkeypatch):
    model, tokenizer = tiny()
    rope = {**model.config.rope_parameters}
    rope["sliding_attention"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10_000.0}
    monkeypatch.setattr(model.config, "rope_parameters", rope)
    with pytest.raises(NotImplementedError, match="sliding layers use rope type 'linear'"):
        write_gguf(model, tmp_path / "x.gguf", tokenizer, "f16")


def test_transformers_4_configs_give_the_same_attention():
    """transformers 4 spelled Gemma 3's rope as rope_theta (global), rope_local_base_freq and
    rope_scaling, and its layers as sliding_window_pattern; transformers 5 as rope_parameters
    per layer type and layer_types. Both read the same."""
    v4 = types.SimpleNamespace(
        rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0}, sliding_window_pattern=6, num_hidden_layers=8,
    )  # fmt: skip
    v5 = types.SimpleNamespace(
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
        layer_types=["sliding_attention"] * 5 + ["full_attention"] + ["sliding_attention"] * 2,
        num_hidden_layers=8,
    )
    for config in (v4, v5):
        full, sliding = attention.rope_parameters(config)
        assert full == {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0}
        assert sliding == {"rope_type": "default", "rope_theta": 10_000.0}
        assert attention.sliding_layers(config) == (True,) * 5 + (False,) + (True,) * 2
    llama = types.SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": 500_000.0})
    assert attention.rope_parameters(llama) == ({"rope_type": "default", "rope_theta": 500_000.0}, None)
