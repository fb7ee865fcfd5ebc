"""GGUF export of Phi-3-mini-4k's sliding window (llama.cpp's phi3 architecture) on the
tiny random checkpoint of slothkit.testing, reconfigured with sliding_window 16 on every
layer (Phi-3-mini-4k's 2047 in small). Each file is read back with gguf.GGUFReader and run
by llama.cpp against the HF model."""

import functools
import importlib.util

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from slothkit.export.gguf import write_gguf
from slothkit.export.gguf.metadata import hyperparameters
from slothkit.export.gguf.tensor_types import quantization_method
from slothkit.export.gguf.verify import (
    TOLERANCES,
    _hf_logits,
    _relative_error,
    verify_gguf,
)
from slothkit.models import architecture_named
from slothkit.testing import CORPUS, tiny_model_path

SIZES = dict(hidden_size=256, intermediate_size=512)
CONTEXT = 1024
WINDOW = 16
SHORT_PROMPTS = (CORPUS[:400], "Sloths move slowly because")  # 173 and 7 tokens
needs_llama_cpp = pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None,
    reason="llama-cpp-python is not installed (pip install 'slothkit[gguf]'); it runs the GGUF files",
)


@functools.cache
def tiny(variant: str):
    path = tiny_model_path("phi3", **SIZES, max_position_embeddings=CONTEXT)
    overrides = {
        "window": dict(sliding_window=WINDOW),
        "no_window": {},
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
