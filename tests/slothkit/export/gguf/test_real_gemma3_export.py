"""A real Gemma 3 through GGUF export, judged by llama.cpp: Gemma 3 270M (base), float32.

As for SmolLM2 (test_real_model_export.py), for every type a user exports:

- llama.cpp tokenises text as Hugging Face does: the 262,144-token SentencePiece-style
  vocabulary with its whitespace-run and markup tokens, and Gemma's turn markers;
- f16 stays within its tolerance, and f16 and q8_0 continue every prompt greedily for 16
  tokens exactly as the HF model does;
- each quantised type is at least as faithful as llama.cpp's own quantiser makes it from
  slothkit's f16 file of the same weights (llama_model_quantize).

One HF model and one export per type serve every test of the module. The measured errors
are printed (pytest -s); docs/gguf-export.md records them.
"""

import math

import pytest

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python runs the GGUF files")

import gguf
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from slothkit.export.gguf import save_pretrained_gguf, verify_gguf
from slothkit.export.gguf import verify as verify_module
from slothkit.export.gguf.pre_tokenizer import CHECK_TEXT
from slothkit.export.gguf.verify import quantize_with_llama_cpp

pytestmark = pytest.mark.slow

PROMPTS = (
    "The capital of France is",
    "To bake bread, first mix the flour with",
    "def add(a, b):\n    return",
)
METHODS = ("f16", "q8_0", "q6_k", "q5_k_m", "q4_k_m")
TEXTS = (
    "The lighthouse on the northern cape was built in 1871 and has been lit every night since.",
    'def fib(n: int) -> int:\n    """Return the n-th Fibonacci number."""\n'
    "    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\nprint([fib(i) for i in range(10)])  # 0, 1, 1, 2\n",
    "Call 555-0123 or +44 20 7946 0958; pay 1,234,567.89 by 2024-12-31 at 08:15, not 3..3 or 33333333.",
    "naïve café, Ünïcödé straße: 東京 🦥 — “quotes” ‘single’ Ελληνικά русский עברית 😶\u200d🌫️",
    "tabs\tand  double  spaces\n\n\nand   new lines   \n  trailing  ",
    " starts with a space, <b>bold</b> and <h1>markup</h1>",
    CHECK_TEXT,
)
# Gemma's turn format, as its instruct models' chat template writes it.
CHAT = (
    "<bos><start_of_turn>user\nHow long do I knead 500 g of dough?<end_of_turn>\n"
    "<start_of_turn>model\nAbout 10 minutes.<end_of_turn>\n<start_of_turn>model\n"
)


