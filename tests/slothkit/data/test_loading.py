"""load_data: local files of every supported type, records in memory, and the Hub path."""

import json

import datasets
import pytest

from slothkit.data import load_data
from slothkit.data.loading import as_dataset

RECORDS = [{"instruction": f"What is {i} + {i}?", "output": f"{2 * i}"} for i in range(5)]


def _write(path, kind):
    if kind == "jsonl":
        path.write_text("\n".join(json.dumps(r) for r in RECORDS) + "\n")
    elif kind == "json":
        path.write_text(json.dumps(RECORDS))
    elif kind == "csv":
        path.write_text(
            "instruction,output\n" + "".join(f'"{r["instruction"]}",{r["output"]}\n' for r in RECORDS)
        )
    else:
        datasets.Dataset.from_list(RECORDS).to_parquet(str(path))


@pytest.mark.parametrize("kind", ["jsonl", "json", "csv", "parquet"])
def test_local_files(tmp_path, kind):
    path = tmp_path / f"train.{kind}"
    _write(path, kind)
    dataset = load_data(path)
    assert isinstance(dataset, datasets.Dataset)
    assert [str(v) for v in dataset["output"]] == [r["output"] for r in RECORDS]
    assert dataset["instruction"] == [r["instruction"] for r in RECORDS]
    assert len(load_data(str(path), split="train[:2]")) == 2


def test_folder_of_files(tmp_path):
    _write(tmp_path / "part.jsonl", "jsonl")
    assert load_data(tmp_path)["instruction"] == [r["instruction"] for r in RECORDS]


def test_records_in_memory():
    assert load_data(RECORDS)["output"] == [r["output"] for r in RECORDS]
    columns = {"instruction": [r["instruction"] for r in RECORDS], "output": [r["output"] for r in RECORDS]}
    assert load_data(columns).num_rows == 5
    import pandas

    assert load_data(pandas.DataFrame(RECORDS)).column_names == ["instruction", "output"]
    splits = datasets.DatasetDict({"train": as_dataset(RECORDS), "test": as_dataset(RECORDS[:1])})
    assert load_data(splits, split="test").num_rows == 1


@pytest.mark.parametrize(
    "source, error, match",
    [
        ("missing/train.jsonl", FileNotFoundError, "no such data file or folder"),
        ("./nowhere", FileNotFoundError, "no such data file or folder"),
        ([], ValueError, "the list of records is empty"),
        ([{"a": 1}, "b"], ValueError, "record 1 is str"),
        ({"a": [1, 2], "b": [1]}, ValueError, "lists of one length"),
        (42, TypeError, "cannot use int as a dataset"),
    ],
)
def test_bad_sources(source, error, match):
    with pytest.raises(error, match=match):
        load_data(source)


