"""Tests for slothkit.testing.real_tokenizers: tokenizers rebuilt from tiktoken ranks.

These need neither network nor a model: the merge recovery on hand-made ranks, and the cache
with a stand-in build. The real Qwen tokenizer is tested against llama.cpp and tiktoken in
tests/slothkit/export/gguf/test_real_tokenizers.py.
"""

import base64
import dataclasses

import pytest

from slothkit.testing import real_tokenizers


def test_merges_are_recovered_from_tiktoken_ranks():
    # "abc" is a + bc as well as ab + c; tiktoken's BPE joins ab first (rank 3 before 4), so
    # the merge that makes abc is (ab, c), not the first split into two tokens.
    ranks = {b"a": 0, b"b": 1, b"c": 2, b"ab": 3, b"bc": 4, b"abc": 5}
    assert real_tokenizers._merges_from_ranks(ranks) == [(b"a", b"b"), (b"b", b"c"), (b"ab", b"c")]
    with pytest.raises(ValueError, match=r"token b'abc' of rank 3 is not one merge of two lower-ranked"):
        real_tokenizers._merges_from_ranks({b"a": 0, b"b": 1, b"c": 2, b"abc": 3})


def test_tiktoken_ranks_must_be_byte_level_bpe():
    line = lambda token, rank: base64.b64encode(token) + b" %d\n" % rank  # noqa: E731
    every_byte = b"".join(line(bytes([b]), b) for b in range(256))
    assert real_tokenizers._tiktoken_ranks(every_byte + line(b"ab", 256))[b"ab"] == 256
    with pytest.raises(ValueError, match="0 to n - 1"):
        real_tokenizers._tiktoken_ranks(every_byte + line(b"ab", 257))
    with pytest.raises(ValueError, match="every byte"):
        real_tokenizers._tiktoken_ranks(every_byte.replace(line(b"\xff", 255), line(b"ab", 255)))


def test_a_tokenizer_folder_is_named_after_its_whole_record(tmp_path, monkeypatch):
    built = []
    monkeypatch.setattr(real_tokenizers, "_build_tokenizer", lambda spec, folder, wheels: built.append(spec))
    path = real_tokenizers.real_tokenizer_path("qwen2.5-tokenizer", cache_dir=tmp_path)
    assert path.parent == tmp_path and path.name.startswith("qwen2.5-tokenizer-")
    assert real_tokenizers.real_tokenizer_path("qwen2.5-tokenizer", cache_dir=tmp_path) == path
    qwen = real_tokenizers.REAL_TOKENIZERS["qwen2.5-tokenizer"]
    changed = dataclasses.replace(qwen, eos_token="<|endoftext|>")
    monkeypatch.setitem(real_tokenizers.REAL_TOKENIZERS, "qwen2.5-tokenizer", changed)
    assert real_tokenizers.real_tokenizer_path("qwen2.5-tokenizer", cache_dir=tmp_path) != path
    assert built == [qwen, changed]
    with pytest.raises(
        ValueError, match="unknown real tokenizer 'qwen3'; accepted: qwen2.5-tokenizer, qwen3.5-tokenizer"
    ):
        real_tokenizers.real_tokenizer_path("qwen3", cache_dir=tmp_path)
