"""The notebook's hardware cell: what GPU this is, and settings that fit it."""

from __future__ import annotations

import dataclasses

import torch


def hardware_report(config):
    """Print the GPU and the memory plan; return the config with settings that fit.

    On a GPU the planner may lower the batch size (raising gradient accumulation to
    keep the effective batch) or the sequence length, and says so before anything
    is loaded.  Without a GPU, training runs on the CPU and nothing is changed.  On a
    machine with several GPUs it says once how to train on all of them
    (slothkit.notebook.multi_gpu); run that way, which process this is.

    Args:
        config: the notebook's NotebookConfig.

    Returns:
        The config, with the batch size, gradient accumulation and sequence length the
        planner chose for this GPU.
    """
    from transformers import AutoConfig

    from slothkit.core.distributed import launch, select_process_gpu
    from slothkit.memory.plan import plan, shape_from_config
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
    shape = shape_from_config(AutoConfig.from_pretrained(config.model_name))
    result = plan(
        shape,
        gpu="auto",
        seq=config.max_seq_length,
        batch=config.batch_size,
        mode="qlora" if config.load_in_4bit else "lora",
        rank=config.lora_r,
        target_batch=config.batch_size * config.grad_accum,
    )
    print(result.report())
    if result.fits is False:
        raise RuntimeError(
            "this configuration does not fit this GPU even at batch 1; " + "; ".join(result.notes)
        )
    return dataclasses.replace(
        config, batch_size=result.batch, grad_accum=result.grad_accum, max_seq_length=result.seq
    )
