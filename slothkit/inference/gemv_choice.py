"""Which GEMV a decode step's projection runs, chosen by timing once per shape on the GPU
it runs on:

* a 16-bit weight: cuBLAS's GEMV, then ``addmm_`` for the adapter, or slothkit's
  ``lora_gemv`` (the adapter in its epilogue, one launch);
* an NF4 weight: bitsandbytes' (its 4-bit GEMV for one row; for more, slothkit's
  dequantisation and cuBLAS's matmul), then ``addmm_``, or slothkit's ``nf4_lora_gemv``
  (the weight dequantised in registers, the adapter in the epilogue).

Which is faster depends on the GPU, the shape and the row count (1 to 8), and slothkit's
kernels have several tile sizes; rather than a table measured on one GPU, the first
decode step (the warm-up before its CUDA graph is captured) times the library path and
each tile candidate on the step's own inputs, as CUDA graph replays with the weight read
from memory (the step's own conditions), checks each candidate's output against the
library path's within the dtype's rounding, and keeps the fastest.  slothkit's kernel is
taken only when it is at least ``MIN_GAIN`` faster, so a GPU where the library wins
decodes as before.  Nothing is timed while a graph is being captured (no synchronisation
is allowed then): such a call takes the library path.  The choices are kept per process
(``choices()``, which ``slothkit bench generate`` records).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from slothkit_kernels.lora.gemv import CANDIDATES as DENSE_CANDIDATES
from slothkit_kernels.lora.gemv import MAX_ROWS, lora_gemv
from slothkit_kernels.lora.gemv_group import group_terms, lora_gemv_group
from slothkit_kernels.nf4 import gemv as nf4_gemv
from slothkit_kernels.nf4.dequantize import checked
from slothkit_kernels.nf4.gemv_group import nf4_lora_gemv_group
from slothkit_kernels.nf4.weight import NF4Weight

MIN_GAIN = 0.03
TIMING_MS = 10  # of replays per timed path
PROMISING = 3  # tiles a group launch tries: those that came fastest for each of its projections
# Largest relative error against the library path a candidate may have: both accumulate
# in fp32; the outputs differ by their roundings (the kernel rounds once, the library
# path twice).
TOLERANCE = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}
# The library path and slothkit's kernel each kind of weight is decided between.
NAMES = {
    "16-bit": ("cublas", "lora_gemv"),
    # Projections that read the same rows: each on its own chosen path, or one launch.
    "16-bit group": ("separate launches", "lora_gemv_group"),
    # NF4: what decode runs (lookup "auto": shuffles on CUDA cores, permutes on tensor
    # cores), and each lookup everywhere, measured for comparison (nf4_gemv.LOOKUPS).
    "nf4 group": ("separate launches", "nf4_lora_gemv_group"),
    "nf4-registers group": ("separate launches", "nf4_lora_gemv_group, permute lookup"),
    "nf4-shuffle group": ("separate launches", "nf4_lora_gemv_group, shuffle lookup"),
    "nf4-table group": ("separate launches", "nf4_lora_gemv_group, table lookup"),
    "nf4": ("bitsandbytes", "nf4_lora_gemv"),
    "nf4-registers": ("bitsandbytes", "nf4_lora_gemv, permute lookup"),
    "nf4-shuffle": ("bitsandbytes", "nf4_lora_gemv, shuffle lookup"),
    "nf4-table": ("bitsandbytes", "nf4_lora_gemv, table lookup"),
}

_choices: dict[tuple, dict] = {}


def with_adapter(base: torch.Tensor, xa, lora_b, scaling) -> torch.Tensor:
    """The base layer's output with the adapter accumulated into it, as the decode step
    computes it where slothkit's kernel does not run."""
    if xa is not None:
        base.addmm_(xa, lora_b.t(), alpha=scaling)
    return base


def cublas_path(rows, weight, bias, xa, lora_b, scaling) -> torch.Tensor:
    """What the decode step computes for a 16-bit weight without slothkit's kernel."""
    return with_adapter(F.linear(rows, weight, bias), xa, lora_b, scaling)


