"""What slothkit does differently when a launcher starts one process per GPU.

``torchrun --nproc-per-node N`` and ``accelerate launch --multi_gpu --num_processes N`` start N copies
of the training script and tell each which one it is through the environment: WORLD_SIZE
(N), RANK (this process, 0..N-1, over all machines) and LOCAL_RANK (its GPU on this
machine).  Each process loads its own model, patches its own instance and trains it
under PyTorch's DistributedDataParallel (the Hugging Face Trainer wraps the model itself
when WORLD_SIZE > 1); only the LoRA parameters require grad, so only their gradients are
all-reduced, bucketed by DDP and overlapped with the backward pass.

Three things follow for slothkit, and this module is where they are decided:

- the model of each process goes to its own GPU (``device_map_for_process``): without
  it every process would load onto GPU 0, the current device until accelerate sets
  another, which happens only when the trainer's config is built, after loading;
- the trainers' DDP must not search for unused parameters (``ddp_defaults``): the
  offloaded checkpoint (slothkit.engine.checkpointing.offload_checkpoint) runs each layer's backward
  inside its own autograd call, as reentrant checkpointing does, and DDP's search (which
  the Trainer turns on for a PeftModel) would first count the layer's parameters as
  unused, then see their gradients arrive, and stop with "Expected to mark a variable
  ready only once" (the rest of what the configs get: ``ddp_defaults``);
- only one process writes the results (``is_main_process``).

The launcher's variables are read here and nowhere else; docs/configuration.md lists them.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import warnings
from collections.abc import Mapping

import torch


@dataclasses.dataclass(frozen=True)
class Launch:
    """Where this process stands among those a launcher started.

    Attributes:
        world_size: how many processes train together (1 without a launcher).
        rank: this process's number among them, 0 for the main one.
        local_rank: its number on this machine, which is its GPU's index.
    """

    world_size: int = 1
    rank: int = 0
    local_rank: int = 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


LAUNCHER_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK")


def launch(environ: Mapping[str, str] | None = None) -> Launch:
    """This process's place among the launched ones, from WORLD_SIZE, RANK and LOCAL_RANK.

    Args:
        environ: the variables to read; None (the default) reads ``os.environ``.

    Returns:
        The ``Launch``; ``Launch()`` (one process) when WORLD_SIZE is unset.

    Raises:
        ValueError: a variable is not a whole number, RANK / LOCAL_RANK is outside
            0..WORLD_SIZE-1, or WORLD_SIZE > 1 comes without either (no launcher); the
            message names the variable and its value.
    """
    environ = os.environ if environ is None else environ
    values = {}
    for name in LAUNCHER_VARIABLES:
        text = environ.get(name, "")
        if text == "":
            continue
        try:
            values[name] = int(text)
        except ValueError:
            raise ValueError(
                f"{name}={text!r}; a launcher (torchrun, accelerate launch) sets it to a whole number"
            ) from None
    world_size = values.get("WORLD_SIZE", 1)
    if world_size > 1 and "RANK" not in values and "LOCAL_RANK" not in values:
        # A launcher sets all three; WORLD_SIZE alone (left in a shell, or set by hand) would
        # have the trainer wait forever for processes nobody started.
        raise ValueError(
            f"WORLD_SIZE={world_size} but RANK is unset: this process was not started by a launcher, "
            f"and training would wait forever for the other {world_size - 1}; start it with "
            f"`torchrun --nproc_per_node={world_size} script.py` (or accelerate launch), or unset WORLD_SIZE"
        )
    rank = values.get("RANK", 0)
    local_rank = values.get("LOCAL_RANK", rank)
    if world_size < 1 or not 0 <= rank < world_size or not 0 <= local_rank < world_size:
        raise ValueError(
            f"WORLD_SIZE={world_size}, RANK={rank}, LOCAL_RANK={local_rank}; accepted: WORLD_SIZE >= 1 "
            "and RANK, LOCAL_RANK in 0..WORLD_SIZE-1 (as torchrun and accelerate launch set them)"
        )
    return Launch(world_size=world_size, rank=rank, local_rank=local_rank)


def is_main_process(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process writes what the run produces (rank 0, or the only process).

    Args:
        environ: as ``launch``.
    """
    return launch(environ).rank == 0


def select_process_gpu(environ: Mapping[str, str] | None = None) -> int | None:
    """The GPU this process trains on, made the current device: under a launcher the GPU
    of LOCAL_RANK (as accelerate does later, when the trainer's config is built), else
    the current one; None without a GPU.  Call it before anything touches CUDA: a
    process's first CUDA call creates its context (some 300 MiB) on the current device,
    which is GPU 0 until set.

    Args:
        environ: as ``launch``.

    Raises:
        ValueError: LOCAL_RANK names a GPU this machine does not have.
    """
    if not torch.cuda.is_available():
        return None
    where = launch(environ)
    if not where.distributed:
        return torch.cuda.current_device()
    count = torch.cuda.device_count()
    if where.local_rank >= count:
        raise ValueError(
            f"LOCAL_RANK={where.local_rank} but this machine has {count} GPU(s): start at most "
            f"{count} processes per machine (torchrun --nproc-per-node {count})"
        )
    torch.cuda.set_device(where.local_rank)
    return where.local_rank


