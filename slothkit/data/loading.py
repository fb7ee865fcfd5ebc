"""One entry point for training data: `load_data(source)` returns a `datasets.Dataset`.

    load_data("yahma/alpaca-cleaned")          # a Hugging Face Hub dataset
    load_data("data/train.jsonl")              # local .json, .jsonl, .csv, .parquet (or a folder of them)
    load_data([{"instruction": ..., ...}])     # records in memory (a list of dicts, a dict of lists,
                                               # a pandas DataFrame)

Everything goes through `datasets`, so the result maps, shuffles and caches like any other
dataset and TRL takes it as it is.
"""

from __future__ import annotations

import os
import pathlib

from slothkit.data.text_encoding import (
    LoneSurrogateError,
    check_json_array_file,
    check_json_file,
    check_records,
    first_invalid_utf8,
    is_decoding_failure,
    is_surrogate_failure,
    not_utf8_error,
)

# File extension -> the `datasets` builder that reads it.
FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


def as_dataset(data):
    """`data` as a datasets.Dataset: a Dataset or IterableDataset passes through; a list of
    dicts, a dict of lists or a pandas DataFrame is converted."""
    import datasets

    if isinstance(data, (datasets.Dataset, datasets.IterableDataset)):
        return data
    if isinstance(data, datasets.DatasetDict):
        raise TypeError(f"got a DatasetDict with splits {list(data)}; pass one split, e.g. data['train']")
    if isinstance(data, dict):
        lengths = {
            key: len(value) if isinstance(value, (list, tuple)) else None for key, value in data.items()
        }
        if not data or None in lengths.values() or len(set(lengths.values())) != 1:
            raise ValueError(
                f"a dict of records must map column names to lists of one length; got lengths {lengths}"
            )
        return _with_surrogates_named(
            lambda: datasets.Dataset.from_dict(data),
            lambda: (
                {column: data[column][i] for column in data} for i in range(next(iter(lengths.values())))
            ),
        )
    if isinstance(data, (list, tuple)):
        if len(data) == 0:
            raise ValueError("the list of records is empty")
        not_dicts = [i for i, record in enumerate(data) if not isinstance(record, dict)]
        if not_dicts:
            raise ValueError(
                f"records must be dicts; record {not_dicts[0]} is {type(data[not_dicts[0]]).__name__}"
            )
        return _with_surrogates_named(lambda: datasets.Dataset.from_list(list(data)), lambda: data)
    if type(data).__name__ == "DataFrame":
        return _with_surrogates_named(
            lambda: datasets.Dataset.from_pandas(data, preserve_index=False), lambda: data.to_dict("records")
        )
    raise TypeError(
        f"cannot use {type(data).__name__} as a dataset; accepted: datasets.Dataset, a list of dicts, "
        "a dict of lists, a pandas DataFrame (or a path or Hub name through load_data)"
    )


def _with_surrogates_named(convert, records):
    """convert(), with pyarrow's "surrogates not allowed" (which names no record) replaced
    by an error naming the record and column that hold the lone surrogate; the records are
    searched only once the conversion has failed."""
    try:
        return convert()
    except UnicodeEncodeError:
        check_records(records())
        raise


def records_as_dataset(data, argument: str):
    """A trainer's dataset argument, with a plain list of records turned into a Dataset
    (TRL's trainers take Datasets only, and fail on a list with an AttributeError); other
    values pass through for the trainer to judge.

    Args:
        data: what was passed.
        argument: its name, for the message ("train_dataset").

    Raises:
        ValueError: a list that is empty or holds something other than dicts.
    """
    if not isinstance(data, (list, tuple)):
        return data
    try:
        return as_dataset(data)
    except LoneSurrogateError as error:
        raise LoneSurrogateError(f"{argument}: {error}") from None
    except ValueError as error:
        raise ValueError(
            f"{argument}: {error}; pass a datasets.Dataset, or a list of dicts with one training "
            f"example each, such as {{'text': '...'}} or {{'messages': [...]}}"
        ) from None


