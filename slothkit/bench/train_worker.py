"""One implementation's training run, in its own process (``python -m slothkit.bench.train_worker``).

The parent (slothkit.bench.train) starts one worker per implementation so that
no implementation's patches, compiled kernels or cached memory can affect
another's figures.  The worker prints one JSON line prefixed with RESULT_TAG.

Every implementation trains the same thing: the model shape built with the same
random weights (seeded), LoRA r=16 / alpha 16 on all seven projections, gradient
checkpointing on (unless --hf-checkpointing off, or slothkit's "auto"), fused AdamW at
lr 1e-4, the same random tokens each step.  Memory is measured three ways: the peak
allocated and the peak reserved on the GPU (torch's caching allocator; reserved is what
runs out), and the peak resident host memory of the worker process.

Started by torchrun (``--gpus N``), each of the N processes trains its own copy on its
own GPU and tokens under DistributedDataParallel, and process 0 prints the one result
slothkit.bench.multi_gpu gathers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

from slothkit.bench.multi_gpu import gather, parameters_checksum, start_process_group, wrap
from slothkit.distributed import launch
from slothkit.environment import allocator_settings
from slothkit.memory_model import MemoryBudgetError
from slothkit.model_state import state_of

RESULT_TAG = "SLOTHKIT_BENCH_RESULT "
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# The words of --cuda-graphs and --keep-sums -> FastModel.get_peft_model's keyword values.
CUDA_GRAPHS = {"auto": None, "on": True, "off": False, "forward": "forward"}
KEEP_SUMS = {"auto": None, "on": True, "off": False}
# The words of --slothkit-checkpointing -> use_gradient_checkpointing.
CHECKPOINTING = {"offload": "offload", "on": True, "auto": "auto"}


def build_model(shape_name: str, dtype: torch.dtype, device: str, seed: int, quantize_nf4: bool = False):
    """The named shape with random weights, built directly on the device.

    quantize_nf4: replace the seven projections by bitsandbytes NF4 layers as they are
    built, one at a time, so that the 16-bit model never exists whole: a QLoRA run under
    a memory cap smaller than the 16-bit weights (the --t4 stand-in) can still start.
    The weights are the same either way (one generator, parameters in the same order).
    """
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    from slothkit.models import architecture_for, shape_by_name

    config = shape_by_name(shape_name).config()
    neutral_norm = 0.0 if architecture_for(config).norm_adds_one else 1.0

    # Parameters on the meta device (no memory, no init time), made real one module at a
    # time below; buffers (rotary inv_freq, Gemma's embed_scale) real from the start.
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        # Tied weights (Gemma's embeddings and head) are one meta parameter in two modules:
        # remember the real tensor made for those only, so that a quantised projection's
        # 16-bit weight is freed as soon as it is replaced.
        seen, tied = set(), set()
        for _, meta in model.named_parameters(remove_duplicate=False):
            (tied if id(meta) in seen else seen).add(id(meta))
        built = {}  # id of a tied meta parameter -> its real one
        for module_name, module in list(model.named_modules()):
            for param_name, meta in list(module.named_parameters(recurse=False)):
                if id(meta) not in built:
                    param = torch.nn.Parameter(
                        torch.empty_like(meta, device=device), requires_grad=meta.requires_grad
                    )
                    name = f"{module_name}.{param_name}" if module_name else param_name
                    if name.endswith("norm.weight") or "layernorm" in name:
                        # Neutral norm: 1, or 0 where the norm scales by (1 + w).
                        param.fill_(neutral_norm)
                    else:
                        param.normal_(0.0, 0.02, generator=generator)
                    if id(meta) in tied:
                        built[id(meta)] = param
                else:
                    param = built[id(meta)]
                module._parameters[param_name] = param
            if quantize_nf4 and _is_projection(module_name, module):
                _replace_with_nf4(model, module_name, module, dtype)
    model.to(device)  # moves the buffers; the parameters are there already
    model.tie_weights()
    return model


def _is_projection(name: str, module) -> bool:
    return name.rsplit(".", 1)[-1] in LORA_TARGETS and isinstance(module, torch.nn.Linear)


def _replace_with_nf4(model, name: str, module, compute_dtype: torch.dtype) -> None:
    """Swap one projection for a bitsandbytes NF4 (double-quantised) layer."""
    import bitsandbytes as bnb

    quantized = bnb.nn.Linear4bit(
        module.in_features,
        module.out_features,
        bias=module.bias is not None,
        compute_dtype=compute_dtype,
        compress_statistics=True,
        quant_type="nf4",
        quant_storage=torch.uint8,
        device="meta",
    )
    quantized.weight = bnb.nn.Params4bit(
        module.weight.data,
        requires_grad=False,
        compress_statistics=True,
        quant_type="nf4",
        quant_storage=torch.uint8,
    ).to(module.weight.device)
    parent_name, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent_name), leaf, quantized)
    module._parameters.clear()  # callers hold the old module (a named_modules() list): free its weight


def quantize_to_nf4(model, compute_dtype: torch.dtype):
    """Replace the decoder's projections with bitsandbytes NF4 (double-quantised) layers."""
    for name, module in list(model.named_modules()):
        if _is_projection(name, module):
            _replace_with_nf4(model, name, module, compute_dtype)
    return model


