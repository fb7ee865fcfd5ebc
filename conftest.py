"""Settings for every test process, under tests/ and notebooks/ alike.

How the README's command (``pytest -n 2 --dist loadgroup``) shares the tests between its
two workers: each file's tests go to one worker together (``xdist_group``: a notebook's
cells share one kernel, and a module's fixtures are built once), except in the files of
``SPREAD``, whose tests are independent and long (each several minutes under the Triton
interpreter): those go one by one to whichever worker is free, so that no single file
sets the suite's length.

The README's test command runs pytest-xdist workers, one per core.  torch gives each
process a thread per core as well, and OpenMP threads spin while they wait, so two
workers with two threads each (and a notebook's kernel beside them) fight over two cores:
a matmul ran at a fraction of its speed that way.  So each worker, and what it starts
(notebook kernels, child Pythons, which inherit the variables), computes on one thread.
"""

import os

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


@pytest.hookimpl(tryfirst=True)  # before xdist's worker reads the marks into node ids
def pytest_collection_modifyitems(config, items):
    for item in items:
        path = item.nodeid.split("::")[0]
        if path not in SPREAD:
            item.add_marker(pytest.mark.xdist_group(path))
