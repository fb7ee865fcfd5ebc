"""GPT-2-style byte-level tokenizers through GGUF export: the pre-tokenizer's name, the vocabulary
metadata, and llama.cpp tokenising as Hugging Face does.

The tokenizers are trained here on slothkit's test corpus with the pre-tokenizers of GPT-2,
SmolLM and Qwen2 (and Llama 3's, from slothkit.testing), so their check-text hashes are in no
table and the name comes from their split regexes; the hash route is checked with SmolLM2's real
tokenizer in test_real_tokenizers.py, and here by registering a hash.
"""

import functools
import importlib.util
import json

import gguf
import pytest
import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from slothkit.export.gguf import pre_tokenizer, write_gguf
from slothkit.export.gguf.pre_tokenizer import (
    CHECK_TEXT,
    KNOWN_HASHES,
    QWEN2_PATTERN,
    check_text_hash,
    pre_tokenizer_name,
    split_regexes,
)
from slothkit.testing import CORPUS, tiny_model_path

SIZES = dict(hidden_size=256, intermediate_size=512)  # the tiny Llama of test_writer: 768 embedding rows
ROWS = 768
needs_llama_cpp = pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None,
    reason="llama-cpp-python is not installed (pip install 'slothkit[gguf]'); it reads the GGUF files",
)
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Each style: how it splits, its special tokens (ids before or after the learned vocabulary, as in
# the real one), which of them are bos/eos/unk/pad, and the name llama.cpp knows it by.
STYLES = {
    "gpt-2": dict(
        pre=pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        specials_first=False,
        specials=["<|endoftext|>"],
        roles=dict(bos_token="<|endoftext|>", eos_token="<|endoftext|>", unk_token="<|endoftext|>"),
    ),
    "smollm": dict(
        pre=pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        ),
        specials_first=True,
        specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        roles=dict(
            bos_token="<|im_start|>",
            eos_token="<|im_end|>",
            unk_token="<|endoftext|>",
            pad_token="<|im_end|>",
        ),
    ),
    "qwen2": dict(
        pre=pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        ),
        normalizer=normalizers.NFC(),
        specials_first=False,
        specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        # Qwen2.5 leaves its fill-in-the-middle markers unspecial; llama.cpp's converter makes
        # them CONTROL by their look. A plain added word stays USER_DEFINED.
        plain_added=["<|fim_prefix|>", "sloth"],
        roles=dict(eos_token="<|im_end|>", pad_token="<|endoftext|>"),  # no BOS, as Qwen2
    ),
}
TEXTS = [p.strip() for p in CORPUS.split("\n\n")] + [
    "naïve café, Ünïcödé straße: 東京 🦥 — “quotes”",
    "tabs\tand  double  spaces\n\n\nand new lines  ",
    "x = 3.14159; y = 1,000,000 and 2024-12-31, 33333333",
    "I'VE been told he'S there; we'll see",
    CHECK_TEXT,
]


