"""Sweep the NF4 dequantisation kernel's launch settings on the GPU.

For each weight shape of the benchmark models, prints the median time of one
dequantisation (replayed from a CUDA graph, as training runs it) per
(ELEMENTS_PER_PROGRAM, NUM_WARPS), and its bandwidth against two floors measured on
the same buffers: a device-to-device copy and a fill of the bf16 output (the
kernel reads 0.5 byte and writes 2 per element, so the fill is its bound).

    python scripts/tune_nf4.py
"""

import importlib

import torch
import triton.testing

from slothkit_kernels.nf4_weight import NF4Weight

nf4 = importlib.import_module("slothkit_kernels.nf4")

SHAPES = {  # (out, in) of the largest and the most frequent weights
    "llama/mistral gate, up": (14336, 4096),
    "llama/mistral down": (4096, 14336),
    "llama q, o": (4096, 4096),
    "llama k, v": (1024, 4096),
    "gemma gate, up": (24576, 3072),
}


def graphed(fn):
    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")


def random_nf4(shape) -> NF4Weight:
    import bitsandbytes.functional as bnbf

    w = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    packed, state = bnbf.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
    return NF4Weight.from_bitsandbytes(packed, state)


def main():
    chosen = nf4.ELEMENTS_PER_PROGRAM, nf4.NUM_WARPS
    for name, shape in SHAPES.items():
        weight = random_nf4(shape)
        out = torch.empty(shape, device="cuda", dtype=torch.bfloat16)
        src = torch.empty_like(out)
        nbytes = out.numel() * 2.5  # 0.5 byte in, 2 bytes out
        fill_ms = graphed(lambda: out.fill_(1.0))
        copy_ms = graphed(lambda: out.copy_(src))
        print(f"{name} {shape}: fill {fill_ms * 1e3:.1f} us ({out.numel() * 2 / fill_ms / 1e6:.0f} GB/s), "
              f"copy {copy_ms * 1e3:.1f} us ({out.numel() * 4 / copy_ms / 1e6:.0f} GB/s)")
        reference = nf4.dequantize_nf4(weight)
        for elements in (2048, 4096, 8192, 16384, 32768):
            for warps in (2, 4, 8, 16):
                nf4.ELEMENTS_PER_PROGRAM, nf4.NUM_WARPS = elements, warps
                result = nf4.dequantize_nf4(weight, out=out)
                assert torch.equal(result, reference), (elements, warps)
                ms = graphed(lambda: nf4.dequantize_nf4(weight, out=out))
                mark = "  (the kernel's setting)" if (elements, warps) == chosen else ""
                print(f"  elements={elements:5d} warps={warps:2d}: {ms * 1e3:6.1f} us "
                      f"{nbytes / ms / 1e6:6.0f} GB/s, {fill_ms / ms * 100:5.1f}% of the fill's time{mark}")
        nf4.ELEMENTS_PER_PROGRAM, nf4.NUM_WARPS = chosen


if __name__ == "__main__":
    main()
