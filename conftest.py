"""Settings for every test process, under tests/ and notebooks/ alike.

How the README's command (``pytest -n 2 --dist loadfile``) shares the tests between its
two workers: each file's tests go to one worker together (a notebook's cells share one
kernel, and a module's fixtures are built once), except in the files of ``SPREAD``, whose
tests are independent and long (each several minutes under the Triton interpreter): those
go one by one to whichever worker is free, so that no single file sets the suite's length.

The grouping is decided in the controller from the test ids alone (``scope_of``), by a
scheduler this file hands to pytest-xdist.  It used to be an ``xdist_group`` mark per
file, which pytest-xdist turns into a suffix of the test id on the worker; pytest 9.2
made the id read-only, the suffix silently vanished, and notebooks ran split across both
workers, each half meeting NameErrors.  Without this file's scheduler, ``loadfile`` alone
still keeps every file whole.  And whatever changes in pytest, pytest-xdist or nbval, the
run fails, naming the file, if a file outside ``SPREAD`` ran on two workers (the hooks
after ``scope_of``).

The README's test command runs pytest-xdist workers, one per core.  torch gives each
process a thread per core as well, and OpenMP threads spin while they wait, so two
workers with two threads each (and a notebook's kernel beside them) fight over two cores:
a matmul ran at a fraction of its speed that way.  So each worker, and what it starts
(notebook kernels, child Pythons, which inherit the variables), computes on one thread.
"""

import os
from collections import defaultdict

import pytest

SPREAD = {
    "tests/slothkit/test_fast_model.py",
    "tests/slothkit/test_real_model_training.py",
    "tests/slothkit/test_unsloth_notebooks.py",
    "tests/slothkit/test_cli.py",
}

if os.environ.get("PYTEST_XDIST_WORKER"):
    for variable in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[variable] = "1"
    import torch

    torch.set_num_threads(1)


REPORTED_VERSIONS = (
    "torch",
    "triton",
    "transformers",
    "peft",
    "accelerate",
    "trl",
    "datasets",
    "huggingface_hub",
    "bitsandbytes",
    "pytest",
    "pytest-xdist",
    "nbval",
    "nbclient",
    "ipykernel",
)


def pytest_report_header(config):
    """The versions a run resolved, first in its output: CI installs today's releases."""
    from importlib.metadata import PackageNotFoundError, version

    def version_of(name):
        try:
            return version(name)
        except PackageNotFoundError:
            return "absent"

    return "versions: " + ", ".join(f"{name} {version_of(name)}" for name in REPORTED_VERSIONS)


def scope_of(nodeid: str) -> str:
    """The unit that one worker runs whole: the test's file, or the test alone in SPREAD."""
    path = nodeid.split("::", 1)[0]
    return nodeid if path in SPREAD else path


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist's, absent without it
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class FileScheduling(LoadFileScheduling):
        """loadfile, except that the tests of SPREAD files are scheduled one by one."""

        def _split_scope(self, nodeid):
            return scope_of(nodeid)

    return FileScheduling(config, log)


# scope -> worker ids that ran one of its tests; filled in the controller only, where
# pytest-xdist attaches the worker to each report.
_workers_of_scope: dict[str, set[str]] = defaultdict(set)
_split_scopes: list[str] = []


def pytest_runtest_logreport(report):
    worker = getattr(report, "node", None)
    if worker is not None:
        _workers_of_scope[scope_of(report.nodeid)].add(worker.workerinput["workerid"])


def pytest_sessionfinish(session, exitstatus):
    _split_scopes[:] = sorted(scope for scope, workers in _workers_of_scope.items() if len(workers) > 1)
    if _split_scopes and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter):
    """Name every file whose tests ran on more than one worker (the run has failed)."""
    if not _split_scopes:
        return
    terminalreporter.section("files split across workers", sep="=", red=True, bold=True)
    for scope in _split_scopes:
        workers = ", ".join(sorted(_workers_of_scope[scope]))
        terminalreporter.line(f"{scope} ran on {workers}: its tests share a kernel or fixtures")
    terminalreporter.line(
        "Each file must run whole on one worker: use `pytest -n 2 --dist loadfile` (conftest.py says why)."
    )