def load_data(source, split: str = "train", **load_kwargs):
    """Load `source` as a datasets.Dataset.

    source: a Hub dataset name ("org/name"), a local file (.json, .jsonl, .csv, .parquet)
        or folder of such files, records in memory, a Dataset, or a DatasetDict.
    split: which split to return; slices work ("train[:100]"). A local file has a single
        "train" split.
    load_kwargs: passed to datasets.load_dataset (name=, data_files=, revision=, ...).
    """
    import datasets

    if isinstance(source, datasets.DatasetDict):
        if split not in source:
            raise ValueError(f"split {split!r} not in this DatasetDict; its splits: {list(source)}")
        return source[split]
    if not isinstance(source, (str, os.PathLike)):
        return as_dataset(source)

    path = pathlib.Path(source).expanduser()
    if path.is_file():
        builder = FILE_BUILDERS.get(_extension(path))
        if builder is None:
            raise ValueError(
                f"cannot read {str(path)!r}: unknown file type; accepted: {', '.join(sorted(FILE_BUILDERS))}"
            )
        _check_not_empty(path)
        return _read(
            path,
            load_kwargs,
            lambda: datasets.load_dataset(builder, data_files=str(path), split=split, **load_kwargs),
        )
    if path.is_dir():
        return _read(path, load_kwargs, lambda: datasets.load_dataset(str(path), split=split, **load_kwargs))
    if _extension(path) in FILE_BUILDERS or str(source).startswith((".", "/", "~")):
        raise FileNotFoundError(f"no such data file or folder: {str(path)!r}")
    return _load_from_hub(str(source), split, load_kwargs)


# What a record looks like in each kind of file, for the message about an empty one.
_RECORD_EXAMPLES = {
    ".jsonl": 'one JSON object per line, such as {"text": "..."}',
    ".json": 'a list of JSON objects, or one per line, such as {"text": "..."}',
    ".csv": "a header row naming the columns, then one record per line",
    ".parquet": "a table with one record per row",
}


def _check_not_empty(path: pathlib.Path) -> None:
    size = path.stat().st_size
    if size == 0 or (size < 4096 and not path.read_bytes().strip()):
        raise ValueError(
            f"{str(path)!r} is empty: it holds no records; a {_extension(path)} file holds "
            f"{_RECORD_EXAMPLES[_extension(path)]}"
        )


def _read(path: pathlib.Path, load_kwargs: dict, load):
    """load(), with the failures datasets' readers leave unexplained named: a bare
    StopIteration from files without a record, and bytes that are not UTF-8 (text_encoding),
    located by scanning the file(s) once the load has failed."""
    import datasets

    try:
        dataset = load()
        if isinstance(dataset, datasets.Dataset):
            # pyarrow's JSON reader keeps a .jsonl file's bytes that are not UTF-8, which then
            # fail when a record is read, in training; the full check reads gigabytes a second.
            dataset.data.table.validate(full=True)
    except StopIteration:
        raise ValueError(f"{str(path)!r} holds no records to read (empty files?)") from None
    except Exception as error:
        if is_surrogate_failure(error):
            for file in _text_files(path):
                if _extension(file) in (".json", ".jsonl"):
                    check_json_file(file)  # raises LoneSurrogateError naming the record
        if "encoding" in load_kwargs or not is_decoding_failure(error):
            raise
        for file in _text_files(path):
            found = first_invalid_utf8(file)
            if found is not None:
                raise not_utf8_error(file, found) from error
        raise
    # datasets' reader of a .json array drops a lone surrogate's escape without a word.
    for file in _text_files(path):
        if _extension(file) == ".json":
            check_json_array_file(file)
    return dataset


def _text_files(path: pathlib.Path) -> list[pathlib.Path]:
    if path.is_file():
        return [path]
    text_kinds = {ext for ext, builder in FILE_BUILDERS.items() if builder != "parquet"}
    return sorted(p for p in path.rglob("*") if p.is_file() and _extension(p) in text_kinds)


def _extension(path: pathlib.Path) -> str:
    return path.suffix.lower()


def _load_from_hub(name: str, split: str, load_kwargs: dict):
    import datasets

    try:
        return datasets.load_dataset(name, split=split, **load_kwargs)
    except (FileNotFoundError, ConnectionError, OSError, ValueError) as error:
        offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0") or os.environ.get(
            "HF_DATASETS_OFFLINE", "0"
        ) not in ("", "0")
        hint = " (HF_HUB_OFFLINE is set, so only datasets already in the local cache load)" if offline else ""
        raise FileNotFoundError(
            f"could not load {name!r} (split {split!r}) as a local path or from the Hugging Face Hub{hint}: "
            f"{type(error).__name__}: {error}"
        ) from error
