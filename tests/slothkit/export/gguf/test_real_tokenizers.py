"""A real byte-level tokenizer through GGUF export: SmolLM2-135M-Instruct's, read back by llama.cpp.

slothkit names the pre-tokenizer as llama.cpp's converter does (the hash of a check text's
ids); llama.cpp must then split and merge every text exactly as Hugging Face does, chat
markup included.
"""

import pytest

testing = pytest.importorskip("slothkit.testing")
if not hasattr(testing, "real_model_path"):
    pytest.skip(
        "slothkit.testing.real_model_path is not in this tree; it provides the cached SmolLM2 checkpoint",
        allow_module_level=True,
    )
llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python reads the GGUF file back")

import json

import gguf
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from slothkit.export.gguf import write_gguf
from slothkit.export.gguf.pre_tokenizer import CHECK_TEXT, KNOWN_HASHES, check_text_hash

MODEL = "smollm2-135m-instruct"
TEXTS = (
    "The lighthouse on the northern cape was built in 1871 and has been lit every night since.",
    'def fib(n: int) -> int:\n    """Return the n-th Fibonacci number."""\n'
    "    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\nprint([fib(i) for i in range(10)])  # 0, 1, 1, 2\n",
    "Call 555-0123 or +44 20 7946 0958; pay 1,234,567.89 by 2024-12-31 at 08:15, not 3..3 or 33333333.",
    "naïve café, Ünïcödé straße: 東京 🦥 — “quotes” ‘single’ Ελληνικά русский עברית 😶\u200d🌫️",
    "tabs\tand  double  spaces\n\n\nand   new lines   \n  trailing  ",
    "I'VE been told he'S there; we'll see, they'd know. DON'T",
    CHECK_TEXT,
)
CHAT = [
    {"role": "system", "content": "You are a careful baker."},
    {"role": "user", "content": "How long do I knead 500 g of dough?"},
    {"role": "assistant", "content": "About 10 minutes, until it's smooth."},
    {"role": "user", "content": "And at 230 °C, how long to bake? 🍞"},
]


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """(tokenizer, GGUF path): the checkpoint exported at f16, once per module."""
    path = testing.real_model_path(MODEL)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    file = write_gguf(model, tmp_path_factory.mktemp("smollm2") / "smollm2.f16.gguf", tokenizer, "f16")
    return tokenizer, file


@pytest.fixture(scope="module")
def llm(smollm2):
    # vocab_only: the tokenizer alone, no tensors, so no CPU buffer types come into play
    # (the verifier's AMX workaround concerns loading weights).
    model = llama_cpp.Llama(model_path=str(smollm2[1]), vocab_only=True, verbose=False)
    yield model
    model.close()


def test_pre_tokenizer_is_named_by_its_hash_as_smollm(smollm2):
    tokenizer, file = smollm2
    assert KNOWN_HASHES.get(check_text_hash(tokenizer)) == "smollm"
    reader = gguf.GGUFReader(file)
    assert reader.fields["tokenizer.ggml.model"].contents() == "gpt2"
    assert reader.fields["tokenizer.ggml.pre"].contents() == "smollm"


def test_special_tokens_metadata(smollm2):
    tokenizer, file = smollm2
    reader = gguf.GGUFReader(file)
    field = lambda key: reader.fields[key].contents()  # noqa: E731
    tokens, types = field("tokenizer.ggml.tokens"), field("tokenizer.ggml.token_type")
    vocab = tokenizer.get_vocab()
    for text in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"):
        assert types[vocab[text]] == gguf.TokenType.CONTROL, text
    assert types[vocab["Ġthe"]] == gguf.TokenType.NORMAL
    assert all(tokens[i] == t for t, i in vocab.items())
    assert field("tokenizer.ggml.eos_token_id") == tokenizer.eos_token_id == vocab["<|im_end|>"]
    assert field("tokenizer.ggml.eot_token_id") == vocab["<|im_end|>"]  # ChatML's end of turn
    assert field("tokenizer.ggml.bos_token_id") == tokenizer.bos_token_id
    assert field("tokenizer.ggml.add_bos_token") is False  # SmolLM2's tokenizer adds no BOS
    assert tokenizer("a")["input_ids"] == [vocab["a"]]
    # as in the GGUF that SmolLM2's authors published: 49,152 tokens, 48,900 merges
    assert len(tokens) == 49152
    merges = field("tokenizer.ggml.merges")
    assert merges == [
        m if isinstance(m, str) else " ".join(m)
        for m in json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    ]
    assert len(merges) == 48900 and merges[:3] == ["Ġ t", "Ġ a", "i n"]


@pytest.mark.parametrize("index", range(len(TEXTS)))
def test_llama_cpp_tokenises_text_like_hf(llm, smollm2, index):
    tokenizer, _ = smollm2
    text = TEXTS[index]
    hf = tokenizer(text)["input_ids"]
    assert llm.tokenize(text.encode(), add_bos=True, special=False) == hf
    assert llm.detokenize(hf).decode() == text


def test_llama_cpp_tokenises_a_chatml_chat_like_hf(llm, smollm2):
    tokenizer, _ = smollm2
    text = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert text.count("<|im_start|>") == len(CHAT) + 1 and text.count("<|im_end|>") == len(CHAT)
    hf = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert llm.tokenize(text.encode(), add_bos=False, special=True) == hf
