"""Text that is not UTF-8, found where it is: the file, the byte and the line.

datasets reads .json, .jsonl and .csv files as UTF-8.  Other bytes fail with an error that
names neither the file nor the place ("An error occurred while generating the dataset"),
or, in a .jsonl file, pass pyarrow's reader and fail when a record is read ("'utf-8' codec
can't decode byte 0xe9 in position 3", counted from the start of the string).  load_data
checks the loaded table's strings (pyarrow's full validation, gigabytes a second) and, once
a load has failed, scans the file to say where the byte is.

A lone surrogate (a code point U+D800 to U+DFFF: half of a UTF-16 pair, alone) is no
character: a JSON escape such as "\\ud800" or text decoded with errors="surrogateescape"
puts one in a Python string, which UTF-8, pyarrow and the tokenizers then refuse ("The
surrogate pair in string is invalid. in row 0", "surrogates not allowed", "TextEncodeInput
must be Union[...]").  The record and column that hold it are named where slothkit first
sees the text: records in memory (as_dataset), the trainers' checks (validation), and a file
whose load failed on one.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re

_CHUNK = 1 << 20

# Builders that take encoding= and read the file with it (checked: datasets' csv builder, and
# its json builder for JSON Lines; a .json array is decoded as UTF-8 whatever is passed).
_ENCODING_WORKS = (".csv", ".jsonl")


@dataclasses.dataclass(frozen=True)
class InvalidByte:
    offset: int  # from the start of the file, counting from 0
    line: int  # counting from 1
    byte: int


def first_invalid_utf8(path: pathlib.Path) -> InvalidByte | None:
    """The first byte of `path` that does not start valid UTF-8, read in chunks."""
    offset, line, carry = 0, 1, b""
    with open(path, "rb") as file:
        while True:
            chunk = file.read(_CHUNK)
            data = carry + chunk
            try:
                data.decode("utf-8")
                good = len(data)
            except UnicodeDecodeError as error:
                if not (chunk and error.reason == "unexpected end of data"):
                    return InvalidByte(
                        offset + error.start, line + data.count(b"\n", 0, error.start), data[error.start]
                    )
                good = error.start  # a character cut by the chunk's end: finish it with the next chunk
            if not chunk:
                return None
            line += data.count(b"\n", 0, good)
            offset += good
            carry = data[good:]


def is_decoding_failure(error: BaseException) -> bool:
    """Whether `error` (or what it wraps) is a failure to read bytes as UTF-8."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if (
            isinstance(error, UnicodeDecodeError)
            or "utf-8" in str(error).lower()
            or "utf8" in str(error).lower()
        ):
            return True
        error = error.__cause__ or error.__context__
    return False


def not_utf8_error(path: pathlib.Path, found: InvalidByte) -> ValueError:
    """One line: the file, where its first byte that is not UTF-8 lies, and what to do."""
    byte = f"0x{found.byte:02x}"
    latin1 = (
        f" (in latin-1, {byte} is {bytes([found.byte]).decode('latin-1')!r})" if found.byte >= 0xA0 else ""
    )
    fix = f"re-save it as UTF-8, e.g. `iconv -f latin1 -t utf-8 {path.name} > utf8-{path.name}`"
    if path.suffix.lower() in _ENCODING_WORKS:
        fix += ', or read it as it is with load_data(path, encoding="latin-1") (or its real encoding)'
    return ValueError(
        f"{str(path)!r} is not UTF-8: byte {byte} at offset {found.offset} (line {found.line}) is not "
        f"valid UTF-8{latin1}; {fix}"
    )


class LoneSurrogateError(ValueError):
    """Text holds a lone surrogate; the message names the record, the column and the place."""


_SURROGATE = re.compile("[\ud800-\udfff]")
SURROGATE_FIX = (
    "half of a UTF-16 pair, which is no character and cannot be written as UTF-8 or tokenized; "
    "fix the text that produced it, or replace it: text.encode('utf-8', 'replace').decode() puts '?' there"
)


def lone_surrogate_at(text: str) -> int | None:
    """The index of the first surrogate code point in `text`, or None.  ASCII text, most
    text, costs nothing: a str knows whether it is ASCII."""
    if text.isascii():
        return None
    match = _SURROGATE.search(text)
    return match.start() if match else None


def check_no_lone_surrogate(text: str, where: str) -> None:
    index = lone_surrogate_at(text)
    if index is not None:
        raise LoneSurrogateError(
            f"{where} holds a lone surrogate {text[index]!r} at character {index} "
            f"(after {text[max(0, index - 20) : index]!r}): {SURROGATE_FIX}"
        )


def check_records(records, where: str = "record") -> None:
    """LoneSurrogateError for the first string in `records` (dicts) holding a lone surrogate,
    naming the record's index and its column (and, inside lists and dicts, the path)."""
    for index, record in enumerate(records):
        if isinstance(record, dict):
            check_record(record, f"{where} {index}")


def check_record(record: dict, where: str) -> None:
    for column, value in record.items():
        for path, text in _strings(value, repr(column)):
            check_no_lone_surrogate(text, f"{where} ({path})")


def _strings(value, path: str):
    if isinstance(value, str):
        yield path, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _strings(item, f"{path}[{key!r}]")
    elif isinstance(value, (list, tuple)):
        for position, item in enumerate(value):
            yield from _strings(item, f"{path}[{position}]")


def is_surrogate_failure(error: BaseException) -> bool:
    """Whether `error` (or what it wraps) is pyarrow's or a codec's refusal of a surrogate."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if "surrogate" in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False


def check_json_file(path: pathlib.Path) -> None:
    """LoneSurrogateError naming the record (and line) of a .json or .jsonl file that holds a
    lone surrogate; run after a load failed on one, so it may read the whole file."""
    if path.suffix.lower() == ".jsonl":
        with open(path, encoding="utf-8") as file:
            index = 0
            for line_number, line in enumerate(file, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError:
                    return  # not JSON Lines after all: datasets' own error stands
                if isinstance(record, dict):
                    check_record(record, f"{str(path)!r}, line {line_number}: record {index}")
                index += 1
        return
    try:
        records = json.loads(path.read_text(encoding="utf-8"))
    except ValueError:
        return
    if isinstance(records, list):
        check_records(records, f"{str(path)!r}: record")


# A JSON escape of a surrogate code point (\ud800 to \udfff): half of a UTF-16 pair, or one
# alone. An escaped pair (an emoji written \ud83d\ude00) is a character; a lone one is not.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def check_json_array_file(path: pathlib.Path) -> None:
    """LoneSurrogateError naming the record of a .json file (a JSON array) that escapes a
    lone surrogate. datasets reads such a file without an error and drops the surrogate
    from the text, so the check runs after every load of one: a scan of the bytes for a
    surrogate escape (a few GB a second), then, only where one is found, a parse that
    tells pairs from lone halves."""
    with open(path, "rb") as file:
        carry = b""
        while chunk := file.read(_CHUNK):
            if _SURROGATE_ESCAPE.search(carry + chunk):
                check_json_file(path)
                return
            carry = chunk[-5:]  # an escape cut between two chunks
