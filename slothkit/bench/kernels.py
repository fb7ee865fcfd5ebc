"""Per-kernel benchmark of slothkit_kernels against torch eager and torch.compile.

    python -m slothkit.bench.kernels                   # every op, bf16, every shape
    python -m slothkit.bench.kernels --ops rms_norm,rope --quick --json b.json --markdown b.md
    python -m slothkit.bench.kernels --cpu-tiny        # no GPU: check the harness on tiny shapes

The cases (shapes, inputs, byte and FLOP counts) live in kernel_cases.py.  For every
case, pass (forward; forward+backward) and implementation (slothkit's kernel, the
op's plain-torch reference run eagerly, that reference under torch.compile, and
baselines such as bitsandbytes) one row records:

    ms         median time of one call: triton.testing.do_bench (L2 flushed before
               each call, warm-up and compilation excluded); wall clock on the CPU
    GB/s       the least traffic the op needs (inputs read once, outputs written
               once) divided by that time
    % copy BW  that GB/s as a share of a device-to-device copy measured in this run
    TFLOP/s    for the matmul-bound ops
    vs eager   eager ms / this ms
    peak MiB   torch.cuda.max_memory_allocated during one call, beyond what was
               allocated before it (the inputs, plus the held eager result)
    rel err    ||result - eager result|| / ||eager result||: the outputs for the
               forward pass, the input gradients for forward+backward

A failure (an op not written yet, a compile error, out of memory) is recorded in
its row and the run goes on.

How a row is measured: ``kernel_timing``; the environment, the tables and the Markdown
report: ``kernel_report``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import torch

from slothkit.bench.kernel_cases import OPS, build_cases
from slothkit.bench.kernel_report import environment, markdown_report, text_table
from slothkit.bench.kernel_timing import DTYPES, Row, Settings, bench_case, copy_bandwidth
from slothkit.core.arguments import non_negative_int, positive_int


def _list_arg(values: list[str], allowed, what: str, parser) -> list[str]:
    items = [item for value in values for item in value.split(",") if item]
    unknown = [item for item in items if item not in allowed]
    if unknown:
        parser.error(f"unknown {what} {', '.join(unknown)}; choose from {', '.join(allowed)}")
    return items


def write_reports(args: argparse.Namespace, env: dict, notes: dict, rows: list[Row]) -> None:
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {**env, "notes": notes, "rows": [dataclasses.asdict(r) for r in rows]},
                f,
                indent=1,
                allow_nan=False,
            )
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown_report(env, rows, notes))


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m slothkit.bench.kernels",
        description="Time slothkit_kernels against torch eager and torch.compile.",
    )
    parser.add_argument("--ops", nargs="+", default=[], help=f"subset of: {', '.join(OPS)}")
    parser.add_argument(
        "--dtype", nargs="+", default=[], help="bf16, fp16, fp32 (default bf16; fp32 with --cpu-tiny)"
    )
    parser.add_argument("--quick", action="store_true", help="fewer, smaller shapes")
    parser.add_argument("--json", metavar="PATH", help="write the full record as JSON")
    parser.add_argument("--markdown", metavar="PATH", help="write the table as Markdown")
    parser.add_argument(
        "--cpu-tiny",
        action="store_true",
        help="tiny shapes on the CPU (Triton interpreter or reference): checks "
        "the harness, the numbers mean nothing",
    )
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile rows")
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile backend")
    parser.add_argument("--warmup-ms", type=non_negative_int, default=25, help="do_bench warm-up budget")
    parser.add_argument("--rep-ms", type=positive_int, default=100, help="do_bench timing budget")
    parser.add_argument(
        "--cuda-graph",
        action="store_true",
        help="time replays of a captured CUDA graph of each call, so Python and "
        "launch overhead stay out of the figures (falls back per row)",
    )
    args = parser.parse_args(argv)
    args.ops = _list_arg(args.ops, OPS, "op", parser) or list(OPS)
    args.dtype = _list_arg(args.dtype, DTYPES, "dtype", parser) or (["fp32"] if args.cpu_tiny else ["bf16"])
    for path in (args.json, args.markdown):  # refuse now rather than after a long run
        if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            parser.error(f"cannot write {path}: its folder does not exist")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.cpu_tiny:
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda")
    else:
        print(
            "No CUDA device: slothkit.bench.kernels times GPU kernels and has nothing to "
            "measure here.\nRun it on a GPU machine, or pass --cpu-tiny to check the harness "
            "on tiny CPU shapes (its numbers mean nothing).",
            file=sys.stderr,
        )
        return 1
    settings = Settings(
        device,
        compile=not args.no_compile,
        compile_backend=args.compile_backend,
        warmup_ms=args.warmup_ms,
        rep_ms=args.rep_ms,
        cuda_graph=args.cuda_graph,
    )
    shapes = "tiny" if args.cpu_tiny else "quick" if args.quick else "full"
    cases = build_cases(args.ops, [DTYPES[d] for d in args.dtype], shapes)

    copy_gb_per_s = copy_bandwidth(settings)
    print(f"device-to-device copy: {copy_gb_per_s:.1f} GB/s", flush=True)
    env = environment(device, argv, copy_gb_per_s)
    notes = {c.op: c.note for c in cases if c.note}
    rows: list[Row] = []
    for case in cases:
        for mode in ("fwd", "fwd+bwd") if case.bytes_fwd_bwd is not None else ("fwd",):
            rows += bench_case(case, mode, copy_gb_per_s, settings)
        # Rewritten after every case, so a run cut short still leaves its rows.
        write_reports(args, {**env, "complete": case is cases[-1]}, notes, rows)
    print()
    print(f"{env['gpu']}, copy {copy_gb_per_s:.1f} GB/s, torch {env['torch']}, triton {env['triton']}")
    print(text_table(rows))
    return 0


if __name__ == "__main__":
    if "--cpu-tiny" in sys.argv[1:] and not torch.cuda.is_available():
        # Kernel modules pick the interpreter when they are imported, which is later.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    sys.exit(main())