@functools.cache
def byte_level_tokenizer(style: str) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer of `style`, trained on CORPUS (a few hundred tokens)."""
    spec = STYLES[style]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = spec["pre"]
    if "normalizer" in spec:
        tok.normalizer = spec["normalizer"]
    specials = [AddedToken(t, special=True, normalized=False) for t in spec["specials"]]
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=specials if spec["specials_first"] else [],
        show_progress=False,
    )
    tok.train_from_iterator([p + "\n" for p in CORPUS.split("\n\n")], trainer)
    tok.decoder = decoders.ByteLevel()
    if not spec["specials_first"]:
        tok.add_special_tokens(specials)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in spec.get("plain_added", [])])
    return PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=CHATML, **spec["roles"])


def tiny_llama(stop_ids: list[int]):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path("llama", **SIZES), dtype=torch.float32)
    model.generation_config.eos_token_id = stop_ids
    return model.eval()


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """exported(style) -> (tokenizer, GGUF path) of the tiny Llama with that tokenizer."""
    root = tmp_path_factory.mktemp("byte-level")

    @functools.cache
    def get(style):
        tokenizer = byte_level_tokenizer(style)
        vocab = tokenizer.get_vocab()
        # ChatML models stop at <|im_end|> and <|endoftext|> (Qwen2's generation_config)
        stops = [vocab[t] for t in ("<|im_end|>", "<|endoftext|>") if t in vocab]
        return tokenizer, write_gguf(tiny_llama(stops), root / f"{style}.gguf", tokenizer, "f32")

    return get


def field(reader, key):
    return reader.fields[key].contents() if key in reader.fields else None


# ---------------------------------------------------------------------------------------
# Naming the pre-tokenizer
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("style", STYLES)
def test_named_by_its_splits_when_the_hash_is_unknown(style):
    tokenizer = byte_level_tokenizer(style)
    assert check_text_hash(tokenizer) not in KNOWN_HASHES
    spec = json.loads(tokenizer.backend_tokenizer.to_str())["pre_tokenizer"]
    assert pre_tokenizer_name(tokenizer, spec) == style


def test_llama3_tokenizer_is_named_llama_bpe():
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path("llama", **SIZES))
    spec = json.loads(tokenizer.backend_tokenizer.to_str())["pre_tokenizer"]
    assert split_regexes(spec) == (pre_tokenizer.LLAMA3_PATTERN,)
    assert pre_tokenizer_name(tokenizer, spec) == "llama-bpe"


def test_split_regexes_reads_components_as_llama_cpp_splits():
    gpt2 = pre_tokenizer.GPT2_PATTERN
    cases = [
        (
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True},
            (gpt2,),
        ),  # use_regex defaults on
        ({"type": "ByteLevel", "add_prefix_space": False, "use_regex": False}, ()),
        (
            {
                "type": "Sequence",
                "pretokenizers": [
                    {"type": "Split", "pattern": {"Regex": gpt2}, "behavior": "Isolated", "invert": False},
                    {"type": "ByteLevel", "add_prefix_space": False, "use_regex": False},
                ],
            },
            (gpt2,),  # GPT-2's regex spelled out as a Split is GPT-2
        ),
        (
            {
                "type": "Sequence",
                "pretokenizers": [
                    {"type": "Digits", "individual_digits": False},
                    {"type": "ByteLevel", "add_prefix_space": True, "use_regex": True},
                ],
            },
            (r"\p{N}+", gpt2, "<ByteLevel(add_prefix_space=True)>"),
        ),
        ({"type": "Whitespace"}, ("<Whitespace()>", "<no ByteLevel byte mapping at the end>")),
    ]
    for spec, expected in cases:
        assert split_regexes(spec) == expected, spec


def test_the_hash_wins_over_the_splits(monkeypatch):
    """A tokenizer whose hash the table holds gets the table's name, whatever its splits say
    (llama.cpp's converter looks at the ids only)."""
    tokenizer = byte_level_tokenizer("qwen2")
    spec = json.loads(tokenizer.backend_tokenizer.to_str())["pre_tokenizer"]
    monkeypatch.setitem(KNOWN_HASHES, check_text_hash(tokenizer), "megrez")
    assert pre_tokenizer_name(tokenizer, spec) == "megrez"


def test_check_text_hash_is_sha256_of_the_printed_ids():
    class Fixed:  # the ids of SmolLM2's tokenizer would give its table entry; any list hashes alike
        def encode(self, text):
            assert text == CHECK_TEXT
            return [1, 22, 333]

    # printf '[1, 22, 333]' | sha256sum
    assert check_text_hash(Fixed()) == "276d8737d9d5a80805e0731e8d5ae18972a8e3ba721f4988f67151c6e9159068"


def test_llama_cpp_converter_table_entries():
    """Spot checks of the data against llama.cpp's convert_hf_to_gguf.py (get_vocab_base_pre)."""
    assert KNOWN_HASHES["0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5"] == "llama-bpe"
    assert KNOWN_HASHES["855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249"] == "smollm"
    assert KNOWN_HASHES["3ce83efda5659b07b1ad37ca97ca5797ea4285d9b9ab0dc679e4a720c9da7454"] == "gpt-2"
    assert KNOWN_HASHES["e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea"] == "qwen2"
    # a later entry for the same hash wins, as in the converter's if-chain: MPT's is OLMo's
    assert KNOWN_HASHES["b6dc8df998e1cfbdc4eac8243701a65afe638679230920b50d6f17d81c098166"] == "olmo"
    # WordPiece models share the function but not BPE's names
    assert not {"bert-bge", "bert-bge-large", "jina-v2-en"} & set(KNOWN_HASHES.values())


@pytest.mark.parametrize(
    "pre, described",
    [
        (
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            "splits with no regex (ByteLevel(use_regex=False) alone)",
        ),
        (
            pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(Regex(r"\p{L}+|\p{N}+|\s+|."), behavior="isolated"),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                ]
            ),
            r"splits by '\\p{L}+|\\p{N}+|\\s+|.'",
        ),
    ],
)
def test_unknown_pre_tokenizer_is_refused_naming_it_and_the_accepted_names(pre, described, tmp_path):
    tok = Tokenizer.from_str(byte_level_tokenizer("gpt-2").backend_tokenizer.to_str())
    tok.pre_tokenizer = pre
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    with pytest.raises(ValueError) as error:
        write_gguf(tiny_llama([]), tmp_path / "x.gguf", tokenizer, "f32")
    message = str(error.value)
    assert described in message and check_text_hash(tokenizer) in message
    for name in ("'gpt-2': by GPT-2's regex", "'smollm': by each digit alone, then GPT-2's regex",
                 "'llama-bpe': by Llama 3's regex", "'qwen2': by Qwen2's regex", "'tekken'", "'deepseek-llm'"):  # fmt: skip
        assert name in message, name