def _copies(first, nbytes: int, clone: Callable, device: torch.device) -> list:
    """``first`` (a weight, or a group's tuple of them, on ``device``) and enough clones of
    it that together they exceed twice the L2 cache: calls cycling through them read their
    weight from memory, as the decode step does (it reads each weight once per token),
    rather than from a cache the timing warmed."""
    l2_bytes = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 64 << 20
    count = -(-2 * l2_bytes // nbytes)
    return [first] + [clone() for _ in range(count - 1)]


def _graph_ms(call, copies: list) -> float:
    """Milliseconds of GPU time per ``call(copy)`` as a CUDA graph replays it: the
    decode step runs in one, so the host's launch time (tens of microseconds for a
    Triton launch from Python, more than a decode GEMV's GPU time) must not count."""
    from triton.testing import do_bench_cudagraph

    cycle = itertools.cycle(copies)
    return float(do_bench_cudagraph(lambda: call(next(cycle)), rep=TIMING_MS, return_mode="median"))


def _relative_error(a, b) -> float:
    """Of tensors, or of lists of them (a group's outputs) taken as one."""
    if isinstance(a, (list, tuple)):
        a, b = torch.cat([t.flatten() for t in a]), torch.cat([t.flatten() for t in b])
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def _decide(baseline, kernel, candidates, copies: list, dtype) -> dict:
    """Time ``baseline(copy)`` and each agreeing ``kernel(candidate, copy)`` for the
    candidate indices given; the decision names the candidate to run where one gains at
    least MIN_GAIN."""
    expected = baseline(copies[0])
    decision = {"baseline_ms": _graph_ms(baseline, copies)}
    timed = {}  # candidate -> ms, for those that ran and agreed
    dropped = {}  # candidate -> why it is not one: its error, or what it raised
    for candidate in candidates:
        try:
            error = _relative_error(kernel(candidate, copies[0]), expected)
            if error > TOLERANCE.get(dtype, 3e-2):
                dropped[candidate] = f"relative error {error:.1e}"
                continue
            timed[candidate] = _graph_ms(lambda copy, c=candidate: kernel(c, copy), copies)
        except Exception as failure:  # a tile that does not compile or fit on this GPU
            first_line = (str(failure).splitlines() or [""])[0][:200]
            dropped[candidate] = f"{type(failure).__name__}: {first_line}"
    if dropped:
        decision["dropped"] = dropped
    if timed:
        best = min(timed, key=timed.get)
        decision["kernel_ms"] = timed[best]
        decision["candidates_ms"] = timed
        if timed[best] < decision["baseline_ms"] * (1 - MIN_GAIN):
            decision["candidate"] = best
    return decision


def _choose(key: tuple, baseline, kernel, candidates, make_copies, dtype) -> int | None:
    decision = _choices.get(key)
    if decision is None:
        if torch.cuda.is_current_stream_capturing():
            return None
        with torch.no_grad():
            decision = _choices[key] = _decide(baseline, kernel, candidates, make_copies(), dtype)
    return decision.get("candidate")


def _usable(tiles, uses_tensor_cores, device) -> list[int]:
    """The candidates worth timing on ``device``: Triton makes tensor-core products only
    from compute capability 8.0 (sm_75, a T4, gets fused multiply-adds: a tensor-core tile
    there is slow and costs its compile at the first decode step), so below it the
    tensor-core tiles are left out."""
    mma = torch.cuda.get_device_capability(device) >= (8, 0)
    return [c for c, tile in enumerate(tiles) if mma or not uses_tensor_cores(tile)]


def _considered(rows: torch.Tensor) -> bool:
    return 1 <= rows.shape[0] <= MAX_ROWS and rows.is_cuda


def gemv_candidate(rows, weight, bias, xa, lora_b, scaling) -> int | None:
    """The tile candidate of ``lora_gemv`` to run for this call's shape, or None for
    cuBLAS's path; decided (timed) at the first call of a shape outside graph capture."""
    if not _considered(rows):
        return None
    return _choose(
        _dense_key(rows, weight, bias, xa),
        lambda w: cublas_path(rows, w, bias, xa, lora_b, scaling),
        lambda c, w: lora_gemv(rows, w, bias, xa, lora_b, scaling, candidate=c),
        _usable(DENSE_CANDIDATES, lambda tile: tile[4], rows.device),
        lambda: _copies(weight, weight.numel() * weight.element_size(), weight.clone, rows.device),
        rows.dtype,
    )


def _dense_key(rows, weight, bias, xa) -> tuple:
    return ("16-bit", str(rows.device), rows.dtype, rows.shape[0], *weight.shape, _rank(xa), bias is not None)


def dense_path(rows, weight, bias, xa, lora_b, scaling) -> torch.Tensor:
    """A 16-bit projection of a decode step's rows by the path chosen for its shape:
    ``lora_gemv`` at its chosen tile, else cuBLAS's GEMV and the adapter's ``addmm_``."""
    candidate = gemv_candidate(rows, weight, bias, xa, lora_b, scaling)
    if candidate is None:
        return cublas_path(rows, weight, bias, xa, lora_b, scaling)
    return lora_gemv(rows, weight, bias, xa, lora_b, scaling, candidate=candidate)


def group_gemv_candidate(rows, weights, biases, xa, lora_bs, scalings) -> int | None:
    """The tile candidate of ``lora_gemv_group`` to run for 16-bit projections that read
    the same rows (lora_gemv_group's arguments), or None to run each by ``dense_path``;
    decided (timed) at the first call of a set of shapes outside graph capture."""
    if not _considered(rows):
        return None
    return _group_choice(
        "16-bit group",
        rows,
        weights,
        (biases, xa, lora_bs, scalings),
        lambda g, weight, *term: dense_path(rows, weight, *term),
        lambda g, weight, bias, xa_g: _dense_key(rows, weight, bias, xa_g),
        lambda c, copy: lora_gemv_group(rows, copy, biases, xa, lora_bs, scalings, candidate=c),
        _usable(DENSE_CANDIDATES, lambda tile: tile[4], rows.device),
        sum(w.numel() * w.element_size() for w in weights),
        lambda weight: weight.clone(),
    )


def nf4_group_gemv_candidate(
    rows, weights, biases, xa, lora_bs, scalings, bases, lookup="auto"
) -> int | None:
    """The tile candidate of ``nf4_lora_gemv_group`` to run for NF4 projections quantised
    alike that read the same rows, or None to run each by ``nf4_path`` (``bases[g](w)``:
    member g's base output read from ``w``, as nf4_gemv_candidate takes it); decided
    (timed) at the first call of a set of shapes outside graph capture."""
    if not _considered(rows) or not all(nf4_gemv.supports(w) for w in weights):
        return None
    kind = "nf4 group" if lookup == "auto" else f"nf4-{lookup} group"
    candidate = _group_choice(
        kind,
        rows,
        weights,
        (biases, xa, lora_bs, scalings),
        lambda g, weight, *term: nf4_path(rows, weight, *term, bases[g], lookup),
        lambda g, weight, bias, xa_g: _nf4_key(kind.removesuffix(" group"), rows, weight, bias, xa_g),
        lambda c, copy: nf4_lora_gemv_group(
            rows, copy, biases, xa, lora_bs, scalings, candidate=c, lookup=lookup
        ),
        _usable(nf4_gemv.CANDIDATES, lambda tile: tile[4] == "tensor cores", rows.device),
        sum(w.packed.numel() * w.packed.element_size() for w in weights),
        lambda weight: checked(weight).with_packed(weight.packed.clone()),
    )
    if candidate is None or not _levels_made(weights, candidate, lookup):
        return None
    return candidate


def _group_choice(kind, rows, weights, terms, path, member_key, kernel, usable, nbytes, clone) -> int | None:
    """The choice for a group of projections: ``path(g, weight, bias, xa_g, lora_b,
    scaling)`` runs member g on its own chosen path (the baseline, all members in turn),
    ``member_key(g, weight, bias, xa_g)`` is that member's own decision's key,
    ``kernel(candidate, weights)`` the group launch; ``terms``: (biases, xa, lora_bs,
    scalings) as the group kernels take them."""
    members = group_terms([w.shape[0] for w in weights], *terms)
    _, xa, _, _ = terms
    key = (kind, str(rows.device), rows.dtype, rows.shape[0], "+".join(str(w.shape[0]) for w in weights),
           rows.shape[1], _rank(xa), terms[0] is not None)  # fmt: skip

    def separate(copy):
        return [path(g, weight, *members[g]) for g, weight in enumerate(copy)]

    if key not in _choices and not torch.cuda.is_current_stream_capturing():
        # Each projection's own decision first: the group's candidates are the tiles
        # that came fastest for its members (a group launch is their bands side by
        # side), which saves compiling and timing every tile once more per group.
        separate(weights)
        promising = set()
        for g, weight in enumerate(weights):
            bias, xa_g, _, _ = members[g]
            timed = _choices.get(member_key(g, weight, bias, xa_g), {}).get("candidates_ms", {})
            promising.update(sorted(timed, key=timed.get)[:PROMISING])
        usable = sorted(promising & set(usable)) or usable
    return _choose(
        key,
        separate,
        kernel,
        usable,
        lambda: _copies(tuple(weights), nbytes, lambda: tuple(clone(w) for w in weights), rows.device),
        rows.dtype,
    )


def nf4_gemv_candidate(rows, weight: NF4Weight, bias, xa, lora_b, scaling, base, lookup="auto") -> int | None:
    """The tile candidate of ``nf4_lora_gemv`` to run for this call's shape, or None for
    bitsandbytes' path, ``base(w)`` (the base layer's output for ``rows`` read from the
    NF4 weight ``w``, the weight or a copy of it) followed by the adapter's ``addmm_``.
    ``lookup`` is the kernel's (nf4_gemv.LOOKUPS); decode runs "auto"."""
    if not _considered(rows) or not nf4_gemv.supports(weight):
        return None
    kind = "nf4" if lookup == "auto" else f"nf4-{lookup}"
    key = _nf4_key(kind, rows, weight, bias, xa)

    def clone() -> NF4Weight:  # new codes; the scales (1/64 of the bytes) are shared
        return checked(weight).with_packed(weight.packed.clone())

    candidate = _choose(
        key,
        lambda w: with_adapter(base(w), xa, lora_b, scaling),
        lambda c, w: nf4_gemv.nf4_lora_gemv(rows, w, bias, xa, lora_b, scaling, candidate=c, lookup=lookup),
        _usable(nf4_gemv.CANDIDATES, lambda tile: tile[4] == "tensor cores", rows.device),
        lambda: _copies(weight, weight.packed.numel() * weight.packed.element_size(), clone, rows.device),
        rows.dtype,
    )
    if candidate is None or not _levels_made([weight], candidate, lookup):
        return None
    return candidate


def _levels_made(weights, candidate: int, lookup: str) -> bool:
    """Whether the PTX lookup (registers or shuffle; and, for a group, each weight's
    levels on the host) is made for these records, making it outside capture.  Reading
    levels to the host is a synchronisation, and the choice is made per shape, so another
    layer's records of the same shapes may reach this point first during capture, where
    none is allowed: they then take the library's path in that graph."""
    lookup, width = nf4_gemv.candidate_source_key(candidate, lookup)
    if lookup == "table":
        return True
    made = nf4_gemv.has_level_source(weights[0], lookup, width) and all(
        "levels" in (w.level_sources or {}) for w in weights
    )
    if not made:
        if torch.cuda.is_current_stream_capturing():
            return False
        nf4_gemv.level_source(weights[0], lookup, width)
        for weight in weights:
            nf4_gemv.host_levels(weight)
    return True


def _nf4_key(kind: str, rows, weight, bias, xa) -> tuple:
    return (kind, str(rows.device), rows.dtype, rows.shape[0], *weight.shape, _rank(xa), bias is not None)


def nf4_path(rows, weight, bias, xa, lora_b, scaling, base, lookup="auto") -> torch.Tensor:
    """An NF4 projection of a decode step's rows by the path chosen for its shape:
    ``nf4_lora_gemv`` at its chosen tile, else ``base(weight)`` and the adapter's ``addmm_``."""
    candidate = nf4_gemv_candidate(rows, weight, bias, xa, lora_b, scaling, base, lookup)
    if candidate is None:
        return with_adapter(base(weight), xa, lora_b, scaling)
    return nf4_gemv.nf4_lora_gemv(rows, weight, bias, xa, lora_b, scaling, candidate=candidate, lookup=lookup)


def _rank(xa) -> int:
    return 0 if xa is None else xa.shape[1]


def choices() -> list[dict]:
    """Every shape decided in this process: the weight's kind, rows, out and in features,
    rank, bias, the milliseconds of the library path, of the best candidate and of each
    candidate that agreed (by its index), why each other candidate was dropped, and which
    runs."""
    listed = []
    for (kind, _, _, rows, out_features, in_features, rank, bias), decision in _choices.items():
        library, kernel = NAMES[kind]
        listed.append(
            {
                "weight": kind,
                "rows": rows,
                "out_features": out_features,
                "in_features": in_features,
                "rank": rank,
                "bias": bias,
                "baseline": library,
                "baseline_ms": decision["baseline_ms"],
                "kernel_ms": decision.get("kernel_ms"),
                "candidates_ms": {str(c): ms for c, ms in decision.get("candidates_ms", {}).items()},
                "dropped": {str(c): why for c, why in decision.get("dropped", {}).items()},
                "runs": kernel if "candidate" in decision else library,
            }
        )
    return listed