def prepare(
    impl: str,
    model,
    rank: int,
    checkpointing: str = "offload",
    cuda_graphs: str = "auto",
    keep_sums: str = "auto",
    hf_checkpointing: str = "on",
    memory_gib: float | None = None,
    batch: int | None = None,
    seq: int | None = None,
):
    """Add LoRA and checkpointing the way each implementation's users do.

    Args:
        impl: "slothkit", "hf" or "liger".
        model: the model from ``build_model``.
        rank: the LoRA rank (alpha is the same).
        checkpointing: slothkit's use_gradient_checkpointing: "offload" (default, what
            its users get), "on" (plain checkpointing, the layer inputs kept on the GPU)
            or "auto" (the layers that fit ``memory_gib`` not checkpointed).
        cuda_graphs: slothkit's cuda_graphs, as a word of ``CUDA_GRAPHS`` (default
            "auto": FastModel.get_peft_model chooses).
        keep_sums: slothkit's keep_sums, as a word of ``KEEP_SUMS`` (default "auto").
        hf_checkpointing: HF + PEFT's and Liger's gradient checkpointing, "on" (default,
            non-reentrant, as their notebooks set it) or "off".
        memory_gib: with checkpointing "auto", the budget (max_memory); None: the GPU's
            free memory.
        batch: with checkpointing "auto", the batch size it decides for.
        seq: with checkpointing "auto", the sequence length it decides for.
    """
    from peft import LoraConfig, get_peft_model

    if impl == "liger":
        from liger_kernel.transformers import _apply_liger_kernel_to_instance

        _apply_liger_kernel_to_instance(model=model)
    if impl in ("hf", "liger"):
        model = get_peft_model(
            model,
            LoraConfig(
                r=rank, lora_alpha=rank, lora_dropout=0.0, target_modules=LORA_TARGETS, task_type="CAUSAL_LM"
            ),
        )
        if hf_checkpointing == "on":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.enable_input_require_grads()
        model.config.use_cache = False
        model.train()  # from_config/from_pretrained return eval mode, which skips checkpointing
        return model
    if impl == "slothkit":
        from slothkit import FastModel
        from slothkit.engine.decoder import patch_decoder
        from slothkit.models import architecture_for

        patch_decoder(model, architecture_for(model.config))
        mode = CHECKPOINTING[checkpointing]
        auto = {}
        if mode == "auto":
            auto = {"max_memory": memory_gib, "batch_size": batch, "max_seq_length": seq}
        return FastModel.get_peft_model(
            model,
            r=rank,
            lora_alpha=rank,
            use_gradient_checkpointing=mode,
            cuda_graphs=CUDA_GRAPHS[cuda_graphs],
            keep_sums=KEEP_SUMS[keep_sums],
            **auto,
        )
    raise ValueError(f"unknown implementation {impl!r}")


def layer_graphs_of(model):
    """slothkit's LayerGraphs of a model whose checkpointing has them, else None."""
    for module in model.modules():
        graphs = getattr(getattr(module, "_gradient_checkpointing_func", None), "graphs", None)
        if graphs is not None:
            return graphs
    return None


def recomputed_share(model) -> float:
    """The share of decoder layers that re-run their forward in backward (checkpointed or
    offloaded), from the layers' own flags after the steps: what the FLOP count needs."""
    from slothkit.engine.decoder import decoder_layers

    causal_lm, layers = decoder_layers(model)
    flags = [getattr(layer, "gradient_checkpointing", None) for layer in layers]
    if all(flag is None for flag in flags):  # checkpointing kept on the decoder, not per layer
        return float(bool(getattr(causal_lm, "is_gradient_checkpointing", True)))
    return sum(bool(flag) for flag in flags) / len(flags)