def device_map_for_process(environ: Mapping[str, str] | None = None) -> dict | None:
    """Where ``FastModel.from_pretrained`` puts the model when no device_map is given: the
    GPU of ``select_process_gpu`` (under a launcher, LOCAL_RANK's, made current: Triton
    launches its kernels and CUDA graphs capture on the current device, whatever device
    the tensors are on).

    Args:
        environ: as ``launch``.

    Returns:
        ``{"": gpu_index}``, or None (the CPU) when there is no GPU.

    Raises:
        ValueError: LOCAL_RANK names a GPU this machine does not have.
    """
    gpu = select_process_gpu(environ)
    return None if gpu is None else {"": gpu}


_WHY = {
    "ddp_find_unused_parameters": "slothkit's checkpointing nests each layer's backward, which DDP's search "
    "cannot follow",
    "ddp_broadcast_buffers": "the buffers, rotary frequencies, are equal everywhere and never change",
    "use_cpu": "without a GPU, accelerate otherwise trains each process alone",
}


@functools.cache
def _say_once(message: str) -> None:
    warnings.warn(message, stacklevel=4)  # the caller of the config builder


def ddp_defaults(environ: Mapping[str, str] | None = None) -> dict:
    """The trainer config keywords slothkit sets when WORLD_SIZE > 1: no search for unused
    parameters (module docstring: the offloaded checkpoint and DDP's search clash, and
    every LoRA parameter is used in every step anyway); no broadcast of the model's
    buffers before every forward (a collective per step that copies rotary frequencies
    every process computed alike); and on a machine without a GPU, ``use_cpu=True``,
    without which accelerate starts no process group on the CPU and each process trains
    alone on all the data.  Said once, by the main process.

    Args:
        environ: as ``launch``.

    Returns:
        ``{"ddp_find_unused_parameters": False, "ddp_broadcast_buffers": False}`` (and
        ``"use_cpu": True`` without a GPU) under a launcher, else {}.
    """
    where = launch(environ)
    if not where.distributed:
        return {}
    settings = {"ddp_find_unused_parameters": False, "ddp_broadcast_buffers": False}
    if not torch.cuda.is_available():
        settings["use_cpu"] = True
    if where.rank == 0:
        _say_once(
            f"slothkit: {where.world_size} processes (WORLD_SIZE): the trainer's config gets "
            + "; ".join(f"{name}={value} ({_WHY[name]})" for name, value in settings.items())
        )
    return settings


def check_ddp_settings(args, checkpointing_nested: bool, environ: Mapping[str, str] | None = None) -> None:
    """Make a trainer config that slothkit's builders did not make safe under DDP: its
    ``ddp_find_unused_parameters`` left at None (the Trainer would search, since a
    PeftModel is not a PreTrainedModel) becomes False; True is refused where the model's
    checkpointing nests its backward (the search would stop training at the first step),
    and so is ``use_cpu=False`` on a machine without a GPU (``ddp_defaults``).

    Args:
        args: the trainer's config (TrainingArguments or a TRL config); may be changed.
        checkpointing_nested: whether the model's layers use slothkit's offloaded
            checkpoint, which runs each layer's backward inside its own.
        environ: as ``launch``.

    Raises:
        ValueError: under a launcher, ``ddp_find_unused_parameters=True`` with nested
            checkpointing, or ``use_cpu=False`` on a machine without a GPU.
    """
    if not launch(environ).distributed or not hasattr(args, "ddp_find_unused_parameters"):
        return
    if not torch.cuda.is_available() and not getattr(args, "use_cpu", False):
        raise ValueError(
            f"{launch(environ).world_size} processes (WORLD_SIZE) on a machine without a GPU, and use_cpu=False: "
            "accelerate would start no process group, and each process would train alone on all the data; "
            "set use_cpu=True in the trainer's config (slothkit's config builders do)"
        )
    if args.ddp_find_unused_parameters is None:
        args.ddp_find_unused_parameters = ddp_defaults(environ)["ddp_find_unused_parameters"]
    elif args.ddp_find_unused_parameters and checkpointing_nested:
        raise ValueError(
            "ddp_find_unused_parameters=True with slothkit's offloaded checkpointing: DDP would count each "
            "layer's parameters as unused, then see their gradients arrive inside the layer's own backward, "
            "and stop with 'Expected to mark a variable ready only once'. Every LoRA parameter is used in "
            "every step: set ddp_find_unused_parameters=False (slothkit's configs do), or "
            "use_gradient_checkpointing=True in FastModel.get_peft_model"
        )
