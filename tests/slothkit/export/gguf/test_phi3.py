"""GGUF export of Phi-3's long-context and windowed variants (llama.cpp's phi3 architecture)
on the tiny random checkpoint of slothkit.testing, reconfigured:

  longrope   LongRoPE with random short and long factors, original_max_position_embeddings
             256 and max_position_embeddings 1024 (Phi-3-mini-128k's 4096 and 131072 in
             small): llama.cpp rounds its context up to a multiple of 256, so 256 is the
             smallest original length at which it can run the short factors at all;
  window     sliding_window 16 on every layer (Phi-3-mini-4k's 2047 in small);
  partial    partial_rotary_factor 0.5 (Phi-4-mini rotates 3/4 of each head).

Each file is read back with gguf.GGUFReader and run by llama.cpp against the HF model."""

import functools
import importlib.util
import math

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from slothkit.export.gguf import longrope, write_gguf
from slothkit.export.gguf.metadata import hyperparameters
from slothkit.export.gguf.tensor_types import quantization_method
from slothkit.export.gguf.verify import (
    TOLERANCES,
    GGUFVerificationError,
    _hf_logits,
    _relative_error,
    verify_gguf,
)
from slothkit.models import architecture_named
from slothkit.testing import CORPUS, tiny_model_path

T = gguf.GGMLQuantizationType
SIZES = dict(hidden_size=256, intermediate_size=512)  # 4 heads of 64: 32 rotated pairs
ORIGINAL, CONTEXT = 256, 1024
WINDOW = 16
LONG = CORPUS[:1600]  # 647 tokens: beyond the original context, and forty windows
SHORT_PROMPTS = (CORPUS[:400], "Sloths move slowly because")  # 173 and 7 tokens
needs_llama_cpp = pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None,
    reason="llama-cpp-python is not installed (pip install 'slothkit[gguf]'); it runs the GGUF files",
)


def _factors(seed: int, low: float, high: float) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    return (low + (high - low) * torch.rand(32, generator=g)).tolist()


SHORT_FACTORS = _factors(0, 1.0, 2.0)
LONG_FACTORS = _factors(1, 1.0, 9.0)


@functools.cache
def tiny(variant: str):
    path = tiny_model_path("phi3", **SIZES, max_position_embeddings=CONTEXT)
    overrides = {
        "longrope": dict(
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": SHORT_FACTORS,
                "long_factor": LONG_FACTORS,
            },
            original_max_position_embeddings=ORIGINAL,
        ),
        "window": dict(sliding_window=WINDOW),
        "no_window": {},
        "partial": dict(
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
        ),
    }[variant]
    config = AutoConfig.from_pretrained(path, **overrides)
    model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """exported(variant, method) -> path of the GGUF file, written once per module."""
    root = tmp_path_factory.mktemp("phi3-gguf")

    @functools.cache
    def get(variant, method):
        model, tokenizer = tiny(variant)
        return write_gguf(
            model, root / f"phi3-{variant}.{method}.gguf", tokenizer, quantization_method(method)
        )

    return get


def field(reader, key):
    return reader.fields[key].contents()


def _stored(reader, name):
    t = next(t for t in reader.tensors if t.name == name)
    return np.array(t.data, dtype=np.float32), t


# ---------------------------------------------------------------------------------------
# LongRoPE
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["f16", "q4_k_m"])
def test_longrope_file_carries_both_factor_tensors_and_keys(method, exported):
    reader = gguf.GGUFReader(exported("longrope", method))
    assert field(reader, "phi3.context_length") == CONTEXT
    assert field(reader, "phi3.rope.scaling.original_context_length") == ORIGINAL
    # sqrt(1 + ln(1024 / 256) / ln(256)) = sqrt(1.25), HF's default attention factor
    assert field(reader, "phi3.rope.scaling.attn_factor") == pytest.approx(math.sqrt(1.25), rel=1e-6)
    assert field(reader, "phi3.rope.dimension_count") == 64
    assert "phi3.attention.sliding_window" not in reader.fields  # Phi3Config's default: none
    for name, factors in [
        ("rope_factors_long.weight", LONG_FACTORS),
        ("rope_factors_short.weight", SHORT_FACTORS),
    ]:
        values, tensor = _stored(reader, name)
        assert tensor.tensor_type == T.F32 and [int(n) for n in tensor.shape] == [32]  # head_dim / 2
        np.testing.assert_array_equal(values, np.array(factors, dtype=np.float32))


