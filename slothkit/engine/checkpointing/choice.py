"""Which gradient checkpointing a model's decoder layers get: ``enable_checkpointing``
installs one checkpointer on all of them (``offload_checkpoint``'s, torch's, or none),
with the automatic choices of CUDA graphs and kept sums; ``uses_offloaded_checkpoint``
says whether a model's layers run through an offloading one.
"""

from __future__ import annotations

import torch

from slothkit.engine.checkpointing.offload_checkpoint import DeviceCheckpointer, OffloadedCheckpointer


def uses_offloaded_checkpoint(layers) -> bool:
    """Whether any of ``layers`` is checkpointed through an ``OffloadedCheckpointer``, whose
    backward runs the layer's backward inside its own (as reentrant checkpointing does).

    Args:
        layers: the decoder layers, or any modules (``model.modules()``): those without
            transformers' checkpointing attributes count as not checkpointed.
    """
    return any(
        getattr(layer, "gradient_checkpointing", False)
        and isinstance(
            getattr(layer, "_gradient_checkpointing_func", None), (OffloadedCheckpointer, DeviceCheckpointer)
        )
        for layer in layers
    )


CUDA_GRAPHS_CHOICES = (None, True, False, "forward")
KEEP_SUMS_CHOICES = (None, True, False)


def enable_checkpointing(
    layers,
    mode,
    cuda_graphs: bool | str | None = None,
    launch_bound: bool = False,
    keep_sums: bool | None = None,
    host_limit_bytes: float | None = None,
) -> None:
    """Turn on checkpointing for transformers decoder layers (GradientCheckpointingLayer).

    Measured for the automatic choices, on an H200 (2 x 2048 tokens, same-run A/Bs): QLoRA
    (Llama-3-8B) 11,306 tokens/s with both graphs against 10,285 without, since every NF4
    weight adds dequantisation launches and the host could not keep up in either phase.
    Qwen3-8B 16-bit LoRA, whose per-head q/k RMSNorms add launches to every layer: 11,922
    against 8,373 (results/bench/h200-2026-12-03-qwen3-8b-lora-no-autocast-*-d442f7f.json).
    Llama/Mistral 16-bit LoRA: both graphs 11,858 against 12,021 without (its backward is
    bound by the GPU's kernels); the forward graphs alone remove the forward's host-bound
    idle time (29 -> 8 ms per step in the Mistral-7B profile) but gain only 0.4% (Llama) and
    1.3% (Mistral), for 64 MB more allocated and 1 GiB more reserved by the graphs' pool, so
    they are there to ask for, not the default (docs/performance.md).  T4/V100-class GPUs
    run a layer far slower than the host issues it, and their memory is tight.

    Args:
        layers: the decoder layers (each with transformers' ``gradient_checkpointing``
            hooks).
        mode: "offload" (this module; "unsloth" is read as "offload"), True (torch's
            non-reentrant checkpoint) or False (off).
        cuda_graphs: offload only. Replay the layers from CUDA graphs where possible
            (slothkit.engine.layer_graphs): True for both the checkpointed forward and
            the recompute with backward, "forward" for the forward only, False for
            neither. None (default): both for launch-bound layers (``launch_bound``) on
            GPUs of compute capability 8.0 and up; none for other layers, older GPUs and
            the CPU.
        launch_bound: whether the host, not the GPU, limits the layers' speed: 4-bit
            weights (dequantisation launches) or per-head q/k norms (for the cuda_graphs
            default).
        keep_sums: offload only. Let the layers keep the residual sum after attention
            for their re-runs, which then skip o_proj (one more B x T x hidden tensor per
            layer in pinned host memory, copied each way). None (default): on for GPUs
            of compute capability 8.0 and up; off for older ones (whose hosts, Colab's
            and Kaggle's, have little memory to pin) and the CPU.
        host_limit_bytes: offload only. The pinned host memory the offloaded inputs may
            hold at once; past it a layer keeps its input on the GPU (said once).  None:
            no limit.

    Raises:
        ValueError: ``mode``, ``cuda_graphs`` or ``keep_sums`` is not one of the
            accepted values.
    """
    if cuda_graphs not in CUDA_GRAPHS_CHOICES:
        raise ValueError(f"cuda_graphs={cuda_graphs!r}; accepted: None (automatic), True, False, 'forward'")
    if keep_sums not in KEEP_SUMS_CHOICES:
        raise ValueError(f"keep_sums={keep_sums!r}; accepted: None (automatic), True, False")
    fast_gpu = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0)
    if keep_sums is None:
        keep_sums = fast_gpu
    if cuda_graphs is None:
        cuda_graphs = fast_gpu and bool(launch_bound)
    if mode not in (True, False, "offload", "unsloth"):
        raise ValueError(f"use_gradient_checkpointing={mode!r}; accepted: 'offload', True, False")
    if mode is False:
        for layer in layers:
            layer.gradient_checkpointing = False
        return
    if mode in ("offload", "unsloth"):
        func = OffloadedCheckpointer(
            marks_recompute=True, cuda_graphs=cuda_graphs, keeps=keep_sums, host_limit_bytes=host_limit_bytes
        )
    else:
        from functools import partial

        from torch.utils.checkpoint import checkpoint

        func = partial(checkpoint, use_reentrant=False)
    for layer in layers:
        if not hasattr(layer, "_gradient_checkpointing_func") and not hasattr(
            type(layer), "gradient_checkpointing"
        ):
            raise TypeError(
                f"{type(layer).__name__} does not support transformers' gradient checkpointing hooks"
            )
        layer.gradient_checkpointing = True
        layer._gradient_checkpointing_func = func
