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
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import importlib.metadata
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from slothkit.bench.kernel_cases import OPS, Case, build_cases

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
COPY_PROBE_BYTES = {"cuda": 1 << 30, "cpu": 1 << 23}  # size of each tensor in the copy probe
CPU_REPEATS = 1  # timed calls per row on the CPU, where the numbers only check the harness


@dataclasses.dataclass
class Row:
    op: str
    shape: str
    dtype: str
    mode: str  # "fwd" or "fwd+bwd"
    impl: str
    status: str = "ok"  # "ok", "not available" or "error"
    ms: float | None = None
    gb_per_s: float | None = None
    pct_copy_bw: float | None = None
    tflop_per_s: float | None = None
    speedup_vs_eager: float | None = None
    peak_mib: float | None = None
    rel_err: float | None = None
    error: str | None = None
    timing: str = "launch"  # "launch" (do_bench) or "cuda-graph" (replays of a captured call)


@dataclasses.dataclass
class Settings:
    device: torch.device
    compile: bool = True
    compile_backend: str = "inductor"
    warmup_ms: int = 25
    rep_ms: int = 100
    cuda_graph: bool = False


# --- measuring -----------------------------------------------------------------------


def time_ms(fn: Callable[[], Any], grad_tensors: list[torch.Tensor], settings: Settings) -> float:
    """Median milliseconds per call of fn (already warmed up); grads reset before each."""
    if settings.device.type == "cuda":
        from triton.testing import do_bench

        return float(
            do_bench(
                fn,
                warmup=settings.warmup_ms,
                rep=settings.rep_ms,
                grad_to_none=grad_tensors,
                return_mode="median",
            )
        )
    times = []
    for _ in range(CPU_REPEATS):
        for t in grad_tensors:
            t.grad = None
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def graph_time_ms(fn: Callable[[], Any], grad_tensors: list[torch.Tensor], settings: Settings) -> float:
    """Median milliseconds per replay of a CUDA graph of fn.

    A small kernel launched from Python can finish before the next launch is
    issued, so launch timing measures the CPU.  Graph replays measure the GPU work
    alone, which is what the kernel costs inside a training step whose launches
    run ahead of the GPU.
    """
    from triton.testing import do_bench_cudagraph

    for t in grad_tensors:
        t.grad = None
    return float(do_bench_cudagraph(fn, rep=settings.rep_ms, return_mode="median"))


def copy_bandwidth(settings: Settings) -> float:
    """GB/s of dst.copy_(src) on a large buffer, counting bytes read plus bytes written."""
    n = COPY_PROBE_BYTES[settings.device.type]
    src = torch.ones(n, dtype=torch.uint8, device=settings.device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    ms = time_ms(lambda: dst.copy_(src), [], settings)
    return 2 * n / ms / 1e6


def peak_mib(fn: Callable[[], Any], grad_tensors: list[torch.Tensor], device) -> float | None:
    """Peak memory of one call of fn beyond what was allocated before it (None on CPU)."""
    if device.type != "cuda":
        return None
    for t in grad_tensors:
        t.grad = None
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - before) / 2**20


