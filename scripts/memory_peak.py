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
one line, "before recording".  Then the same for reserved memory: the segments held at
the reserved peak by pool (the ordinary pool or the layer graphs' private pool) and by
the allocation that made the allocator take each, and every pool's state after the
last step (reserved, live, cached, largest cached block) with its live blocks.
``--expandable-segments`` runs with ``expandable_segments:True`` in both allocator variables
(``PYTORCH_ALLOC_CONF``, which torch reads from 2.10, and the older ``PYTORCH_CUDA_ALLOC_CONF``).
See slothkit/bench/memory_trace.py for how the trace is read.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from slothkit.bench.memory_trace import allocated_peak, pools, reserved_peak
from slothkit.bench.model_setup import build_model, prepare
from slothkit.core.environment import allocator_settings


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mistral-7b")
    parser.add_argument("--mode", choices=["lora", "qlora"], default="qlora")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument(
        "--expandable-segments",
        action="store_true",
        help="expandable_segments:True in PYTORCH_ALLOC_CONF and PYTORCH_CUDA_ALLOC_CONF (before CUDA starts)",
    )
    args = parser.parse_args(argv)
    if args.expandable_segments:
        if torch.cuda.is_initialized():
            raise SystemExit("--expandable-segments must be set before CUDA starts")
        for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):  # whichever this torch reads
            os.environ[name] = "expandable_segments:True"
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
    reserved_before = torch.cuda.memory_reserved()
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
        step_peaks.append((forward_peak, torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()))
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    events = snapshot["device_traces"][0]
    gib, mib = 2**30, 2**20
    allocator = allocator_settings()
    print(
        f"{args.model} {args.mode} {args.batch}x{args.seq} (allocator: {allocator}): loaded "
        f"{loaded / gib:.3f} GiB, adapters + model prepare {(before - loaded) / gib:.3f} GiB, "
        f"reserved before the steps {reserved_before / gib:.3f} GiB"
    )
    for step, (forward, whole, reserved) in enumerate(step_peaks, 1):
        print(
            f"step {step}: peak above loaded, forward+loss {(forward - loaded) / gib:.3f} GiB, "
            f"whole step {(whole - loaded) / gib:.3f} GiB; peak reserved {reserved / gib:.3f} GiB"
        )

    peak = allocated_peak(events)
    print(
        f"\ntrace: {len(events)} events; replayed allocated peak above loaded "
        f"{(before - loaded + peak.bytes) / gib:.3f} GiB at event {peak.index}, allocated by {peak.made_by}"
    )
    print(f"{'MiB':>9} {'blocks':>6}  owner")
    print(f"{(before - loaded) / mib:9.1f} {'':>6}  before recording (adapters, buffers made by prepare)")
    _print_groups(peak.groups, args.top)

    peak = reserved_peak(events, snapshot["segments"])
    print(
        f"\nreserved peak {(reserved_before + peak.bytes) / gib:.3f} GiB "
        f"({peak.bytes / gib:.3f} above the start) at event {peak.index}, taken for {peak.made_by}; "
        f"segments held then, by pool and the allocation that took them:"
    )
    print(f"{'MiB':>9} {'segs':>6}  pool: owner")
    print(f"{reserved_before / mib:9.1f} {'':>6}  before recording")
    _print_groups(peak.groups, args.top)

    print("\nafter the last step, by pool:")
    for name, state in pools(snapshot["segments"]).items():
        print(
            f"{name}: reserved {state.reserved / gib:.3f} GiB in {state.segments} segments, "
            f"live {state.allocated / gib:.3f}, cached {state.cached / gib:.3f} "
            f"(largest cached block {state.largest_cached / mib:.1f} MiB)"
        )
        _print_groups(state.live, 8)
    return 0


def _print_groups(groups: list[tuple[str, int, int]], top: int) -> None:
    for who, size, count in groups[:top]:
        print(f"{size / 2**20:9.1f} {count:6d}  {who}")
    rest = sum(size for _, size, _ in groups[top:])
    if rest:
        print(f"{rest / 2**20:9.1f} {'':>6}  the rest ({len(groups) - top} groups)")


if __name__ == "__main__":
    sys.exit(main())