def test_longrope_attention_factor_follows_the_config():
    model, _ = tiny("longrope")
    arch = architecture_named("phi3")
    config = AutoConfig.from_pretrained(
        model.config._name_or_path, **{"original_max_position_embeddings": ORIGINAL}
    )
    config.rope_parameters = {**model.config.rope_parameters, "attention_factor": 1.5}
    assert hyperparameters(config, arch).longrope.attention_factor == 1.5
    config.rope_parameters = {**model.config.rope_parameters, "short_factor": SHORT_FACTORS[:-1]}
    with pytest.raises(ValueError, match="short_factor with one value per rotated pair \\(32 for 64"):
        hyperparameters(config, arch)


def test_llama_cpp_context_rounding_decides_the_factors():
    assert longrope.llama_cpp_context(1) == 256 and longrope.llama_cpp_context(257) == 512
    assert not longrope.llama_cpp_uses_long_factors(4096, 4096)  # Phi-3-mini-128k at -c 4096
    assert longrope.llama_cpp_uses_long_factors(4097, 4096)
    assert longrope.llama_cpp_uses_long_factors(32, 32)  # run as 256
    assert longrope.largest_short_context(300) == 256 and longrope.largest_short_context(200) is None


@needs_llama_cpp
@pytest.mark.parametrize("method", ["f32", "q8_0"])
def test_longrope_short_factors_match_hf_within_the_original_context(method, exported):
    """Default context 256 = the original length: llama.cpp's short factors, as HF's on
    prompts that fit."""
    model, tokenizer = tiny("longrope")
    report = verify_gguf(exported("longrope", method), model, tokenizer, method, prompts=SHORT_PROMPTS)
    assert report.logit_error < TOLERANCES[method]
    print(f"longrope short {method}: logit error {report.logit_error:.4f}")


@needs_llama_cpp
@pytest.mark.parametrize("method", ["f32", "q8_0"])
def test_longrope_long_factors_match_hf_beyond_the_original_context(method, exported):
    """A context of 1024 (> 256): llama.cpp's long factors, as HF's on a 647-token prompt."""
    model, tokenizer = tiny("longrope")
    report = verify_gguf(
        exported("longrope", method), model, tokenizer, method, prompts=(LONG,), context=CONTEXT
    )
    assert report.logit_error < TOLERANCES[method]
    print(f"longrope long {method}: logit error {report.logit_error:.4f}")


@needs_llama_cpp
def test_swapped_factor_tensors_fail_verification(exported, tmp_path, monkeypatch):
    """The check can fail: the short factors written as the long ones and back."""
    model, tokenizer = tiny("longrope")

    def swapped(self):
        (long_name, long), (short_name, short) = original(self)
        return [(long_name, short), (short_name, long)]

    original = longrope.LongRope.tensors
    monkeypatch.setattr(longrope.LongRope, "tensors", swapped)
    path = write_gguf(model, tmp_path / "swapped.f32.gguf", tokenizer, "f32")
    with pytest.raises(GGUFVerificationError, match="logits differ"):
        verify_gguf(path, model, tokenizer, "f32", prompts=SHORT_PROMPTS)


