"""One implementation's training run, in its own process (``python -m slothkit.bench.train_worker``).

The parent (slothkit.bench.train) starts one worker per implementation so that
no implementation's patches, compiled kernels or cached memory can affect
another's figures.  The worker prints one JSON line prefixed with RESULT_TAG.

Every implementation trains the same thing: the model shape built with the same
random weights (seeded), LoRA r=16 / alpha 16 on all seven projections, gradient
checkpointing on (unless --hf-checkpointing off, or slothkit's "auto"), fused AdamW at
lr 1e-4, the same random tokens each step (an image-text shape's: the same rows, each with
one random default-resolution image, slothkit.bench.image_text_batch; LoRA on the language
model's layers, slothkit.bench.image_text_setup).  Memory is measured three ways: the peak
allocated and the peak reserved on the GPU (torch's caching allocator; reserved is what
runs out), and the peak resident host memory of the worker process.

Started by torchrun (``--gpus N``), each of the N processes trains its own copy on its
own GPU and tokens under DistributedDataParallel, and process 0 prints the one result
slothkit.bench.multi_gpu gathers.

The model each implementation trains is built and prepared in ``model_setup``; what a run
reports besides its times (slothkit's settings, host memory, the matmul peak) is measured
in ``train_measures``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

import torch

from slothkit.bench.image_text_batch import on_device, training_batch
from slothkit.bench.image_text_setup import load_with_unsloth_vision, prepare_image_text
from slothkit.bench.model_setup import (
    CHECKPOINTING,
    CUDA_GRAPHS,
    KEEP_SUMS,
    build_for,
    build_model,
    load_with_unsloth,
    prepare,
)
from slothkit.bench.multi_gpu import gather, parameters_checksum, start_process_group, wrap
from slothkit.bench.train_measures import (
    matmul_peak_tflops,
    peak_host_bytes,
    recomputed_share,
    reset_peak_host,
    slothkit_settings,
)
from slothkit.core.allocator import prefer_expandable_segments
from slothkit.core.distributed import launch
from slothkit.core.environment import allocator_settings
from slothkit.memory.memory_model import MemoryBudgetError
from slothkit.models import IMAGE_TEXT_SHAPES, SHAPES, record_for

RESULT_TAG = "SLOTHKIT_BENCH_RESULT "


def run(args) -> dict | None:
    if args.moe_gemm != "auto" and args.impl.startswith("slothkit"):
        from slothkit_kernels.moe.grouped_mm import set_backend

        set_backend(args.moe_gemm)
    if args.impl == "matmul-peak":
        return {"status": "ok", "tflops": matmul_peak_tflops()}
    if args.impl == "unsloth":
        import importlib.util

        if importlib.util.find_spec("unsloth") is None:
            raise ImportError("No module named 'unsloth'")
        os.environ.setdefault("UNSLOTH_DISABLE_STATISTICS", "1")
        shape = SHAPES.get(args.model) or getattr(IMAGE_TEXT_SHAPES.get(args.model), "text", None)
        record = record_for(shape)  # an image-text shape's: its language model's
        if record is not None and not record.unsloth_block_compile:
            os.environ.setdefault("UNSLOTH_BLOCK_COMPILE", "0")
        import unsloth  # noqa: F401  (Unsloth must be imported before transformers is used)
    if args.impl == "slothkit" and torch.cuda.is_available():
        prefer_expandable_segments()  # as FastModel.from_pretrained does before loading
    # Under torchrun (--gpus N): this process's GPU is the current one ("cuda" below).
    where = start_process_group()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    torch.manual_seed(args.seed)
    if device == "cuda" and args.memory_gib:
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.memory_gib * 2**30 / total))

    image_text = IMAGE_TEXT_SHAPES.get(args.model)
    if args.impl == "unsloth":  # Unsloth quantises while loading from disk itself
        built = build_model(args.model, dtype, device, args.seed)
        if image_text is not None:
            model, loaded = load_with_unsloth_vision(built, args.model, args, dtype)
        else:
            model, loaded = load_with_unsloth(built, args, dtype)
    else:
        model = build_for(args.impl, args, dtype, device)
        if device == "cuda":
            torch.cuda.synchronize()
            loaded = torch.cuda.memory_allocated()
        else:
            loaded = 0
    if image_text is not None and args.impl != "unsloth":
        model = prepare_image_text(
            args.impl, model, args.rank, args.seq, args.slothkit_checkpointing, args.hf_checkpointing
        )
    elif args.impl != "unsloth":
        model = prepare(
            args.impl,
            model,
            args.rank,
            args.slothkit_checkpointing,
            args.cuda_graphs,
            args.keep_sums,
            args.hf_checkpointing,
            args.memory_gib,
            args.batch,
            args.seq,
        )

    generator = torch.Generator().manual_seed(args.seed + 1 + where.rank)  # each process its own tokens
    if image_text is not None:  # one image a row (slothkit.bench.image_text_batch)
        batch = on_device(training_batch(image_text, args.batch, args.seq, generator), device, dtype)
    else:
        vocab = model.config.vocab_size
        input_ids = torch.randint(0, vocab, (args.batch, args.seq), generator=generator).to(device)
        batch = {"input_ids": input_ids, "labels": input_ids}
    trained = wrap(model, where)  # DDP under torchrun, else the model itself
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=device == "cuda")
    use_scaler = dtype == torch.float16
    scaler = torch.amp.GradScaler(device, enabled=use_scaler)

    losses, times = [], []
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    loading_peak_host = peak_host_bytes()
    host_peak_from_steps = reset_peak_host()
    for _step in range(args.warmup + args.steps):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.autocast(device, dtype=dtype, enabled=args.autocast and dtype != torch.float32):
            loss = trained(**batch).loss
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    timed = times[args.warmup :]
    step_s = statistics.median(timed)
    result = {
        "status": "ok",
        "step_s": step_s,
        "step_times_s": timed,  # each timed step, to tell a steady run from a disturbed one
        "tokens_per_s": args.batch * args.seq / step_s,
        "losses": losses,
        "final_loss": losses[-1],
        "loaded_gib": loaded / 2**30,
        # What each implementation adapts: Unsloth and PEFT may read the same target names
        # differently on a mixture-of-experts model (experts' 3-D weights or not).
        "trainable_parameters": sum(p.numel() for p in params),
    }
    if args.impl == "slothkit":
        result.update(slothkit_settings(model))
    # Unsloth's "unsloth" checkpointing re-runs every layer.
    result["recomputed"] = 1.0 if args.impl == "unsloth" else recomputed_share(model)
    if device == "cuda":
        result["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        result["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
        result["training_gib"] = result["peak_allocated_gib"] - result["loaded_gib"]
    result["allocator"] = allocator_settings()  # as the imports left it (Unsloth sets its own)
    try:
        import psutil

        result["host_rss_gib"] = psutil.Process().memory_info().rss / 2**30  # at the end
    except ImportError:
        pass
    peak_host = peak_host_bytes()
    if peak_host is not None:
        # Over the steps where the platform lets the figure be reset, else the process's life.
        result["peak_host_gib"] = peak_host / 2**30
        result["peak_host_scope"] = "steps" if host_peak_from_steps else "process"
    if loading_peak_host is not None:
        result["peak_host_before_steps_gib"] = loading_peak_host / 2**30
    if where.distributed:
        result["checksum"] = parameters_checksum(model)
        return gather(result, where, args.batch, args.seq)  # None outside process 0
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impl", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--mode", choices=["lora", "qlora"], default="lora")
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--memory-gib", type=float, default=None)
    parser.add_argument("--autocast", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--slothkit-checkpointing", choices=list(CHECKPOINTING), default="offload")
    parser.add_argument("--hf-checkpointing", choices=["on", "off"], default="on")
    parser.add_argument("--cuda-graphs", choices=list(CUDA_GRAPHS), default="auto")
    parser.add_argument("--keep-sums", choices=list(KEEP_SUMS), default="auto")
    parser.add_argument("--moe-gemm", choices=["auto", "triton", "grouped_mm"], default="auto")
    args = parser.parse_args(argv)
    try:
        result = run(args)
    except torch.cuda.OutOfMemoryError as error:
        result = {"status": "out of memory", "error": str(error).splitlines()[0]}
    except MemoryBudgetError as error:  # "auto" predicted that not even full offload fits
        result = {"status": "out of memory", "error": f"refused before training: {error}"}
    except ImportError as error:
        result = {"status": "skipped", "error": f"not importable: {error}"}
    except Exception as error:  # reported in the table; the other implementations still run
        result = {
            "status": "error",
            "error": f"{type(error).__name__}: {error}",
            "traceback": traceback.format_exc(),
        }
    if result is not None:  # under torchrun, process 0 prints the gathered result
        print(RESULT_TAG + json.dumps(result), flush=True)
    # Under torchrun a process that failed must exit with an error, so that torchrun stops
    # the others, which would wait for it in their next collective.
    failed = result is not None and result.get("status") != "ok"
    return 1 if failed and launch().distributed else 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
