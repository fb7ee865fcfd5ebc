"""How ``slothkit.bench.kernels`` measures one case: each implementation's row (time,
memory, error against eager), with the bandwidth and FLOP rates derived from it.
"""

from __future__ import annotations

import dataclasses
import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from slothkit.bench.kernel_cases import Case

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
