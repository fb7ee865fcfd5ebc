"""`slothkit bench train --gpus N`: each implementation on N GPUs under DDP, and on one.

The parent (slothkit.bench.train) starts the worker under torchrun with N processes, one
per GPU; each process builds the model on its GPU, wraps it in PyTorch's
DistributedDataParallel (NCCL) and trains with the per-GPU batch given, on its own
random tokens.  Process 0 gathers what each measured and reports it as one result:

    tokens_per_s   summed over the processes (each its batch x seq / its median step)
    step_s         the step time that sum corresponds to (N x batch x seq / tokens_per_s)
    per_gpu        each process's step time, tokens/s and peak memory
    peak_*_gib     the largest of the processes' peaks
    losses         the mean over the processes of each step's loss (the global batch's)
    adapters_in_sync  whether every process ended with the same trained parameters,
                   bit for bit, as DDP's all-reduced gradients make them

The same implementation also runs on one GPU, and the record's row holds both: the
scaling ratio (tokens/s on N GPUs over tokens/s on one) and the per-GPU memory against
the one-GPU run's (``with_scaling``).

GPU only: NCCL and the N GPUs.  Without a GPU, a tiny shape may run N processes on the
CPU (gloo) instead, which checks the plumbing, not the speed.
"""

from __future__ import annotations

import sys

import torch

from slothkit.core.distributed import Launch, launch

# Per-process memory figures: the gathered result keeps the largest; bench train
# carries them from a worker's result into its row.
PEAK_FIELDS = (
    "peak_allocated_gib",
    "peak_reserved_gib",
    "training_gib",
    "loaded_gib",
    "host_rss_gib",
    "peak_host_gib",
    "peak_host_before_steps_gib",
)


# -- the parent ------------------------------------------------------------------------


def launcher_command(gpus: int) -> list[str]:
    """How a worker starts: ``python``, or torchrun with one process per GPU.

    Args:
        gpus: the number of GPUs (processes).

    Returns:
        The command's first words; the parent adds ``-m slothkit.bench.train_worker ...``.
    """
    if gpus == 1:
        return [sys.executable]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(gpus)]


def check_gpus(gpus: int, model: str, available: int) -> None:
    """Refuse a --gpus this machine cannot run.

    Args:
        gpus: --gpus.
        model: --model (a tiny shape may run its processes on the CPU).
        available: the CUDA GPUs this machine has.

    Raises:
        ValueError: gpus below 1, or more than the machine has (on a machine without
            GPUs, for a shape that is not tiny).
    """
    if gpus < 1:
        raise ValueError(f"--gpus {gpus}; expected 1 or more")
    if gpus == 1 or available >= gpus or (available == 0 and model.startswith("tiny-")):
        return
    raise ValueError(
        f"--gpus {gpus} but this machine has {available} CUDA GPU(s); without GPUs only a tiny shape "
        f"(--model tiny-llama) runs its {gpus} processes on the CPU"
    )


def with_scaling(rows: list[dict], single_rows: list[dict]) -> list[dict]:
    """Each N-GPU row with its implementation's one-GPU figures beside it, and the ratios.

    Args:
        rows: the N-GPU runs' rows (slothkit.bench.train.summarise).
        single_rows: the one-GPU runs' rows, with their own vs_hf.

    Returns:
        ``rows``, each that trained (and whose one-GPU run trained) with "single_gpu"
        ({tokens_per_s, peak_allocated_gib, peak_reserved_gib, vs_hf}), "scaling"
        (tokens/s over the one-GPU tokens/s) and "memory_vs_single" (the largest
        per-GPU peak reserved over the one-GPU peak reserved, on a GPU).
    """
    single = {row["impl"]: row for row in single_rows}
    for row in rows:
        alone = single.get(row["impl"])
        if row["status"] != "ok" or alone is None or alone["status"] != "ok":
            continue
        row["single_gpu"] = {
            key: alone[key]
            for key in ("tokens_per_s", "peak_allocated_gib", "peak_reserved_gib", "vs_hf")
            if key in alone
        }
        row["scaling"] = row["tokens_per_s"] / alone["tokens_per_s"]
        if row.get("peak_reserved_gib") and alone.get("peak_reserved_gib"):
            row["memory_vs_single"] = row["peak_reserved_gib"] / alone["peak_reserved_gib"]
    return rows


# -- the worker ------------------------------------------------------------------------


def start_process_group() -> Launch:
    """In a worker started by torchrun: this process's GPU made current and the process
    group started (NCCL on GPUs, gloo on the CPU); ``Launch()`` when not launched.

    Returns:
        The ``Launch`` (slothkit.core.distributed).
    """
    where = launch()
    if not where.distributed:
        return where
    import torch.distributed as dist

    if torch.cuda.is_available():
        torch.cuda.set_device(where.local_rank)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return where


def wrap(model, where: Launch):
    """The model in DistributedDataParallel as the Trainer builds it for slothkit
    (slothkit.core.distributed.ddp_defaults): no search for unused parameters, no buffer
    broadcast; the model itself when not launched.

    Args:
        model: the prepared model (LoRA added).
        where: from ``start_process_group``.
    """
    if not where.distributed:
        return model
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [where.local_rank] if torch.cuda.is_available() else None
    return DistributedDataParallel(
        model, device_ids=device_ids, find_unused_parameters=False, broadcast_buffers=False
    )


def parameters_checksum(model) -> float:
    """A sum over every trainable parameter, in float64: equal in every process exactly
    when the processes trained alike."""
    return float(sum(p.detach().double().sum().item() for p in model.parameters() if p.requires_grad))


def gather(result: dict, where: Launch, batch: int, seq: int) -> dict | None:
    """Process 0's one result for the run, from every process's (module docstring); None
    in the other processes.

    Args:
        result: this process's result ("step_s", "losses", "checksum", the peaks).
        where: from ``start_process_group``.
        batch: the per-GPU batch size.
        seq: the sequence length.
    """
    import torch.distributed as dist

    results = [None] * where.world_size
    dist.all_gather_object(results, result)
    if where.rank != 0:
        return None
    tokens = [batch * seq / r["step_s"] for r in results]
    combined = {key: value for key, value in results[0].items() if key != "checksum"}
    combined.update(
        gpus=where.world_size,
        tokens_per_s=sum(tokens),
        step_s=where.world_size * batch * seq / sum(tokens),
        losses=[sum(step) / len(step) for step in zip(*(r["losses"] for r in results))],
        adapters_in_sync=len({r["checksum"] for r in results}) == 1,
        per_gpu=[
            {
                "rank": rank,
                "step_s": r["step_s"],
                "tokens_per_s": t,
                **{k: r[k] for k in PEAK_FIELDS if k in r},
            }
            for rank, (r, t) in enumerate(zip(results, tokens))
        ],
    )
    combined["final_loss"] = combined["losses"][-1]
    for key in PEAK_FIELDS:
        if key in results[0]:
            combined[key] = max(r[key] for r in results)
    return combined
