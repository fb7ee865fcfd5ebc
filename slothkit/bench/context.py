"""`slothkit bench context`: the longest batch-1 sequence each implementation trains
one step at, under a GPU memory cap, found by bisection.

Each probe is a fresh worker process (one optimizer step at that length under
``torch.cuda.set_per_process_memory_fraction``), so a probe that runs out of
memory cannot leave fragments behind for the next one.
"""

from __future__ import annotations

import argparse
import sys

from slothkit.bench.train import check_implementations, environment, run_worker, write_record
from slothkit.core.arguments import positive_float, positive_int


def longest_sequence(impl: str, args, probe=run_worker) -> dict:
    """Bisection over multiples of --granularity between --min-seq and --max-seq."""
    step = args.granularity
    lo, hi = 0, args.max_seq // step + 1  # lo fits (0 = nothing known), hi does not
    probes = []

    def fits(units: int) -> bool:
        probe_args = argparse.Namespace(
            **{**vars(args), "batch": 1, "seq": units * step, "steps": 1, "warmup": 0}
        )
        result = probe(impl, probe_args)
        probes.append(
            {
                "seq": units * step,
                "status": result.get("status"),
                "peak_allocated_gib": result.get("peak_allocated_gib"),
                "peak_reserved_gib": result.get("peak_reserved_gib"),
                "peak_host_gib": result.get("peak_host_gib"),
                "error": result.get("error"),
            }
        )
        print(f"  {impl}: {units * step} tokens -> {result.get('status')}", file=sys.stderr, flush=True)
        if result.get("status") == "ok":
            return True
        if result.get("status") in ("out of memory", "error"):
            return False
        raise RuntimeError(f"{impl} could not be probed: {result}")

    first = max(1, args.min_seq // step)
    try:
        if not fits(first):
            return {"impl": impl, "longest_seq": None, "first_failing_seq": first * step, "probes": probes}
        lo = first
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid
    except RuntimeError as error:
        return {"impl": impl, "status": "skipped", "error": str(error), "probes": probes}
    failing = hi * step if hi * step <= args.max_seq else None
    return {
        "impl": impl,
        "status": "ok",
        "longest_seq": lo * step,
        "first_failing_seq": failing,
        "probes": probes,
    }


def run_context_bench(args) -> dict:
    impls = [i.strip() for i in args.impl.split(",") if i.strip()]
    check_implementations(impls)
    import torch

    if not torch.cuda.is_available() and not args.model.startswith("tiny-"):
        raise SystemExit(
            "no CUDA GPU here: the context test measures GPU memory; on a CPU "
            "only --model tiny-llama (a check of the harness) runs"
        )
    rows = []
    record = {
        **environment(),
        "kind": "context",
        "model": args.model,
        "mode": args.mode,
        "dtype": args.dtype,
        "memory_gib": args.memory_gib,
        "granularity": args.granularity,
        "rows": rows,
    }
    for number, impl in enumerate(impls):
        rows.append(longest_sequence(impl, args))
        # Written after each implementation: a run cut short keeps what it measured.
        write_record(args.output, record, pending=impls[number + 1 :])
    for row in rows:
        if row.get("status") == "ok":
            print(
                f"{row['impl']:10s} longest {row['longest_seq']} tokens; "
                f"first failing {row['first_failing_seq'] or '> --max-seq'}"
            )
        else:
            print(f"{row['impl']:10s} {row.get('status')}: {row.get('error', '')}")
    return record


def add_arguments(parser) -> None:
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--mode", choices=["lora", "qlora"], default="qlora")
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    parser.add_argument("--memory-gib", type=positive_float, default=24.0, help="GPU memory cap (24 or 80)")
    parser.add_argument("--min-seq", type=positive_int, default=4096)
    parser.add_argument("--max-seq", type=positive_int, default=131072)
    parser.add_argument(
        "--granularity", type=positive_int, default=4096, help="lengths probed are multiples of this"
    )
    parser.add_argument("--rank", type=positive_int, default=16)
    parser.add_argument("--impl", default="slothkit,hf,liger,unsloth")
    parser.add_argument("--output", help="write the JSON record here")
