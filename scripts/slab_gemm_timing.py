"""How long backward's dX = dY W takes for an NF4 W dequantised whole or a column slab at a
time (``slothkit_kernels.lora.gemms._add_base_term``), at the MLP shapes of the benchmark's models.

    python scripts/slab_gemm_timing.py            # on a CUDA GPU, bitsandbytes installed

For each weight shape (out, in) and slab bound it prints the median time of the
dequantise-and-multiply over 50 runs (CUDA events, after 10 warm-up runs), the slab
count and the largest transient 16-bit weight: what a slab bound costs in time against
what it saves in memory.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from slothkit_kernels.lora.gemms import _add_in_slabs
from slothkit_kernels.lora.projection import _base_weight
from slothkit_kernels.nf4.weight import NF4Weight


def median_ms(function, runs: int = 50, warmup: int = 10) -> float:
    for _ in range(warmup):
        function()
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        function()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    import bitsandbytes.functional as bnb_functional

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--bounds-mib", default="0,32,64")
    args = parser.parse_args()
    torch.manual_seed(0)
    dtype = torch.bfloat16
    shapes = [(4096, 14336), (14336, 4096), (3072, 24576), (24576, 3072)]
    print("| W (out, in) | bound MiB | slabs | largest slab MiB | ms (median of 50) |")
    print("| --- | --- | --- | --- | --- |")
    for out_f, in_f in shapes:
        dense = torch.randn(out_f, in_f, device="cuda", dtype=dtype) / in_f**0.5
        packed, state = bnb_functional.quantize_4bit(dense, quant_type="nf4", compress_statistics=True)
        weight = NF4Weight.from_bitsandbytes(packed, state)
        del dense
        dy = torch.randn(args.tokens, out_f, device="cuda", dtype=dtype)
        for bound in (int(b) for b in args.bounds_mib.split(",")):
            # 0: the whole weight at once.  The slabs are timed for every shape, also those
            # _backward_slabs leaves whole, to show why it does.
            slabs = (weight.column_slabs(bound * 2**20) if bound else None) or [(0, in_f)]
            widest = max(stop - start for start, stop in slabs)
            if len(slabs) == 1:
                run = lambda: dy @ _base_weight(weight, dtype)  # noqa: E731
            else:
                run = lambda: _add_in_slabs(None, dy, weight, slabs)  # noqa: E731
            ms = median_ms(run)
            print(
                f"| ({out_f}, {in_f}) | {bound or 'whole'} | {len(slabs)} | "
                f"{out_f * widest * 2 / 2**20:.0f} | {ms:.3f} |"
            )


if __name__ == "__main__":
    main()
