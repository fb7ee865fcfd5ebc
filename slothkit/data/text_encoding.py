"""Text that is not UTF-8, found where it is: the file, the byte and the line.

datasets reads .json, .jsonl and .csv files as UTF-8, and fails on other bytes with an
error that names neither the file nor the place ("'utf-8' codec can't decode byte 0xe9 in
position 3", the position counted from the start of a block it read, or "An error occurred
while generating the dataset").  load_data catches such a failure and scans the file once
to say where it is; a load that succeeds pays nothing.
"""

from __future__ import annotations

import dataclasses
import pathlib

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