@pytest.fixture(scope="module")
def gemma3(gemma3_path):
    model = AutoModelForCausalLM.from_pretrained(gemma3_path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(gemma3_path)


@pytest.fixture(scope="module")
def exported(gemma3, tmp_path_factory):
    """Every type in one save, as a notebook's GGUF cell writes them."""
    model, tokenizer = gemma3
    folder = tmp_path_factory.mktemp("gemma3-gguf")
    paths = save_pretrained_gguf(model, folder, tokenizer, quantization_method=list(METHODS), verify=False)
    return dict(zip(METHODS, paths))


@pytest.fixture(scope="module")
def vocab_only(exported):
    # vocab_only: the tokenizer alone, no tensors.
    llm = llama_cpp.Llama(model_path=str(exported["f16"]), vocab_only=True, verbose=False)
    yield llm
    llm.close()


def measured(path, model, tokenizer, method, greedy, monkeypatch):
    """verify_gguf's reports, one per prompt, with the tolerance lifted: the measurement, not
    the verdict."""
    monkeypatch.setitem(verify_module.TOLERANCES, method, math.inf)
    return [verify_gguf(path, model, tokenizer, method, prompts=(p,), greedy_tokens=greedy) for p in PROMPTS]


def test_metadata(gemma3, exported):
    model, tokenizer = gemma3
    reader = gguf.GGUFReader(exported["f16"])
    field = lambda key: reader.fields[key].contents()  # noqa: E731
    assert field("general.architecture") == "gemma3"
    assert field("gemma3.block_count") == 18
    assert field("gemma3.rope.freq_base") == 1_000_000.0
    assert field("gemma3.rope.freq_base_swa") == 10_000.0
    assert field("gemma3.attention.sliding_window") == 512
    assert field("gemma3.attention.sliding_window_pattern") == [i % 6 != 5 for i in range(18)]
    tokens, types = field("tokenizer.ggml.tokens"), field("tokenizer.ggml.token_type")
    assert len(tokens) == model.config.vocab_size == 262_144
    vocab = tokenizer.get_vocab()
    assert all(tokens[i] == t for t, i in vocab.items())
    for text in ("<bos>", "<eos>", "<pad>", "<start_of_turn>", "<end_of_turn>"):
        assert types[vocab[text]] == gguf.TokenType.CONTROL, text
    assert types[vocab["<unk>"]] == gguf.TokenType.UNKNOWN
    assert types[vocab["\n\n"]] == gguf.TokenType.USER_DEFINED  # matched before the model, as in HF
    assert types[vocab["<0x41>"]] == gguf.TokenType.BYTE
    ids = {key: field(f"tokenizer.ggml.{key}_token_id") for key in ("bos", "eos", "padding", "unknown")}
    assert ids == {"bos": 2, "eos": 1, "padding": 0, "unknown": 3}
    assert field("tokenizer.ggml.add_bos_token") is True
    assert field("tokenizer.ggml.add_space_prefix") is False  # Gemma's tokenizer never prepends "▁"


@pytest.mark.parametrize("index", range(len(TEXTS)))
def test_llama_cpp_tokenises_text_like_hf(gemma3, vocab_only, index):
    _, tokenizer = gemma3
    text = TEXTS[index]
    assert vocab_only.tokenize(text.encode(), add_bos=True, special=False) == tokenizer(text)["input_ids"]


def test_llama_cpp_tokenises_gemma_turns_like_hf(gemma3, vocab_only):
    _, tokenizer = gemma3
    hf = tokenizer(CHAT, add_special_tokens=False)["input_ids"]
    assert hf.count(tokenizer.convert_tokens_to_ids("<start_of_turn>")) == 3
    assert vocab_only.tokenize(CHAT.encode(), add_bos=False, special=True) == hf


def test_f16_agrees_with_the_hf_model(gemma3, exported):
    model, tokenizer = gemma3
    report = verify_gguf(exported["f16"], model, tokenizer, "f16", prompts=PROMPTS, greedy_tokens=16)
    print(f"\nf16: logit error {report.logit_error:.4f}, greedy {report.greedy_exact}/{report.greedy_tokens}")
    assert report.logit_error <= verify_module.TOLERANCES["f16"]
    assert report.greedy_exact == report.greedy_tokens == 16 * len(PROMPTS)


@pytest.mark.parametrize("method", ["q8_0", "q6_k", "q5_k_m", "q4_k_m"])
def test_quantised_file_is_as_faithful_as_llama_cpp_quantiser(
    gemma3, exported, method, tmp_path, monkeypatch
):
    """Within the type's tolerance on every prompt (what save_pretrained_gguf checks), and as
    close to HF as llama.cpp's quantiser's file on average over the prompts. The average, not
    the worst prompt: at 6 bits the two files' tensors have the same errors to four digits,
    yet the code prompt, whose logits move most, came out at 0.115 for slothkit's file and
    0.085 for llama.cpp's, the other two prompts at 0.045 / 0.055 and 0.047 / 0.052."""
    model, tokenizer = gemma3
    greedy = 16 if method == "q8_0" else 6
    tolerance = verify_module.TOLERANCES[method]
    ours = measured(exported[method], model, tokenizer, method, greedy, monkeypatch)
    reference = quantize_with_llama_cpp(exported["f16"], tmp_path / f"llama-cpp.{method}.gguf", method)
    theirs = measured(reference, model, tokenizer, method, greedy, monkeypatch)

    def summary(reports):
        errors = [r.logit_error for r in reports]
        exact = sum(r.greedy_exact for r in reports)
        return max(errors), sum(errors) / len(errors), exact, sum(r.greedy_tokens for r in reports)

    (our_max, our_mean, our_exact, generated), (their_max, their_mean, their_exact, _) = map(
        summary, (ours, theirs)
    )
    print(
        f"\n{method}: logit error (worst prompt, mean) slothkit {our_max:.4f}, {our_mean:.4f}; llama.cpp's "
        f"quantiser {their_max:.4f}, {their_mean:.4f}; greedy exact slothkit {our_exact}/{generated}, "
        f"llama.cpp {their_exact}/{generated}"
    )
    assert our_max <= tolerance
    assert our_mean <= 1.1 * their_mean + 0.01
    if method == "q8_0":
        assert our_exact == generated == 16 * len(PROMPTS)
