"""Where a decode step's time goes, on a GPU: the captured one-token step of
``FastModel.for_inference`` timed as graph replays, and its kernels profiled.

A batch-1 step reads every weight once, so its floor is (bytes of weights) / (memory
bandwidth); what the step takes beyond that is launches and small kernels.  This prints
the time per token of the replayed graph, the floor, and the step's kernels grouped by
what they do (matmuls of the base weights, the adapters' small matmuls, attention,
norms and element-wise work), with their count and summed GPU time, from torch's
profiler over replays of the same graph.

    python scripts/profile_decode.py --model llama-3-8b --mode lora --batch 1 --json out.json
    python scripts/profile_decode.py --model llama-3-8b --mode lora --merged

The JSON record names the GPU, the package versions, the date and the command.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time

import torch

# Kernel name fragments -> category, first match wins (names as cuBLAS, bitsandbytes,
# PyTorch and Triton give them).
CATEGORIES = (
    ("attention", ("fmha", "flash", "attention", "sdpa")),
    ("4-bit matmul", ("gemv_4bit", "kgemm_4bit", "dequantize", "kdequant")),
    ("norm / rope / activation (Triton)", ("rms_norm", "rope", "swiglu", "geglu")),
    ("matmul", ("gemm", "gemv", "cutlass", "sm90", "xmma", "splitk", "cublas", "nvjet")),
    ("cache write", ("index_copy", "scatter", "index_put")),
    ("reduction / softmax", ("reduce", "softmax", "argmax", "max")),
    ("element-wise", ("elementwise", "vectorized", "unrolled", "copy", "fill", "cat", "where")),
)


def category(name: str) -> str:
    lowered = name.lower()
    for label, fragments in CATEGORIES:
        if any(fragment in lowered for fragment in fragments):
            return label
    return "other"


def weight_bytes(model) -> int:
    """Bytes one token's step reads from the weights: every parameter and buffer of the
    decoder and head except the input embeddings (one row is gathered)."""
    embeddings = model.get_input_embeddings()
    skip = {id(p) for p in embeddings.parameters()}
    output = model.get_output_embeddings()
    tied = output is not None and output.weight.data_ptr() == embeddings.weight.data_ptr()
    total = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in skip)
    if tied:
        total += output.weight.numel() * output.weight.element_size()
    for module in model.modules():  # NF4 scales live in quant_state, not in parameters
        state = getattr(getattr(module, "weight", None), "quant_state", None)
        if state is not None and getattr(state, "absmax", None) is not None:
            total += state.absmax.numel() * state.absmax.element_size()
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--mode", choices=["lora", "qlora"], default="lora")
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--replays", type=int, default=100)
    parser.add_argument(
        "--bandwidth-tbs",
        type=float,
        default=None,
        help="the floor's bandwidth (default: a copy's, measured here)",
    )
    parser.add_argument("--prefill", type=int, default=0, help="also profile a prompt of this many tokens")
    parser.add_argument("--merged", action="store_true", help="the adapters merged into the weights first")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from slothkit.bench.generate_worker import prepare
    from slothkit.bench.train import environment
    from slothkit.core.model_state import state_of

    args.rank, args.seed, args.prompt_len, args.new_tokens = 16, 0, 128, 128
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    model = prepare("slothkit-merged" if args.merged else "slothkit", args, dtype, "cuda")
    causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    prompt = torch.randint(3, causal_lm.config.vocab_size, (args.batch, args.prompt_len), device="cuda")
    # Warm-up as the bench's: the call it times, once (the cache and graph for its length).
    _generate(model, prompt, args.new_tokens)
    captured = state_of(causal_lm).fast_decoder.captured
    assert captured.graph is not None, "the decode step was not captured"
    token = prompt[:, -1]
    position = torch.full((args.batch,), args.prompt_len + 8, device="cuda")

    def replay(n: int) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(n):
            captured(token, position, args.prompt_len + 8)
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / n

    if args.bandwidth_tbs is None:
        from slothkit.bench.decode_limit import copy_gb_per_s

        args.bandwidth_tbs = round(copy_gb_per_s() / 1e3, 3)
    replay(10)
    step_ms = min(replay(args.replays) for _ in range(3)) * 1e3
    floor_ms = weight_bytes(causal_lm) / (args.bandwidth_tbs * 1e12) * 1e3

    from torch.profiler import ProfilerActivity, profile

    profiled = 20
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        replay(profiled)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    source = "graph replays"
    if not kernels:  # a profiler that does not see inside graphs: the same step, eagerly
        source = "the same step run eagerly"
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(profiled):
                captured._run()
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    groups = collections.defaultdict(lambda: [0, 0.0])
    for event in kernels:
        label = category(event.name)
        groups[label][0] += 1
        groups[label][1] += event.device_time / 1e3  # us -> ms
    kernel_ms = sum(ms for _, ms in groups.values()) / profiled
    result = {
        **environment(),
        "command": "python scripts/profile_decode.py " + " ".join(sys.argv[1:]),
        "model": args.model,
        "mode": args.mode,
        "merged": args.merged,
        "dtype": args.dtype,
        "batch": args.batch,
        "step_ms": step_ms,
        "tokens_per_s_graph_only": args.batch * 1e3 / step_ms,
        "weight_gb": weight_bytes(causal_lm) / 1e9,
        "bandwidth_floor_ms": floor_ms,
        "floor_bandwidth_tbs": args.bandwidth_tbs,
        "profiled": source,
        "kernels_per_step": len(kernels) / profiled,
        "kernel_ms_per_step": kernel_ms,
        "by_category": {
            label: {"kernels": count / profiled, "ms": ms / profiled}
            for label, (count, ms) in sorted(groups.items(), key=lambda item: -item[1][1])
        },
    }
    print(f"{args.model} {args.mode}{' merged' if args.merged else ''} {args.dtype} batch {args.batch}")
    print(
        f"graph replay {step_ms:.2f} ms/step ({result['tokens_per_s_graph_only']:.1f} tokens/s without sampling)"
    )
    print(f"weights {result['weight_gb']:.2f} GB: floor {floor_ms:.2f} ms at {args.bandwidth_tbs} TB/s")
    print(f"{result['kernels_per_step']:.0f} kernels per step, {kernel_ms:.2f} ms of GPU time ({source})")
    print("| what | kernels/step | ms/step |")
    print("|---|---|---|")
    for label, entry in result["by_category"].items():
        print(f"| {label} | {entry['kernels']:.0f} | {entry['ms']:.3f} |")
    top = collections.Counter()
    for event in kernels:
        top[event.name[:90]] += event.device_time / 1e3 / profiled
    print("top kernels (ms/step):")
    for name, ms in top.most_common(12):
        print(f"  {ms:7.3f}  {name}")
    result["top_kernels"] = dict(top.most_common(20))
    result["generate"] = generate_breakdown(model, prompt, args.new_tokens, result, profile)
    if args.prefill:
        result["prefill"] = profile_prefill(model, causal_lm, args.prefill, profile)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=1)


def _generate(model, prompt: torch.Tensor, new_tokens: int) -> float:
    """Seconds of one greedy generate call of ``new_tokens`` tokens, as the bench times it."""
    from slothkit.bench.generate_worker import timed_generate

    return timed_generate(model, prompt, torch.ones_like(prompt), new_tokens)[1]


def generate_breakdown(model, prompt: torch.Tensor, new_tokens: int, step: dict, profile) -> dict:
    """Where a whole generate call's time goes beyond its steps' replays: the call as the
    bench times it, the same call for one token (the prompt's prefill, the first token and
    the call's own work), and what each further token costs beyond one replay; with the
    kernels both calls launch, so that the per-token kernels outside the graph (sampling,
    the logits processors, the token's bookkeeping) are counted."""
    from torch.profiler import ProfilerActivity

    whole = min(_generate(model, prompt, new_tokens) for _ in range(3))
    first = min(_generate(model, prompt, 1) for _ in range(3))
    per_token_ms = (whole - first) / (new_tokens - 1) * 1e3
    kernels = {}
    for label, tokens in (("whole", new_tokens), ("first", 1)):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            _generate(model, prompt, tokens)
        events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        kernels[label] = (len(events), sum(e.device_time for e in events) / 1e3)
    per_token_kernels = (kernels["whole"][0] - kernels["first"][0]) / (new_tokens - 1)
    per_token_kernel_ms = (kernels["whole"][1] - kernels["first"][1]) / (new_tokens - 1)
    out = {
        "new_tokens": new_tokens,
        "generate_s": whole,
        "tokens_per_s": prompt.shape[0] * new_tokens / whole,
        "first_token_s": first,
        "per_token_ms": per_token_ms,
        "per_token_beyond_replay_ms": per_token_ms - step["step_ms"],
        "per_token_kernels": per_token_kernels,
        "per_token_kernels_outside_step": per_token_kernels - step["kernels_per_step"],
        "per_token_kernel_ms_outside_step": per_token_kernel_ms - step["kernel_ms_per_step"],
    }
    print(
        f"generate {new_tokens} tokens: {whole * 1e3:.1f} ms ({out['tokens_per_s']:.1f} tokens/s); "
        f"prefill + first token {first * 1e3:.1f} ms; each further token {per_token_ms:.3f} ms, "
        f"{out['per_token_beyond_replay_ms']:.3f} beyond a replay, with "
        f"{out['per_token_kernels_outside_step']:.0f} kernels outside the step "
        f"({out['per_token_kernel_ms_outside_step']:.3f} ms of GPU time)"
    )
    return out


def profile_prefill(model, causal_lm, length: int, profile) -> dict:
    """Time to first token of a ``length``-token prompt through the fast path and through
    the same model's own forward (Hugging Face's generate over slothkit's patched
    layers), with each one's kernels grouped as above."""
    from torch.profiler import ProfilerActivity

    from slothkit import FastModel

    ids = torch.randint(3, causal_lm.config.vocab_size, (1, length), device="cuda")
    settings = dict(max_new_tokens=1, do_sample=False, pad_token_id=0)
    out = {}
    for label, fast in (("fast path", True), ("model forward", False)):
        FastModel.for_inference(model, fast_decode=fast)
        model.generate(input_ids=ids, **settings)
        torch.cuda.synchronize()
        times = []
        for _ in range(3):
            start = time.perf_counter()
            model.generate(input_ids=ids, **settings)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            model.generate(input_ids=ids, **settings)
            torch.cuda.synchronize()
        groups = collections.defaultdict(lambda: [0, 0.0])
        for event in prof.events():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                groups[category(event.name)][0] += 1
                groups[category(event.name)][1] += event.device_time / 1e3
        out[label] = {
            "ttft_s": min(times),
            "by_category": {
                k: {"kernels": c, "ms": ms} for k, (c, ms) in sorted(groups.items(), key=lambda i: -i[1][1])
            },
        }
        print(f"prefill {length} tokens, {label}: TTFT {min(times) * 1e3:.1f} ms")
        for k, (c, ms) in sorted(groups.items(), key=lambda i: -i[1][1]):
            print(f"  {k}: {c} kernels, {ms:.2f} ms")
    FastModel.for_inference(model, fast_decode=True)
    return out


if __name__ == "__main__":
    main()
