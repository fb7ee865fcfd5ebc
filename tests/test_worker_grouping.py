"""The README's test command keeps each file, and so each notebook, whole on one worker.

Runs the repository's conftest.py in a scratch project with the pytest, pytest-xdist and
nbval that are installed: a notebook whose later cells use names from its first must pass
under ``--dist loadfile``, and a file whose tests xdist spreads (``--dist load``) must
fail the run with the file's name, so a scheduling change can never turn back into a
notebook's NameErrors.
"""

import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

pytest.importorskip("xdist")
pytest.importorskip("nbval")

ROOT = Path(__file__).resolve().parents[1]
CELL_COUNT = 8


def make_project(folder: Path) -> None:
    shutil.copy(ROOT / "conftest.py", folder / "conftest.py")
    (folder / "pytest.ini").write_text("[pytest]\naddopts = -p no:cacheprovider --nbval-lax\n")
    # Each cell after the first reads the name the one before it wrote.
    cells = [nbformat.v4.new_code_cell("value_0 = 0")]
    cells += [nbformat.v4.new_code_cell(f"value_{i} = value_{i - 1} + 1") for i in range(1, CELL_COUNT)]
    cells.append(nbformat.v4.new_code_cell(f"assert value_{CELL_COUNT - 1} == {CELL_COUNT - 1}"))
    notebook = nbformat.v4.new_notebook(cells=cells)
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(notebook, folder / "chained.ipynb")
    # Four quick tests: xdist's plain load scheduling hands two to each worker.
    (folder / "test_four.py").write_text(
        "import pytest\n\n\n@pytest.mark.parametrize('i', range(4))\ndef test_quick(i):\n    assert i < 4\n"
    )


def run_pytest(folder: Path, *arguments: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "pytest", "-n", "2", *arguments]
    return subprocess.run(command, cwd=folder, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_loadfile_keeps_each_notebook_and_file_on_one_worker(tmp_path):
    make_project(tmp_path)
    result = run_pytest(tmp_path, "--dist", "loadfile", "-v")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert f"{CELL_COUNT + 5} passed" in output, output  # 9 cells + 4 tests
    assert "split across workers" not in output
    # pytest 9.2 under xdist prints a notebook's cells as "chained::ipynb::Cell N".
    for file, test_count in (("chained", CELL_COUNT + 1), ("test_four", 4)):
        lines = [line for line in output.splitlines() if file in line and "PASSED" in line]
        workers = {line.split("]")[0] for line in lines}
        assert len(lines) == test_count and len(workers) == 1, (file, workers, output)


@pytest.mark.slow
def test_a_file_split_across_workers_fails_the_run(tmp_path):
    make_project(tmp_path)
    (tmp_path / "chained.ipynb").unlink()
    result = run_pytest(tmp_path, "--dist", "load")
    output = result.stdout + result.stderr
    assert result.returncode == pytest.ExitCode.TESTS_FAILED, output
    assert "4 passed" in output, output
    assert "files split across workers" in output
    assert "test_four.py ran on gw0, gw1" in output, output
