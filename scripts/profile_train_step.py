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
On a GPU it then says where that waiting happens: the host time to issue each phase
(no profiler), the calls that make the host wait for the GPU (sync debug mode), the
host-side operator table, and the idle gaps on the compute stream, each charged to the
kernel that ends it and the phase that launched it (``idle_gaps``).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from slothkit.bench.model_setup import build_model, prepare


def build(model_name: str, mode: str, layers: int | None, device: str, dtype):
    from slothkit import models

    if layers:  # a shallower copy of the shape, registered under a derived name
        base = models.shape_by_name(model_name)
        name = f"{model_name}-{layers}-layers"
        models.SHAPES[name] = dataclasses.replace(base, num_hidden_layers=layers)
        model_name = name
    model = build_model(model_name, dtype, device, 0, quantize_nf4=mode == "qlora")
    return prepare("slothkit", model, 16)


def step_fn(model, ids, device, dtype, autocast=True):
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=device == "cuda"
    )

    def step(host_times=None):
        # The phases are marked for idle_gaps, which charges each gap to one of them;
        # host_times, when given, collects how long the host spent issuing each phase.
        start = time.perf_counter()
        with (
            record_function("phase: forward and loss"),
            torch.autocast(device, dtype=dtype, enabled=autocast),
        ):
            loss = model(input_ids=ids, labels=ids).loss
        forward = time.perf_counter()
        with record_function("phase: backward (with the recomputed forward)"):
            loss.backward()
        backward = time.perf_counter()
        with record_function("phase: optimizer"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if host_times is not None:
            host_times["forward"] += forward - start
            host_times["backward"] += backward - forward
            host_times["optimizer"] += time.perf_counter() - backward

    return step


def idle_gaps(prof, steps: int, top: int = 12) -> list[str]:
    """Where the compute stream sits idle, from the profiler's device and runtime events.

    The compute stream is the stream with the most busy time.  Each gap between two of
    its kernels longer than 5 us is charged to the kernel that ends it, and classified
    by when that kernel was launched: after the gap began ("host late": the GPU waited
    for Python and the launch) or before it ("queued": the kernel waited on something
    else, e.g. an event from the copy stream)."""
    events = list(prof.profiler.kineto_results.events())
    # Device events, less the phase markers' copies on the GPU timeline.
    device = [
        e
        for e in events
        if e.device_type() == torch.autograd.DeviceType.CUDA and not e.name().startswith("phase: ")
    ]
    if not device:
        return ["(no device events: run on a GPU)"]
    cpu = [e for e in events if e.device_type() == torch.autograd.DeviceType.CPU]
    # The runtime call behind each kernel, memset and memcpy (cudaLaunchKernel,
    # cudaMemsetAsync, ...), matched by correlation id: when the host issued it.
    launches = {
        e.correlation_id(): e.start_ns() for e in cpu if e.correlation_id() and e.name().startswith("cu")
    }
    phases = sorted(
        (e.start_ns(), e.start_ns() + e.duration_ns(), e.name()[len("phase: ") :])
        for e in cpu
        if e.name().startswith("phase: ")
    )

    def phase_of(launched):
        for start, stop, name in phases:
            if launched is not None and start <= launched <= stop:
                return name
        return "outside the phases"

    busy = collections.Counter()
    for e in device:
        busy[e.device_resource_id()] += e.duration_ns()
    compute = busy.most_common(1)[0][0]
    kernels = sorted((e for e in device if e.device_resource_id() == compute), key=lambda e: e.start_ns())
    by_kernel, kinds, sizes, by_phase = (collections.Counter() for _ in range(4))
    end = kernels[0].start_ns() + kernels[0].duration_ns()
    for e in kernels[1:]:
        gap = e.start_ns() - end
        if gap > 5_000:
            launched = launches.get(e.correlation_id())
            kind = "launch unknown" if launched is None else "host late" if launched > end else "queued"
            by_kernel[(kind, e.name()[:80])] += gap
            kinds[kind] += gap
            by_phase[phase_of(launched)] += gap
            sizes["5-50 us" if gap < 50_000 else "50-500 us" if gap < 500_000 else ">= 0.5 ms"] += gap
        end = max(end, e.start_ns() + e.duration_ns())
    # Runtime calls that block the host until the GPU catches up (or allocate pinned
    # memory, which does too): any one of them empties the launch queue.
    blocking = collections.Counter()
    for e in cpu:
        if "ynchronize" in e.name() or e.name() in (
            "cudaMemcpy",
            "cudaHostAlloc",
            "cudaFreeHost",
            "cudaFree",
            "cudaMalloc",
        ):
            blocking[(phase_of(e.start_ns()), e.name())] += 1
    per_step = lambda ns: ns / 1e6 / steps  # noqa: E731
    lines = [
        f"idle on the compute stream (stream {compute}): {per_step(sum(kinds.values())):.1f} ms/step; "
        + ", ".join(f"{k} {per_step(v):.1f} ms" for k, v in kinds.most_common())
        + "; by gap size: "
        + ", ".join(f"{k} {per_step(v):.1f} ms" for k, v in sizes.most_common()),
        "  by phase (of the launch that ends the gap): "
        + ", ".join(f"{k} {per_step(v):.1f} ms" for k, v in by_phase.most_common()),
    ]
    lines.append(
        "  blocking runtime calls per step: "
        + (
            ", ".join(
                f"{name} x{count / steps:g} ({phase})" for (phase, name), count in blocking.most_common()
            )
            or "none"
        )
    )
    for (kind, name), ns in by_kernel.most_common(top):
        lines.append(f"{per_step(ns):9.2f} ms  before {name}  ({kind})")
    return lines


def synchronizing_calls(step) -> list[str]:
    """Run one step with torch's sync debug mode on and return where each operation that
    makes the host wait for the GPU was called from (the innermost frames outside torch):
    each such wait empties the launch queue, and the GPU then idles while the host
    catches up."""
    import traceback
    import warnings

    sites = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        torch_dir = str(Path(torch.__file__).parent)
        frames = [
            f
            for f in traceback.extract_stack()[:-1]
            if not f.filename.startswith(torch_dir) and "warnings" not in f.filename
        ]
        sites[" <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames[-3:][::-1])] += 1

    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        sites.clear()
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    return [f"synchronizing call x{n} per step: {site}" for site, n in sites.most_common()] or [
        "synchronizing calls per step: none"
    ]


def kernel_times(step, device: str, steps: int = 2) -> tuple[dict[str, float], float, list[str]]:
    """Per-kernel time (ms per step), wall time per step (ms) and the idle-gap report."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    # Wall time without the profiler, which adds CPU time to every operator.
    sync()
    host = collections.Counter()
    start = time.perf_counter()
    for _ in range(steps):
        step(host)
    issued = time.perf_counter()
    sync()
    wall = (time.perf_counter() - start) / steps * 1e3
    # If issuing the work takes as long as running it, the host is the bottleneck: the
    # final wait for the GPU is then short.
    host_line = (
        "host time to issue each phase (no profiler), ms/step: "
        + ", ".join(f"{k} {v / steps * 1e3:.1f}" for k, v in host.items())
        + f"; then waited {(time.perf_counter() - issued) * 1e3:.1f} ms for the GPU at the end"
    )
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
            if event.device_type != torch.autograd.DeviceType.CUDA or event.key.startswith("phase: "):
                continue
            own = event.self_device_time_total
        else:
            own = event.self_cpu_time_total
        if own:
            times[event.key] += own / 1e3 / steps
    gaps = [host_line]
    if device == "cuda":
        # Host side: the operators (and autograd Functions) that cost the most CPU time.
        gaps.append(
            prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=60)
        )
        gaps += synchronizing_calls(step)
        try:
            gaps += idle_gaps(prof, steps)
        except (AttributeError, RuntimeError) as error:  # the profiler's event API differs by torch version
            gaps = [f"(idle-gap report unavailable: {error})"]
    return dict(times), wall, gaps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--modes", default="lora", help="lora, qlora or lora,qlora")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument(
        "--autocast",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="--no-autocast profiles the step as `slothkit bench train --no-autocast` runs it",
    )
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32

    results = {}
    for mode in args.modes.split(","):
        model = build(args.model, mode, args.layers, device, dtype)
        ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), device=device)
        step = step_fn(model, ids, device, dtype, args.autocast)
        for _ in range(2):  # warm-up: compilation, allocator
            step()
        results[mode] = kernel_times(step, device)
        times, wall, gaps = results[mode]
        print(
            f"\n== {args.model} {mode}, {args.layers or 'all'} layers, {args.batch}x{args.seq}: "
            f"wall {wall:.1f} ms/step, kernels {sum(times.values()):.1f} ms/step"
        )
        for name, ms in sorted(times.items(), key=lambda kv: -kv[1])[: args.top]:
            print(f"{ms:9.2f} ms  {name[:100]}")
        for line in gaps:
            print(line)
        del model, step
        if device == "cuda":
            torch.cuda.empty_cache()

    if len(results) == 2:
        (a, (ta, wa, _)), (b, (tb, wb, _)) = results.items()
        print(
            f"\n== {b} minus {a}: wall {wb - wa:+.1f} ms/step, kernels "
            f"{sum(tb.values()) - sum(ta.values()):+.1f} ms/step; largest differences:"
        )
        names = set(ta) | set(tb)
        deltas = sorted(((tb.get(n, 0.0) - ta.get(n, 0.0), n) for n in names), key=lambda d: -abs(d[0]))
        for delta, name in deltas[: args.top]:
            print(f"{delta:+9.2f} ms  ({ta.get(name, 0.0):8.2f} -> {tb.get(name, 0.0):8.2f})  {name[:90]}")


if __name__ == "__main__":
    main()
