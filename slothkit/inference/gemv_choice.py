"""Which GEMV a decode step's 16-bit projection runs: cuBLAS's (then ``addmm_`` for the
adapter) or slothkit's ``lora_gemv`` (the adapter in its epilogue, one launch), chosen
by timing both once per shape on the GPU it runs on.

Which is faster depends on the GPU, the shape and the row count (1 to 8), and slothkit's
kernel has several tile sizes; rather than a table measured on one GPU, the first decode
step (the warm-up before its CUDA graph is captured) times cuBLAS's path and each tile
candidate on the step's own inputs, as CUDA graph replays with the weight read from
memory (the step's own conditions), checks each candidate's output against cuBLAS's
within the dtype's rounding, and keeps the fastest.  slothkit's kernel is taken only
when it is at least ``MIN_GAIN`` faster, so a GPU where cuBLAS wins decodes as before.
Nothing is timed while a graph is being captured (no synchronisation is allowed then):
such a call takes cuBLAS's path.  The choices are kept per process (``choices()``, which
``slothkit bench generate`` records).
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from slothkit_kernels.lora_gemv import CANDIDATES, MAX_ROWS, lora_gemv

MIN_GAIN = 0.03
TIMING_MS = 10  # of replays per timed path
# Largest relative error against cuBLAS's path a candidate may have: both accumulate in
# fp32; the outputs differ by their roundings (the kernel rounds once, cuBLAS's path twice).
TOLERANCE = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}

_choices: dict[tuple, dict] = {}


def _key(rows, weight, bias, xa) -> tuple:
    rank = 0 if xa is None else xa.shape[1]
    return (str(rows.device), rows.dtype, rows.shape[0], *weight.shape, rank, bias is not None)


def cublas_path(rows, weight, bias, xa, lora_b, scaling) -> torch.Tensor:
    """What the decode step computes without slothkit's kernel: the base layer's GEMV,
    then the adapter accumulated into it."""
    out = F.linear(rows, weight, bias)
    if xa is not None:
        out.addmm_(xa, lora_b.t(), alpha=scaling)
    return out


def _weight_copies(weight: torch.Tensor) -> list[torch.Tensor]:
    """The weight and enough copies of it that together they exceed twice the L2 cache:
    calls cycling through them read their weight from memory, as the decode step does
    (it reads each weight once per token), rather than from a cache the timing warmed."""
    l2_bytes = getattr(torch.cuda.get_device_properties(weight.device), "L2_cache_size", 0) or 64 << 20
    count = -(-2 * l2_bytes // (weight.numel() * weight.element_size()))
    return [weight] + [weight.clone() for _ in range(count - 1)]


def _graph_ms(call, weight: torch.Tensor) -> float:
    """Milliseconds of GPU time per ``call(weight)`` as a CUDA graph replays it: the
    decode step runs in one, so the host's launch time (tens of microseconds for a
    Triton launch from Python, more than a decode GEMV's GPU time) must not count."""
    from triton.testing import do_bench_cudagraph

    copies = itertools.cycle(_weight_copies(weight))
    return float(do_bench_cudagraph(lambda: call(next(copies)), rep=TIMING_MS, return_mode="median"))


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def _decide(rows, weight, bias, xa, lora_b, scaling) -> dict:
    expected = cublas_path(rows, weight, bias, xa, lora_b, scaling)
    decision = {"cublas_ms": _graph_ms(lambda w: cublas_path(rows, w, bias, xa, lora_b, scaling), weight)}
    best = None
    for candidate in range(len(CANDIDATES)):
        try:
            got = lora_gemv(rows, weight, bias, xa, lora_b, scaling, candidate=candidate)
            error = _relative_error(got, expected)
            if error > TOLERANCE.get(rows.dtype, 3e-2):
                continue
            ms = _graph_ms(
                lambda w, c=candidate: lora_gemv(rows, w, bias, xa, lora_b, scaling, candidate=c), weight
            )
        except Exception:  # a tile that does not compile or fit on this GPU: not a candidate
            continue
        if best is None or ms < best[1]:
            best = (candidate, ms)
    if best is not None:
        decision["kernel_ms"] = best[1]
        if best[1] < decision["cublas_ms"] * (1 - MIN_GAIN):
            decision["candidate"] = best[0]
    return decision


def gemv_candidate(rows, weight, bias, xa, lora_b, scaling) -> int | None:
    """The tile candidate of ``lora_gemv`` to run for this call's shape, or None for
    cuBLAS's path; decided (timed) at the first call of a shape outside graph capture."""
    if not rows.is_cuda or not 1 <= rows.shape[0] <= MAX_ROWS:
        return None
    key = _key(rows, weight, bias, xa)
    decision = _choices.get(key)
    if decision is None:
        if torch.cuda.is_current_stream_capturing():
            return None
        with torch.no_grad():
            decision = _choices[key] = _decide(rows, weight, bias, xa, lora_b, scaling)
    return decision.get("candidate")


def choices() -> list[dict]:
    """Every shape decided in this process: rows, out and in features, rank, bias, the
    milliseconds of cuBLAS's path and of the best candidate, and which runs."""
    return [
        {
            "rows": key[2],
            "out_features": key[3],
            "in_features": key[4],
            "rank": key[5],
            "bias": key[6],
            "cublas_ms": decision["cublas_ms"],
            "kernel_ms": decision.get("kernel_ms"),
            "runs": "lora_gemv" if "candidate" in decision else "cublas",
        }
        for key, decision in _choices.items()
    ]
