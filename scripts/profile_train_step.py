"""Profile slothkit training steps at a real shape; print the top kernels, and with two
modes the per-kernel difference between them (where does QLoRA's extra time go?).

    python scripts/profile_train_step.py --model llama-3-8b --modes lora
    python scripts/profile_train_step.py --model mistral-7b --modes lora,qlora --layers 8

--layers keeps only the first N decoder layers (the cost per layer is what differs
between modes; fewer layers build and run faster). Times are GPU time per step in ms,
kernels and copies only (CPU time on a machine without a GPU, for a dry run of the
script). Wall time is measured over the same number of steps without the profiler; a
wall time above the kernel sum is time the GPU waited (on Python, on launches, on a
synchronisation), less whatever ran overlapped on the side stream (the offload copies).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import time

import torch
from torch.profiler import ProfilerActivity, profile

from slothkit.bench.train_worker import build_model, prepare


def build(model_name: str, mode: str, layers: int | None, device: str, dtype):
    from slothkit.bench import shapes

    if layers:  # a shallower copy of the shape, registered under a derived name
        base = shapes.shape_by_name(model_name)
        name = f"{model_name}-{layers}-layers"
        shapes.SHAPES[name] = dataclasses.replace(base, num_hidden_layers=layers)
        model_name = name
    model = build_model(model_name, dtype, device, 0, quantize_nf4=mode == "qlora")
    return prepare("slothkit", model, 16)


def step_fn(model, ids, device, dtype):
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4,
                                  fused=device == "cuda")

    def step():
        with torch.autocast(device, dtype=dtype):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def kernel_times(step, device: str, steps: int = 2) -> tuple[dict[str, float], float]:
    """Per-kernel time (ms per step) and wall time per step (ms)."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    # Wall time without the profiler, which adds CPU time to every operator.
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    wall = (time.perf_counter() - start) / steps * 1e3
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        sync()
    times = collections.Counter()
    for event in prof.key_averages():
        if device == "cuda":
            # Only the device-side events (kernels, memcpys): an operator such as
            # aten::addmm_ also reports the time of the kernels it launched as its own
            # device time, and summing both counted every kernel twice.
            if event.device_type != torch.autograd.DeviceType.CUDA:
                continue
            own = event.self_device_time_total
        else:
            own = event.self_cpu_time_total
        if own:
            times[event.key] += own / 1e3 / steps
    return dict(times), wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--modes", default="lora", help="lora, qlora or lora,qlora")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32

    results = {}
    for mode in args.modes.split(","):
        model = build(args.model, mode, args.layers, device, dtype)
        ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), device=device)
        step = step_fn(model, ids, device, dtype)
        for _ in range(2):  # warm-up: compilation, allocator
            step()
        results[mode] = kernel_times(step, device)
        times, wall = results[mode]
        print(f"\n== {args.model} {mode}, {args.layers or 'all'} layers, {args.batch}x{args.seq}: "
              f"wall {wall:.1f} ms/step, kernels {sum(times.values()):.1f} ms/step")
        for name, ms in sorted(times.items(), key=lambda kv: -kv[1])[: args.top]:
            print(f"{ms:9.2f} ms  {name[:100]}")
        del model, step
        if device == "cuda":
            torch.cuda.empty_cache()

    if len(results) == 2:
        (a, (ta, wa)), (b, (tb, wb)) = results.items()
        print(f"\n== {b} minus {a}: wall {wb - wa:+.1f} ms/step, kernels "
              f"{sum(tb.values()) - sum(ta.values()):+.1f} ms/step; largest differences:")
        names = set(ta) | set(tb)
        deltas = sorted(((tb.get(n, 0.0) - ta.get(n, 0.0), n) for n in names), key=lambda d: -abs(d[0]))
        for delta, name in deltas[: args.top]:
            print(f"{delta:+9.2f} ms  ({ta.get(name, 0.0):8.2f} -> {tb.get(name, 0.0):8.2f})  {name[:90]}")


if __name__ == "__main__":
    main()