# ---------------------------------------------------------------------------------------
# The vocabulary metadata, read back
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("style", STYLES)
def test_written_vocabulary_metadata(style, exported):
    tokenizer, path = exported(style)
    reader = gguf.GGUFReader(path)
    vocab = tokenizer.get_vocab()
    tokens, types = field(reader, "tokenizer.ggml.tokens"), field(reader, "tokenizer.ggml.token_type")
    assert field(reader, "tokenizer.ggml.model") == "gpt2" and field(reader, "tokenizer.ggml.pre") == style
    assert len(tokens) == ROWS and all(tokens[i] == t for t, i in vocab.items())
    assert all(
        tokens[i] == f"[PAD{i}]" and types[i] == gguf.TokenType.UNUSED for i in range(len(vocab), ROWS)
    )
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    assert field(reader, "tokenizer.ggml.merges") == [
        m if isinstance(m, str) else " ".join(m) for m in merges
    ]
    assert (
        "tokenizer.ggml.scores" not in reader.fields
        and "tokenizer.ggml.add_space_prefix" not in reader.fields
    )

    spec = STYLES[style]
    expected_types = {t: gguf.TokenType.CONTROL for t in spec["specials"]}  # GPT-2's unk too
    expected_types["Ġthe"] = gguf.TokenType.NORMAL
    if style == "qwen2":
        expected_types.update(
            {"<|fim_prefix|>": gguf.TokenType.CONTROL, "sloth": gguf.TokenType.USER_DEFINED}
        )
    for text, kind in expected_types.items():
        assert types[vocab[text]] == kind, text
    normal = [t for t, i in vocab.items() if types[i] == gguf.TokenType.NORMAL]
    assert len(normal) == len(vocab) - len(spec["specials"]) - len(spec.get("plain_added", []))

    role = {k: vocab[v] for k, v in spec["roles"].items()}
    assert field(reader, "tokenizer.ggml.bos_token_id") == role.get("bos_token")
    assert field(reader, "tokenizer.ggml.eos_token_id") == role["eos_token"]
    assert field(reader, "tokenizer.ggml.unknown_token_id") == role.get("unk_token")
    assert field(reader, "tokenizer.ggml.padding_token_id") == role.get("pad_token")
    # ChatML closes a turn with <|im_end|>, also the eos; GPT-2 has no turns: its one stop is eos
    assert field(reader, "tokenizer.ggml.eot_token_id") == vocab.get("<|im_end|>")
    # none of these tokenizers adds BOS or EOS, and the file says so (llama.cpp's default differs by name)
    assert tokenizer("a")["input_ids"] == [vocab["a"]]
    assert field(reader, "tokenizer.ggml.add_bos_token") is False
    assert field(reader, "tokenizer.ggml.add_eos_token") is False
    assert field(reader, "tokenizer.chat_template") == CHATML


# ---------------------------------------------------------------------------------------
# llama.cpp reads the file
# ---------------------------------------------------------------------------------------


@needs_llama_cpp
@pytest.mark.parametrize("style", STYLES)
def test_llama_cpp_tokenises_like_hf(style, exported):
    import llama_cpp

    tokenizer, path = exported(style)
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    try:
        for text in TEXTS:
            hf = tokenizer(text)["input_ids"]
            assert llm.tokenize(text.encode(), add_bos=True, special=False) == hf, text
            assert llm.detokenize(hf).decode() == text
        chat = tokenizer.apply_chat_template(
            [
                {"role": "user", "content": "Hi there, 12 sloths?"},
                {"role": "assistant", "content": "Yes: 12."},
            ],
            tokenize=False,
        )
        chat += "<|endoftext|>" + ("<|fim_prefix|> sloth" if style == "qwen2" else "")
        hf = tokenizer(chat, add_special_tokens=False)["input_ids"]
        assert llm.tokenize(chat.encode(), add_bos=False, special=True) == hf
    finally:
        llm.close()