@needs_llama_cpp
def test_short_prompts_in_a_long_context_differ_by_design(exported):
    """llama.cpp picks the factors by its context, HF by the sequence: a short prompt in a
    context beyond the original length runs the long factors in llama.cpp and the short in
    HF. Measured rather than assumed, and refused by the verifier with the reason."""
    import llama_cpp

    model, tokenizer = tiny("longrope")
    path = exported("longrope", "f32")
    ids = tokenizer(SHORT_PROMPTS[0])["input_ids"]
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=CONTEXT, logits_all=True, verbose=False)
    try:
        llm.eval(ids)
        cpp = np.array(llm.scores[: len(ids)], dtype=np.float32)
    finally:
        llm.close()
    error = _relative_error(cpp, _hf_logits(model, ids))
    print(f"longrope short prompt, long context: logit error {error:.4f}")
    assert error > 20 * TOLERANCES["f32"], error
    with pytest.raises(ValueError, match="prompts of \\[173\\] tokens would run HF's short ones"):
        verify_gguf(path, model, tokenizer, "f32", prompts=SHORT_PROMPTS[:1], context=CONTEXT)


# ---------------------------------------------------------------------------------------
# Sliding window
# ---------------------------------------------------------------------------------------


def test_window_is_written_as_hf_applies_it(exported):
    reader = gguf.GGUFReader(exported("window", "f16"))
    assert field(reader, "phi3.attention.sliding_window") == WINDOW
    assert "phi3.attention.sliding_window_pattern" not in reader.fields


def test_a_window_beyond_the_context_is_not_written():
    model, _ = tiny("no_window")
    config = AutoConfig.from_pretrained(model.config._name_or_path, sliding_window=CONTEXT)
    assert (
        hyperparameters(config, architecture_named("phi3")).sliding_window is None
    )  # the 128k models' 262144
    config.sliding_window = CONTEXT - 1
    assert hyperparameters(config, architecture_named("phi3")).sliding_window == CONTEXT - 1


@needs_llama_cpp
def test_llama_cpp_attends_past_the_window_of_phi3(exported):
    """llama.cpp's phi3 graph switches the window off: past the window its logits are HF's
    without one, and far from HF's with it. The verifier therefore keeps prompts within it."""
    import llama_cpp

    windowed, tokenizer = tiny("window")
    full, _ = tiny("no_window")
    ids = tokenizer(SHORT_PROMPTS[0])["input_ids"][:48]
    llm = llama_cpp.Llama(
        model_path=str(exported("window", "f32")), n_ctx=256, logits_all=True, verbose=False
    )
    try:
        llm.eval(ids)
        cpp = np.array(llm.scores[: len(ids)], dtype=np.float32)
    finally:
        llm.close()
    hf_windowed, hf_full = _hf_logits(windowed, ids), _hf_logits(full, ids)
    within, past = slice(0, WINDOW), slice(WINDOW, len(ids))
    errors = [
        _relative_error(cpp[within], hf_windowed[within]),
        _relative_error(cpp[past], hf_full[past]),
        _relative_error(cpp[past], hf_windowed[past]),
    ]
    print("window: within {:.4f}, past vs no window {:.4f}, past vs window {:.4f}".format(*errors))
    assert _relative_error(cpp[within], hf_windowed[within]) < TOLERANCES["f32"]
    assert _relative_error(cpp[past], hf_full[past]) < TOLERANCES["f32"]
    assert _relative_error(cpp[past], hf_windowed[past]) > 20 * TOLERANCES["f32"]


@needs_llama_cpp
@pytest.mark.parametrize("method", ["f32", "q8_0"])
def test_windowed_phi3_matches_hf_within_the_window(method, exported):
    model, tokenizer = tiny("window")
    report = verify_gguf(exported("window", method), model, tokenizer, method, prompts=SHORT_PROMPTS)
    assert report.logit_error < TOLERANCES[method]
    assert report.greedy_tokens == 12


# ---------------------------------------------------------------------------------------
# Partial rotary
# ---------------------------------------------------------------------------------------


@needs_llama_cpp
def test_partial_rotary_writes_the_rotated_dimensions(exported):
    model, tokenizer = tiny("partial")
    path = exported("partial", "f32")
    assert field(gguf.GGUFReader(path), "phi3.rope.dimension_count") == 32  # half of 64
    report = verify_gguf(path, model, tokenizer, "f32", prompts=SHORT_PROMPTS)
    assert report.logit_error < TOLERANCES["f32"]