def slothkit_settings(model) -> dict:
    """What slothkit's run used: how many layer graphs it replayed (0: none, or graphs
    off), whether the layers kept their sums, and use_gradient_checkpointing="auto"'s
    choice for the step (layers kept, budget, predicted peak reserved)."""
    graphs = layer_graphs_of(model)
    settings = {"cuda_graphs": len(graphs.graphs) if graphs is not None and graphs.enabled else 0}
    for module in model.modules():
        checkpointer = getattr(module, "_gradient_checkpointing_func", None)
        if hasattr(checkpointer, "keeps"):
            settings["keep_sums"] = checkpointer.keeps
            break
    for module in model.modules():
        state = state_of(module)  # the model may be wrapped (DDP): its causal LM carries it
        policy = state.recompute_policy if state is not None else None
        if policy is not None and policy.choice is not None:
            choice = policy.choice
            settings["recompute"] = {
                "kept_layers": choice.kept,
                "layers": choice.layers,
                "tokens": choice.tokens,
                "budget_gib": choice.budget_bytes / 2**30,
                "predicted_peak_gib": choice.peak_bytes / 2**30,
                # Checkpointed on the GPU for want of host memory, and the pinned inputs.
                "on_gpu_layers": choice.on_gpu,
                "predicted_host_gib": choice.host_bytes / 2**30,
                "host_budget_gib": None
                if choice.host_budget_bytes is None
                else choice.host_budget_bytes / 2**30,
            }
    return settings


def peak_host_bytes() -> int | None:
    """The process's peak resident memory, pinned host buffers included: Linux's VmHWM
    (since the last ``reset_peak_host``), else the lifetime peak from getrusage; None
    where the platform says neither."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError):
        pass
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def reset_peak_host() -> bool:
    """Start the peak resident figure again from the current one (Linux: writing 5 to
    /proc/self/clear_refs), so that the training steps' peak is not the loading's: a
    peer that loads a 16-bit checkpoint from disk holds it in host memory for a while
    (Unsloth: 16.5 GiB for Llama-3-8B, 3.0 while training).  False where it cannot."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def matmul_peak_tflops() -> float:
    """bf16 matmul rate on random data, the MFU denominator (measured, not the datasheet)."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(20):
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * 8192**3 / statistics.median(times) / 1e12


def load_with_unsloth(model, args, dtype):
    """Unsloth loads from a checkpoint on disk: save the random model, then load it
    the way Unsloth's notebooks do (its own 4-bit loading, its offloaded checkpointing)."""
    import shutil
    import tempfile

    from unsloth import FastLanguageModel

    from slothkit.testing import build_tiny_tokenizer

    # The checkpoint (16 GB for an 8B model) is deleted once loaded: a few runs on one
    # machine would otherwise fill its disk.
    folder = tempfile.mkdtemp(prefix="slothkit-bench-unsloth-")
    try:
        model.save_pretrained(folder, safe_serialization=True)
        build_tiny_tokenizer("bpe", folder)  # Unsloth wants a tokenizer beside the weights
        del model
        torch.cuda.empty_cache()
        unsloth_model, _ = FastLanguageModel.from_pretrained(
            folder,
            max_seq_length=args.seq,
            dtype=dtype,
            load_in_4bit=args.mode == "qlora",
        )
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    torch.cuda.synchronize()
    loaded = torch.cuda.memory_allocated()
    unsloth_model = FastLanguageModel.get_peft_model(
        unsloth_model,
        r=args.rank,
        lora_alpha=args.rank,
        lora_dropout=0.0,
        bias="none",
        target_modules=LORA_TARGETS,
        use_gradient_checkpointing="unsloth",
        random_state=args.seed,
    )
    # from_pretrained leaves eval mode, in which checkpointing is skipped: train as users do.
    unsloth_model.train()
    return unsloth_model, loaded


def run(args) -> dict | None:
    if args.impl == "matmul-peak":
        return {"status": "ok", "tflops": matmul_peak_tflops()}
    if args.impl == "unsloth":
        import importlib.util

        if importlib.util.find_spec("unsloth") is None:
            raise ImportError("No module named 'unsloth'")
        os.environ.setdefault("UNSLOTH_DISABLE_STATISTICS", "1")
        if args.model.startswith("gemma"):
            # Unsloth's per-block torch.compile crashes in inductor on Gemma (shared/GPU.md).
            os.environ.setdefault("UNSLOTH_BLOCK_COMPILE", "0")
        import unsloth  # noqa: F401  (Unsloth must be imported before transformers is used)
    # Under torchrun (--gpus N): this process's GPU is the current one ("cuda" below).
    where = start_process_group()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    torch.manual_seed(args.seed)
    if device == "cuda" and args.memory_gib:
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.memory_gib * 2**30 / total))

    if args.impl == "unsloth":  # Unsloth quantises while loading from disk itself
        model, loaded = load_with_unsloth(build_model(args.model, dtype, device, args.seed), args, dtype)
    else:
        model = build_model(args.model, dtype, device, args.seed, quantize_nf4=args.mode == "qlora")
        if device == "cuda":
            torch.cuda.synchronize()
            loaded = torch.cuda.memory_allocated()
        else:
            loaded = 0
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
    vocab = model.config.vocab_size
    input_ids = torch.randint(0, vocab, (args.batch, args.seq), generator=generator).to(device)
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
            loss = trained(input_ids=input_ids, labels=input_ids).loss
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
