"""What is allocated at the moment of slothkit's peak GPU memory in training, by the code
that allocated it: the breakdown behind the benchmark's "GiB above weights".

    python scripts/memory_peak.py --model mistral-7b --mode qlora

Builds the model as `slothkit bench train` does (random weights of the real shape, LoRA
r=16 on all seven projections, offloaded checkpointing, fused AdamW), resets the peak
counter where the benchmark does (before the warm-up steps, so the layer graphs' capture
counts), records every allocation and free with its Python stack
(``torch.cuda.memory._record_memory_history``), runs a few steps, then replays the trace
to find the moment the allocated total was highest and lists what was live then,
grouped by the innermost frame in slothkit, its kernels, the optimizer or this script.
Memory live before recording began (weights, and the adapters made by ``prepare``) is
one line, "before recording".
"""

from __future__ import annotations

import argparse
import collections
import sys

import torch

from slothkit.bench.train_worker import build_model, prepare

OURS = ("slothkit", "kernels/", "memory_peak.py", "torch/optim")


def owner(frames: list[dict]) -> str:
    """The two innermost frames in our code or the optimizer (frames come innermost
    first), as 'file:line name < caller file:line name'."""
    ours = []
    for frame in frames:
        name = frame.get("filename", "")
        if any(part in name for part in OURS):
            short = name.split("/slothkit/")[-1].split("/kernels/")[-1].split("/torch/")[-1]
            ours.append(f"{short}:{frame.get('line')} {frame.get('name')}")
            if len(ours) == 2:
                break
    return " < ".join(ours) or "other (no slothkit frame)"


def peak_breakdown(events: list[dict]) -> tuple[int, int, list[tuple[str, int, int]], str]:
    """Replay alloc / free_requested events (the allocator's 'allocated' counter moves at
    these two; a block used on another stream completes its free later, when its events
    are done, but is no longer counted as allocated). Returns (peak bytes above the start, index of the peak event, live blocks at
    the peak grouped by owner as (owner, bytes, count) largest first, the owner of the
    allocation that made the peak)."""
    live: dict[int, tuple[int, str]] = {}
    total = peak = 0
    peak_index = -1
    peak_live: dict[int, tuple[int, str]] = {}
    for index, event in enumerate(events):
        action = event.get("action")
        if action == "alloc":
            live[event["addr"]] = (event["size"], owner(event.get("frames", [])))
            total += event["size"]
            if total > peak:
                peak, peak_index = total, index
                peak_live = dict(live)
        elif action == "free_requested":
            size, _ = live.pop(event["addr"], (0, ""))
            total -= size  # a block allocated before recording began is not in `live`
    groups: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for size, who in peak_live.values():
        groups[who][0] += size
        groups[who][1] += 1
    ranked = sorted(((who, b, n) for who, (b, n) in groups.items()), key=lambda g: -g[1])
    at_peak = owner(events[peak_index].get("frames", [])) if peak_index >= 0 else "-"
    return peak, peak_index, ranked, at_peak


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mistral-7b")
    parser.add_argument("--mode", choices=["lora", "qlora"], default="qlora")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("memory_peak.py measures CUDA allocations: run it on a GPU machine")
    dtype = torch.bfloat16
    torch.manual_seed(0)
    model = build_model(args.model, dtype, "cuda", 0, quantize_nf4=args.mode == "qlora")
    torch.cuda.synchronize()
    loaded = torch.cuda.memory_allocated()
    model = prepare("slothkit", model, 16)
    ids = torch.randint(
        0, model.config.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(1)
    ).cuda()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=True)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    step_peaks = []
    for _ in range(args.steps):
        torch.cuda.reset_peak_memory_stats()
        loss = model(input_ids=ids, labels=ids).loss  # no autocast, as the --no-autocast runs
        forward_peak = torch.cuda.max_memory_allocated()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        step_peaks.append((forward_peak, torch.cuda.max_memory_allocated()))
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    events = snapshot["device_traces"][0]
    peak, index, ranked, at_peak = peak_breakdown(events)
    gib = 2**30
    print(
        f"{args.model} {args.mode} {args.batch}x{args.seq}: loaded {loaded / gib:.3f} GiB, "
        f"adapters + model prepare {(before - loaded) / gib:.3f} GiB"
    )
    for step, (forward, whole) in enumerate(step_peaks, 1):
        print(
            f"step {step}: peak above loaded, forward+loss {(forward - loaded) / gib:.3f} GiB, "
            f"whole step {(whole - loaded) / gib:.3f} GiB"
        )
    print(
        f"trace: {len(events)} events; replayed peak above loaded "
        f"{(before - loaded + peak) / gib:.3f} GiB at event {index}, allocated by {at_peak}"
    )
    print(f"{'MiB':>9} {'blocks':>6}  owner")
    print(f"{(before - loaded) / 2**20:9.1f} {'':>6}  before recording (adapters, buffers made by prepare)")
    for who, size, count in ranked[: args.top]:
        print(f"{size / 2**20:9.1f} {count:6d}  {who}")
    rest = sum(size for _, size, _ in ranked[args.top :])
    print(f"{rest / 2**20:9.1f} {'':>6}  the rest ({max(0, len(ranked) - args.top)} owners)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
