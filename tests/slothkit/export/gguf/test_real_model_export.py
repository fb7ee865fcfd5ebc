"""A real pretrained model through GGUF export, judged by llama.cpp: SmolLM2-135M-Instruct.

For every type a user exports, llama.cpp tokenises the prompts as Hugging Face does and
its next-token logits are compared with the HF model's (verify_gguf: rms of the difference
over the std of HF's logits, at every prompt position):

- f16 stays within its tolerance, and f16 and q8_0 continue every prompt greedily for 16
  tokens exactly as the HF model does;
- each quantised type is at least as faithful as llama.cpp's own quantiser made it from
  slothkit's f16 file of the same weights (llama_model_quantize): the tolerances in
  slothkit.export.gguf.verify were measured on random weights, and a real model's
  outlier activations make 8-bit activation rounding in llama.cpp's quantised products
  cost more (SmolLM2's q6_k: about 0.27 by either quantiser), so the quantiser that
  llama.cpp users already trust is the bar;

The measured errors are printed (pytest -s).
"""

import math

import pytest

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python runs the GGUF files")

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from slothkit.export.gguf import save_pretrained_gguf, verify_gguf
from slothkit.export.gguf import verify as verify_module
from slothkit.export.gguf.verify import quantize_with_llama_cpp

pytestmark = pytest.mark.slow

PROMPTS = (
    "The capital of France is",
    "To bake bread, first mix the flour with",
    "def add(a, b):\n    return",
)
METHODS = ("f16", "q8_0", "q6_k", "q5_k_m", "q4_k_m")


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(smollm2_path)


@pytest.fixture(scope="module")
def exported(smollm2, tmp_path_factory):
    """Every type in one save, as a notebook's GGUF cell writes them."""
    model, tokenizer = smollm2
    folder = tmp_path_factory.mktemp("smollm2-gguf")
    paths = save_pretrained_gguf(model, folder, tokenizer, quantization_method=list(METHODS), verify=False)
    return dict(zip(METHODS, paths))


def measured(path, model, tokenizer, method, greedy, monkeypatch):
    """verify_gguf's report with the tolerance lifted: the measurement, not the verdict."""
    monkeypatch.setitem(verify_module.TOLERANCES, method, math.inf)
    return verify_gguf(path, model, tokenizer, method, prompts=PROMPTS, greedy_tokens=greedy)


def test_f16_agrees_with_the_hf_model(smollm2, exported):
    model, tokenizer = smollm2
    report = verify_gguf(exported["f16"], model, tokenizer, "f16", prompts=PROMPTS, greedy_tokens=16)
    print(f"\nf16: logit error {report.logit_error:.4f}, greedy {report.greedy_exact}/{report.greedy_tokens}")
    assert report.logit_error <= verify_module.TOLERANCES["f16"]
    assert report.greedy_exact == report.greedy_tokens == 16 * len(PROMPTS)


@pytest.mark.parametrize("method", ["q8_0", "q6_k", "q5_k_m", "q4_k_m"])
def test_quantised_file_is_as_faithful_as_llama_cpp_quantiser(
    smollm2, exported, method, tmp_path, monkeypatch
):
    model, tokenizer = smollm2
    greedy = 16 if method == "q8_0" else 6
    ours = measured(exported[method], model, tokenizer, method, greedy, monkeypatch)
    reference = quantize_with_llama_cpp(exported["f16"], tmp_path / f"llama-cpp.{method}.gguf", method)
    theirs = measured(reference, model, tokenizer, method, greedy, monkeypatch)
    print(
        f"\n{method}: logit error slothkit {ours.logit_error:.4f}, llama.cpp's quantiser "
        f"{theirs.logit_error:.4f}; greedy exact slothkit {ours.greedy_exact}/{ours.greedy_tokens}, "
        f"llama.cpp {theirs.greedy_exact}/{theirs.greedy_tokens}"
    )
    assert ours.logit_error <= 1.1 * theirs.logit_error + 0.01
    if method == "q8_0":
        assert ours.greedy_exact == ours.greedy_tokens == 16 * len(PROMPTS)