def test_unknown_file_type_and_split(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("hello")
    with pytest.raises(ValueError, match="unknown file type; accepted: .csv, .json, .jsonl, .parquet"):
        load_data(path)
    with pytest.raises(
        ValueError, match="split 'validation' not in this DatasetDict; its splits: \\['train'\\]"
    ):
        load_data(datasets.DatasetDict({"train": as_dataset(RECORDS)}), split="validation")


def test_hub_names_go_to_load_dataset(monkeypatch):
    calls = []

    def fake_load_dataset(name, split=None, **kwargs):
        calls.append((name, split, kwargs))
        return as_dataset(RECORDS)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    assert load_data("yahma/alpaca-cleaned", split="train[:10]", revision="main").num_rows == 5
    assert calls == [("yahma/alpaca-cleaned", "train[:10]", {"revision": "main"})]


def test_hub_failure_offline_is_explained(monkeypatch):
    import huggingface_hub

    # datasets and huggingface_hub read the switch when imported; set their copies too.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    match = "could not load 'slothkit-test/no-such-dataset'.*HF_HUB_OFFLINE is set"
    with pytest.raises(FileNotFoundError, match=match):
        load_data("slothkit-test/no-such-dataset")


@pytest.mark.parametrize(
    "name, content, expected",
    [
        ("empty.jsonl", "", r"is empty: it holds no records; a \.jsonl file holds one JSON object per line"),
        ("blank.jsonl", "\n\n  \n", r"is empty: .* one JSON object per line"),
        ("empty.csv", "", r"a \.csv file holds a header row naming the columns"),
    ],
)
def test_an_empty_file_says_it_is_empty(tmp_path, name, content, expected):
    (tmp_path / name).write_text(content)
    with pytest.raises(ValueError, match=expected):  # was a bare StopIteration
        load_data(str(tmp_path / name))


@pytest.mark.parametrize(
    "name, content, offset, line",
    [
        ("latin1.jsonl", b'{"text": "ok"}\n{"text": "caf\xe9"}\n', 28, 2),
        ("latin1.json", b'[{"text": "ok"},\n {"text": "caf\xe9"}]', 31, 2),
        ("latin1.csv", b"text,label\nhello,1\ncaf\xe9,2\n", 22, 3),
    ],
)
def test_a_file_that_is_not_utf8_names_the_file_the_byte_and_the_fix(tmp_path, name, content, offset, line):
    path = tmp_path / name
    path.write_bytes(content)
    assert content[offset] == 0xE9
    for source in (path, tmp_path):  # the file, and a folder holding it
        with pytest.raises(ValueError) as error:  # was UnicodeDecodeError or DatasetGenerationError
            load_data(source)
        message = str(error.value)
        assert message.startswith(f"{str(path)!r} is not UTF-8: byte 0xe9 at offset {offset} (line {line})")
        assert "(in latin-1, 0xe9 is 'é')" in message and "iconv -f latin1 -t utf-8" in message
    advises_encoding = 'load_data(path, encoding="latin-1")' in message
    assert advises_encoding == (path.suffix != ".json")  # datasets decodes a .json array as UTF-8 regardless
    if advises_encoding:
        assert load_data(path, encoding="latin-1")["text"][-1] == "café"


def test_the_utf8_scan_finishes_characters_cut_by_its_chunks(monkeypatch, tmp_path):
    from slothkit.data import text_encoding

    monkeypatch.setattr(text_encoding, "_CHUNK", 3)
    path = tmp_path / "x.jsonl"
    path.write_bytes("aé\n€😀\n".encode() + b"\xe9z")  # 2-, 3- and 4-byte characters across chunk ends
    found = text_encoding.first_invalid_utf8(path)
    assert (found.offset, found.line, found.byte) == (12, 3, 0xE9)
    path.write_bytes("aé\n€😀\n".encode())
    assert text_encoding.first_invalid_utf8(path) is None
    path.write_bytes(b"ab\xe2\x82")  # cut short at the end of the file
    found = text_encoding.first_invalid_utf8(path)
    assert (found.offset, found.line, found.byte) == (2, 1, 0xE2)


SURROGATE = "lone surrogate '\\\\ud800' at character 1 \\(after 'a'\\): half of a UTF-16 pair"


def test_a_lone_surrogate_names_the_file_or_the_record_and_column(tmp_path):
    import pandas as pd

    from slothkit.data.loading import records_as_dataset

    path = tmp_path / "train.jsonl"  # "\ud800" escapes, as json.dumps writes half an emoji
    path.write_text('{"text": "ok"}\n\n{"text": "ok"}\n{"text": "a\\ud800b"}\n')
    with pytest.raises(ValueError, match=f"^'{path}', line 4: record 2 \\('text'\\) holds a {SURROGATE}"):
        load_data(path)  # was DatasetGenerationError: "An error occurred while generating the dataset"
    bad = "a\ud800b"
    for records in (
        [{"text": "ok"}, {"text": bad}],
        {"id": [1, 2], "text": ["ok", bad]},
        pd.DataFrame({"text": pd.Series(["ok", bad], dtype=object)}),
    ):
        with pytest.raises(ValueError, match=f"^record 1 \\('text'\\) holds a {SURROGATE}"):
            load_data(records)  # was UnicodeEncodeError: "... surrogates not allowed", naming no record
    # A .json array: datasets drops the escape without a word (the text read "ab").
    path = tmp_path / "train.json"
    path.write_text('[{"text": "ok \\ud83d\\ude00"}, {"text": "a\\ud800b"}]')
    with pytest.raises(ValueError, match=f"^'{path}': record 1 \\('text'\\) holds a {SURROGATE}"):
        load_data(path)
    path.write_text('[{"text": "ok \\ud83d\\ude00"}, {"text": "ab"}]')  # an escaped pair is an emoji
    assert load_data(path)["text"] == ["ok \U0001f600", "ab"]
    messages = [
        {"messages": [{"role": "user", "content": "ok"}]},
        {"messages": [{"role": "user", "content": bad}]},
    ]
    match = f"^train_dataset: record 1 \\('messages'\\[0\\]\\['content'\\]\\) holds a {SURROGATE}"
    with pytest.raises(ValueError, match=match):
        records_as_dataset(messages, "train_dataset")