def _tensors(value) -> list[torch.Tensor]:
    """The tensors in an op's result (a tensor or a tuple/list of them)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


def make_step(impl, inputs: dict, mode: str) -> Callable[[], Any]:
    """One timed call: the forward pass, or forward then backward."""
    if mode == "fwd":
        return lambda: impl(inputs)
    grad_outputs: list | None = None

    def step():
        nonlocal grad_outputs
        outs = [t for t in _tensors(impl(inputs)) if t.requires_grad]
        if not outs:
            raise RuntimeError("no output requires grad: the implementation dropped autograd")
        if grad_outputs is None:  # fixed output gradients, the same for every impl
            torch.manual_seed(1)
            grad_outputs = [None if t.dim() == 0 else torch.randn_like(t) for t in outs]
        torch.autograd.backward(outs, grad_outputs)

    return step


def relative_error(result: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    """Largest ||a - b|| / ||b|| over matching tensors."""
    if len(result) != len(reference):
        raise ValueError(f"{len(result)} result tensors, but eager gave {len(reference)}")
    errors = []
    for a, b in zip(result, reference, strict=True):
        if a.shape != b.shape:
            raise ValueError(f"result shape {tuple(a.shape)} differs from eager's {tuple(b.shape)}")
        a, b = a.float(), b.float()
        errors.append(((a - b).norm() / b.norm().clamp_min(1e-30)).item())
    return max(errors)


def _describe(exc: BaseException) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    text = f"{type(exc).__name__}: {lines[0] if lines else ''}"
    return text[:300]


def _free(device) -> None:
    """Return the last row's memory to the GPU, so the next row's peak starts clean."""
    if device.type == "cuda":
        gc.collect()  # compiled functions and exceptions can hold tensors in cycles
        torch.cuda.empty_cache()


def _measure(
    row: Row, impl, inputs: dict, settings: Settings, reference: list[torch.Tensor] | None
) -> list[torch.Tensor] | None:
    """Fill row's numbers.  Eager's result (outputs, or input grads) is returned, as
    a copy, because later calls may overwrite it (in-place ops); other rows' is not."""
    trained = {n: t for n, t in inputs.items() if isinstance(t, torch.Tensor) and t.requires_grad}
    grad_tensors = list(trained.values())
    step = make_step(impl, inputs, row.mode)
    out = step()  # first call: compiles (Triton, torch.compile) and gives the result
    if row.mode == "fwd+bwd":
        missing = [n for n, t in trained.items() if t.grad is None]
        if missing:
            raise RuntimeError(f"no gradient reached {', '.join(missing)}")
        result = [t.grad for t in grad_tensors]
    else:
        result = _tensors(out)
    del out
    if not all(torch.isfinite(t).all() for t in result):
        raise FloatingPointError("the result has NaN or inf")
    if reference is not None:
        row.rel_err = relative_error(result, reference)
    result = [t.detach().clone() for t in result] if row.impl == "eager" else None
    row.peak_mib = peak_mib(step, grad_tensors, settings.device)
    row.ms = None
    if settings.cuda_graph and settings.device.type == "cuda":
        try:
            row.ms = graph_time_ms(step, grad_tensors, settings)
            row.timing = "cuda-graph"
        except Exception as exc:  # e.g. a host sync inside the op cannot be captured
            torch.cuda.synchronize(settings.device)
            row.timing = f"launch (graph capture failed: {type(exc).__name__})"
    if row.ms is None:
        row.ms = time_ms(step, grad_tensors, settings)
    return result


def bench_impl(
    case: Case, mode: str, name: str, loader, settings: Settings, reference: list[torch.Tensor] | None
) -> tuple[Row, list[torch.Tensor] | None]:
    """Measure one implementation; returns its row and its result (for comparisons)."""
    row = Row(case.op, case.shape, DTYPE_NAMES[case.dtype], mode, name)
    result = None
    try:
        impl = loader()
        inputs = case.make_inputs(settings.device, mode == "fwd+bwd")
    except (ImportError, AttributeError, SyntaxError) as exc:  # op or dependency missing
        row.status, row.error = "not available", _describe(exc)
        return row, None
    except Exception as exc:  # e.g. torch.compile refusing the function, out of memory
        row.status, row.error = "error", _describe(exc)
        return row, None
    try:
        result = _measure(row, impl, inputs, settings, reference)
    except Exception as exc:  # compile failure, out of memory, a wrong result
        row.status, row.error = "error", _describe(exc)
    del inputs  # freed here, after the exception and its frames are gone
    _free(settings.device)
    return row, result


def _implementations(case: Case, settings: Settings) -> dict[str, Callable]:
    """The case's implementations, with torch.compile of the eager reference after eager."""
    impls = {"eager": case.impls["eager"]} if "eager" in case.impls else {}
    if settings.compile and "eager" in case.impls:

        def compiled():
            torch._dynamo.reset()  # each case compiles afresh, far from the recompile limit
            return torch.compile(case.impls["eager"](), backend=settings.compile_backend, dynamic=False)

        impls["compile"] = compiled
    impls.update(case.impls)
    return impls


