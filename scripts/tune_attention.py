"""Time every launch of slothkit_kernels.attention's three kernels over a grid of tile
sizes, warps and pipeline stages, on the current GPU, and print the fastest per kernel
and head width (the values slothkit_kernels/attention.py's _TUNED holds).

    python scripts/tune_attention.py [--dims 256 128] [--json PATH]

Each launch is checked against the small-tile launch's result before it is timed, so a
launch that compiles but computes something else is never chosen.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import math

import torch
import triton
from triton.testing import do_bench

# The module, not the function the package exports under the same name.
attn = importlib.import_module("slothkit_kernels.attention")

# (batch, q heads, kv heads, length) per head width: Gemma-2-9B (256) and Gemma-2-27B (128)
# at the README's training shape, 2 x 2048.
SHAPES = {256: (2, 16, 8, 2048), 128: (2, 32, 16, 2048)}


def _grid(rows_m, rows_n, stages):
    for block_m, block_n, warps, stage in itertools.product(rows_m, rows_n, (4, 8), stages):
        yield attn.Tiles(block_m, block_n, warps, stage)


def _timed(fn, reference, rtol=2e-2):
    try:
        result = fn()
        torch.cuda.synchronize()
    except Exception as error:  # out of shared memory or registers: not a candidate
        return None, type(error).__name__
    for got, want in zip(result, reference):
        scale = want.float().abs().max().item() or 1.0
        if (
            not math.isfinite(got.float().abs().max().item())
            or (got.float() - want.float()).abs().max().item() > rtol * scale
        ):
            return None, "wrong result"
    return do_bench(fn, warmup=25, rep=100), ""


def tune(dim: int, with_mask: bool, only: dict | None = None) -> dict:
    """The fastest launches for head width `dim`; with `only` (kernel: tiles), time just
    those launches."""
    batch, heads, kv_heads, length = SHAPES[dim]
    torch.manual_seed(0)
    shape = lambda h: (batch, h, length, dim)  # noqa: E731
    q, k, v = (
        torch.randn(shape(h), device="cuda", dtype=torch.bfloat16) for h in (heads, kv_heads, kv_heads)
    )
    mask3 = None
    if with_mask:  # transformers' eager causal mask, as the training path passes it
        lowest = torch.finfo(torch.bfloat16).min
        causal = torch.ones(length, length, device="cuda", dtype=torch.bool).tril()
        mask3 = torch.zeros(batch, length, length, device="cuda", dtype=torch.bfloat16).masked_fill(
            ~causal, lowest
        )
    settings = (dim**-0.5, 50.0, None)
    stages = (1, 2) if dim > 128 else (1, 2, 3)  # three stages of 256-wide tiles never fit
    small = {kernel: attn._small_tiles(dim, kernel) for kernel in ("forward", "backward_kv", "backward_q")}
    out, row_max, log_sum = attn.attention_forward(q, k, v, mask3, *settings, tiles=small["forward"])
    grad = torch.randn_like(out)

    def backward(kv_tiles, q_tiles):
        saved = (q, k, v, mask3, out, row_max, log_sum, grad)
        return attn.attention_backward(*saved, *settings, kv_tiles=kv_tiles, q_tiles=q_tiles)

    reference = backward(small["backward_kv"], small["backward_q"])
    # Each backward kernel is timed with the other at its small tiles: the differences
    # between launches are the swept kernel's.
    sweeps = {
        "forward": (
            _grid((64, 128), (32, 64), stages),
            lambda t: attn.attention_forward(q, k, v, mask3, *settings, tiles=t)[:1],
            (out,),
        ),
        "backward_kv": (
            _grid((16, 32, 64), (32, 64), stages),
            lambda t: backward(t, small["backward_q"])[1:3],
            reference[1:3],  # dk, dv (no sinks here)
        ),
        "backward_q": (
            _grid((32, 64), (16, 32, 64), stages),
            lambda t: backward(small["backward_kv"], t)[:1],
            reference[:1],
        ),
    }
    found = {}
    for kernel, (grid, run, want) in sweeps.items():
        if only is not None:
            grid = [attn.Tiles(*only[kernel])]
        grid = list(grid)
        grid += [small[kernel]] * (small[kernel] not in grid)
        rows = []
        for tiles in grid:
            ms, why = _timed(lambda: run(tiles), want)
            rows.append({"tiles": tuple(tiles), "ms": ms, "skipped": why})
        timed = sorted((r for r in rows if r["ms"] is not None), key=lambda r: r["ms"])
        small_ms = (
            next(r["ms"] for r in rows if r["tiles"] == tuple(small[kernel]))
            if any(r["tiles"] == tuple(small[kernel]) for r in rows)
            else None
        )
        found[kernel] = {
            "best": timed[:5],
            "small_tiles": tuple(small[kernel]),
            "small_ms": small_ms,
            "skipped": sum(1 for r in rows if r["ms"] is None),
        }
        best = timed[0]
        print(
            f"d={dim} mask={with_mask} {kernel:12s} best {best['tiles']} {best['ms']:.3f} ms"
            f"  (small tiles {tuple(small[kernel])}: {small_ms and round(small_ms, 3)} ms;"
            f" {found[kernel]['skipped']} launches skipped)",
            flush=True,
        )
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", type=int, nargs="+", default=[256, 128])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    print(
        torch.cuda.get_device_name(),
        "shared memory per block:",
        attn._shared_memory(torch.device("cuda")),
        "triton",
        triton.__version__,
        flush=True,
    )
    record = {
        f"{dim}-{'mask' if mask else 'no-mask'}": tune(dim, mask)
        for dim in args.dims
        for mask in (True, False)
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
