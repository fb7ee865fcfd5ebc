"""The notebook's hardware cell: what GPU this is, and settings that fit it."""

from __future__ import annotations

import dataclasses

import torch


def hardware_report(config):
    """Print the GPU and the memory plan; return the config with settings that fit.

    On a GPU the planner may lower the batch size (raising gradient accumulation to
    keep the effective batch), the sequence length or the LoRA rank (settings_that_fit),
    and says so before anything is loaded; where nothing fits it stops with the reason.  Without a GPU, training runs on the CPU and nothing is changed.  On a
    machine with several GPUs it says once how to train on all of them
    (slothkit.notebook.multi_gpu); run that way, which process this is.

    Args:
        config: the notebook's NotebookConfig.

    Returns:
        The config, with the batch size, gradient accumulation, sequence length and LoRA
        rank the planner chose for this GPU.
    """
    from slothkit.core.distributed import launch, select_process_gpu
    from slothkit.notebook.multi_gpu import print_multi_gpu_notice_once

    select_process_gpu()  # under a launcher: before CUDA starts on GPU 0 in every process
    if not torch.cuda.is_available():
        print("GPU: none. Training runs on the CPU, slowly; fine for the tiny test models.")
        print_multi_gpu_notice_once(0, launch())
        return config
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    bf16 = torch.cuda.is_bf16_supported()
    print(
        f"GPU: {props.name}, {props.total_memory / 2**30:.1f} GiB, "
        f"bf16 {'yes' if bf16 else 'no (fp16 with loss scaling)'}"
    )
    print_multi_gpu_notice_once(torch.cuda.device_count(), launch())
    config, result = settings_that_fit(config, language_shape(config.model_name), gpu="auto")
    print(result.report())
    return config


def language_shape(model_name: str):
    """The Shape the planner reads for a checkpoint: its language model's.  An image-text
    checkpoint's config holds those sizes in its text config; its vision tower (16-bit
    weights) and image tokens are not in the plan."""
    from transformers import AutoConfig

    from slothkit.memory.plan import shape_from_config

    return shape_from_config(AutoConfig.from_pretrained(model_name).get_text_config())


# The lowest LoRA rank settings_that_fit lowers to: below it the adapters barely change the model.
LOWEST_RANK = 4


def settings_that_fit(config, shape, gpu: str = "auto"):
    """The config with settings that fit `gpu`, and the planner's MemoryPlan for them.

    The planner (slothkit.memory.plan) lowers the batch size and the sequence length first.
    Where even batch 1 at its shortest sequence does not fit, the LoRA rank is halved (down
    to LOWEST_RANK) with LORA_ALPHA in proportion, so that alpha / r, the adapters' scale,
    stays as set: a mixture-of-experts model adapts every expert, and its adapters and
    their Adam state can outweigh the rest (Qwen3-30B-A3B: 128 experts in 48 layers).

    Args:
        config: the notebook's NotebookConfig.
        shape: the model's slothkit.models.Shape (shape_from_config of its config).
        gpu: "auto" (this machine's GPU) or a GPU the planner names ("t4", "l4", "a100", ...).

    Raises:
        RuntimeError: nothing fits; the message says why (the planner's notes) and which
            GPUs the planner finds this configuration fits.
    """
    from slothkit.memory.plan import plan

    mode = "qlora" if config.load_in_4bit else "lora"

    def planned(rank: int, where: str):
        return plan(
            shape,
            gpu=where,
            seq=config.max_seq_length,
            batch=config.batch_size,
            mode=mode,
            rank=rank,
            target_batch=config.batch_size * config.grad_accum,
        )

    rank = config.lora_r
    result = planned(rank, gpu)
    while result.fits is False and rank // 2 >= LOWEST_RANK:
        rank //= 2
        result = planned(rank, gpu)
    if result.fits is False:
        elsewhere = [name for name in GPUS_NAMED if planned(rank, name).fits]
        raise RuntimeError(
            f"{config.model_name} does not fit this GPU ({mode}, even at batch 1, sequence length "
            f"{result.seq} and LoRA rank {rank}): predicted peak {result.total_gib:.1f} GiB reserved "
            f"of a {result.budget_gib:.1f} GiB budget; "
            + "; ".join(result.notes)
            + f". It fits: {', '.join(elsewhere) or 'none of ' + ', '.join(GPUS_NAMED)}"
        )
    if rank != config.lora_r:
        alpha = max(1, config.lora_alpha * rank // config.lora_r)
        result.notes.insert(
            0,
            f"LoRA rank lowered from {config.lora_r} to {rank} (LORA_ALPHA {config.lora_alpha} -> {alpha}, "
            f"the same scale) to fit: at rank {config.lora_r} the adapters and their Adam state take "
            f"{planned(config.lora_r, gpu).lora_gib:.1f} GiB",
        )
        config = dataclasses.replace(config, lora_r=rank, lora_alpha=alpha)
    return dataclasses.replace(
        config, batch_size=result.batch, grad_accum=result.grad_accum, max_seq_length=result.seq
    ), result


# The GPUs a refusal names as fitting, smallest first.
GPUS_NAMED = ("t4", "l4", "a100", "a100-80", "h100", "h200")
