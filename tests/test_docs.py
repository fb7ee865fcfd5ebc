"""The Markdown tables of README.md and docs/: every row has its header's cells. GitHub
splits a row at every `|` not escaped as `\\|`, inside code spans too, so a token such as
<|im_end|> written plainly in a cell shifts the rest of its row into new columns."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
UNESCAPED_BAR = re.compile(r"(?<!\\)\|")


def _cells(line: str) -> int:
    return len(UNESCAPED_BAR.split(line.strip().strip("|")))


def _table_rows(text: str):
    """(line number, header cells, row cells) for each row of each table."""
    header = None
    for number, line in enumerate(text.splitlines(), 1):
        if not line.lstrip().startswith("|"):
            header = None
            continue
        if header is None:
            header = _cells(line)
        yield number, header, _cells(line)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_table_row_has_its_headers_cells(page):
    wrong = [
        f"line {number}: {cells} cells under a header of {header}"
        for number, header, cells in _table_rows(page.read_text())
        if cells != header
    ]
    assert not wrong, f"{page.name}: " + "; ".join(wrong)
