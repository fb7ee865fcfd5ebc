"""The hardware cell's word on machines with several GPUs (Kaggle's two T4s, a workstation).

A notebook kernel is one process and trains on one GPU; that stays the default.  To train
on all of them, the notebook runs as a script under a launcher that starts one process
per GPU, each training its own copy of the model on its own batches under PyTorch's
DistributedDataParallel (slothkit.core.distributed says what slothkit sets for it):

    jupytext --to py:percent NOTEBOOK.ipynb -o train.py
    torchrun --nproc-per-node 2 --local-ranks-filter 0 train.py

(``--local-ranks-filter 0`` shows the main process's output only; every process prints
the same cells.)  The script is the notebook's cells in order, and its Config cell's
values may be changed by the SLOTHKIT_* variables (docs/configuration.md); only the main
process saves.  docs/multi-gpu.md has the details.
"""

from __future__ import annotations

import functools

from slothkit.core.distributed import Launch


def launch_commands(gpus: int, notebook: str = "NOTEBOOK.ipynb", script: str = "train.py") -> list[str]:
    """The commands that run a notebook on ``gpus`` GPUs: export it, then launch it.

    Args:
        gpus: how many processes (one per GPU).
        notebook: the notebook's file.
        script: the script to write.

    Returns:
        The two shell commands, in order.
    """
    return [
        f"jupytext --to py:percent {notebook} -o {script}",
        f"torchrun --nproc-per-node {gpus} --local-ranks-filter 0 {script}",
    ]


def multi_gpu_notice(gpus: int, launch: Launch) -> str | None:
    """What the hardware cell says about the other GPUs, or None with one GPU and one
    process.

    Args:
        gpus: the GPUs this machine has.
        launch: this process's place among the launched ones (slothkit.core.distributed).

    Returns:
        Under a launcher, which process this is and how the batch adds up; with more GPUs
        than processes, how to launch on all of them.
    """
    if launch.distributed:
        return (
            f"process {launch.rank} of {launch.world_size} on GPU {launch.local_rank} (DistributedDataParallel): "
            f"each process trains BATCH_SIZE x GRAD_ACCUM samples per step, {launch.world_size} x that in all; "
            f"only process 0 saves"
        )
    if gpus < 2:
        return None
    export, run = launch_commands(gpus)
    return "\n".join(
        [
            f"This machine has {gpus} GPUs; this notebook trains on the first one only. To train on all {gpus}",
            f"(one process per GPU, each with BATCH_SIZE x GRAD_ACCUM samples per step: {gpus} x the batch), save",
            "the notebook, then run it as a script in a terminal, or in a new cell with '!' before each line:",
            f"    {export}",
            f"    {run}",
            "(NOTEBOOK.ipynb: this notebook's file; `accelerate launch --multi_gpu --num_processes "
            f"{gpus} train.py` works too; docs/multi-gpu.md)",
        ]
    )


@functools.cache
def print_multi_gpu_notice_once(gpus: int, launch: Launch) -> None:
    """Print ``multi_gpu_notice`` the first time the hardware cell runs with these values.

    Args:
        gpus: as ``multi_gpu_notice``.
        launch: as ``multi_gpu_notice``.
    """
    notice = multi_gpu_notice(gpus, launch)
    if notice is not None:
        print(notice)
