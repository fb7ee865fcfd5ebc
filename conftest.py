"""Settings for every test process, under tests/ and notebooks/ alike.

The README's test command runs pytest-xdist workers, one per core.  torch gives each
process a thread per core as well, and OpenMP threads spin while they wait, so two
workers with two threads each (and a notebook's kernel beside them) fight over two cores:
a matmul ran at a fraction of its speed that way.  So each worker, and what it starts
(notebook kernels, child Pythons, which inherit the variables), computes on one thread.
"""

import os

if os.environ.get("PYTEST_XDIST_WORKER"):
    for variable in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[variable] = "1"
    import torch

    torch.set_num_threads(1)