def bench_case(case: Case, mode: str, copy_gb_per_s: float, settings: Settings) -> list[Row]:
    bytes_moved = case.bytes_fwd if mode == "fwd" else case.bytes_fwd_bwd
    flops = case.flops_fwd if mode == "fwd" else case.flops_fwd_bwd
    rows, reference = [], None
    for name, loader in _implementations(case, settings).items():
        row, result = bench_impl(case, mode, name, loader, settings, reference)
        if name == "eager":
            reference = result
        if row.status == "ok":
            row.gb_per_s = bytes_moved / row.ms / 1e6
            row.pct_copy_bw = 100.0 * row.gb_per_s / copy_gb_per_s
            row.tflop_per_s = flops / row.ms / 1e9 if flops else None
        rows.append(row)
        print(
            f"  {case.op} {case.shape} {row.dtype} {mode} {name}: "
            + (f"{row.ms:.3f} ms" if row.status == "ok" else f"{row.status} ({row.error})"),
            flush=True,
        )
    eager = next((r for r in rows if r.impl == "eager" and r.status == "ok"), None)
    for row in rows:
        if eager is not None and row.status == "ok":
            row.speedup_vs_eager = eager.ms / row.ms
    return rows


# --- reporting -----------------------------------------------------------------------


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _driver_version() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return out.strip().splitlines()[0] if out.strip() else None


def environment(device: torch.device, argv: list[str], copy_gb_per_s: float) -> dict:
    cuda = device.type == "cuda"
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python -m slothkit.bench.kernels " + shlex.join(argv),
        "device": device.type,
        "gpu": torch.cuda.get_device_name(device) if cuda else "none (CPU harness check)",
        "driver": _driver_version() if cuda else None,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "transformers": _version("transformers"),
        "bitsandbytes": _version("bitsandbytes"),
        "triton_interpreter": os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
        "copy_gb_per_s": copy_gb_per_s,
    }


COLUMNS = (
    "kernel",
    "shape",
    "dtype",
    "pass",
    "impl",
    "ms",
    "GB/s",
    "% copy BW",
    "TFLOP/s",
    "vs eager",
    "peak MiB",
    "rel err",
    "note",
)


def _cells(row: Row) -> list[str]:
    def num(value, fmt):
        return "-" if value is None else format(value, fmt)

    note = "" if row.status == "ok" else f"{row.status}: {row.error}"
    if row.status == "ok" and row.timing not in ("launch", "cuda-graph"):
        note = row.timing
    if len(note) > 90:
        note = note[:87] + "..."
    return [
        row.op,
        row.shape,
        row.dtype,
        row.mode,
        row.impl,
        num(row.ms, ".3f"),
        num(row.gb_per_s, ".1f"),
        num(row.pct_copy_bw, ".1f"),
        num(row.tflop_per_s, ".1f"),
        num(row.speedup_vs_eager, ".2f"),
        num(row.peak_mib, ".1f"),
        num(row.rel_err, ".1e"),
        note,
    ]


def text_table(rows: list[Row]) -> str:
    table = [list(COLUMNS)] + [_cells(r) for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown_table(rows: list[Row]) -> str:
    def line(cells):
        return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"

    lines = [line(COLUMNS), line(["---"] * len(COLUMNS))]
    return "\n".join(lines + [line(_cells(r)) for r in rows])


def markdown_report(env: dict, rows: list[Row], notes: dict[str, str]) -> str:
    packages = ("torch", "triton", "transformers", "bitsandbytes")
    versions = ", ".join(f"{k} {env[k]}" for k in packages if env[k])
    lines = [
        "# slothkit_kernels benchmark",
        "",
        f"- GPU: {env['gpu']} (driver {env['driver']}, CUDA {env['cuda']})",
        f"- {versions}",
        f"- device-to-device copy (bytes read + written): {env['copy_gb_per_s']:.1f} GB/s",
        f"- date: {env['date']}",
        f"- command: `{env['command']}`",
        "" if env["complete"] else "\n**Incomplete: written before the last case finished.**\n",
        markdown_table(rows),
        "",
        "timing: replays of a CUDA graph of each call (--cuda-graph), except rows whose note says otherwise"
        if "--cuda-graph" in env["command"]
        else "timing: triton.testing.do_bench of each call, Python and launch overhead included",
        "",
        "ms: median per call; GB/s: least bytes the op must move (inputs read once, outputs",
        "written once) / time; vs eager: eager ms / ms; peak MiB: memory beyond the inputs;",
        "rel err: against eager (outputs for fwd, input gradients for fwd+bwd).",
        "",
    ]
    lines += [f"- {op}: {note}" for op, note in notes.items()]
    return "\n".join(lines) + "\n"


# --- command line --------------------------------------------------------------------


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
    parser.add_argument("--warmup-ms", type=int, default=25, help="do_bench warm-up budget")
    parser.add_argument("--rep-ms", type=int, default=100, help="do_bench timing budget")
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
