"""Sweep launch settings of the memory-bound kernels on the GPU.

Prints, per setting, the median time and the share of the device-to-device copy
bandwidth (bytes read + written, measured here).  Used to pick the constants in
slothkit_kernels/rms_norm.py, slothkit_kernels/swiglu.py and slothkit_kernels/rope/kernel.py; the numbers go to
docs/kernel-benchmarks.md.

    python scripts/tune_kernels.py            # everything but nf4
    python scripts/tune_kernels.py rms_norm   # the RMSNorm backward only
    python scripts/tune_kernels.py nf4        # the NF4 dequantisation (slothkit_kernels/nf4/dequantize.py) only

The NF4 sweep times one dequantisation replayed from a CUDA graph, as training runs it,
per (ELEMENTS_PER_PROGRAM, NUM_WARPS), against a plain fill of the bf16 output: the
kernel reads 0.5 byte and writes 2 per element, so the fill is its bound.  It needs
bitsandbytes (to quantise the weights).
"""

import importlib

import torch
import triton.testing

# import_module, not `import slothkit_kernels.rms_norm as ...`: the package exports
# functions named like their modules, and `import a.b as m` binds the attribute a.b.
geglu_mod = importlib.import_module("slothkit_kernels.geglu")
rms_mod = importlib.import_module("slothkit_kernels.rms_norm")
rope_mod = importlib.import_module("slothkit_kernels.rope.kernel")
swiglu_mod = importlib.import_module("slothkit_kernels.swiglu")
nf4_mod = importlib.import_module("slothkit_kernels.nf4.dequantize")

NF4_SHAPES = {  # (out, in) of the largest and the most frequent weights
    "llama/mistral gate, up": (14336, 4096),
    "llama/mistral down": (4096, 14336),
    "llama q, o": (4096, 4096),
    "llama k, v": (1024, 4096),
    "gemma gate, up": (24576, 3072),
}


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def bench_graph(fn):
    """Time replays of a CUDA graph of fn: no Python or launch overhead in the figure."""
    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")


class _SavedContext:
    """Stands in for autograd's ctx so a backward can be called (and graphed) directly."""

    def __init__(self, saved, needs, **attrs):
        self.saved_tensors = saved
        self.needs_input_grad = needs
        self.__dict__.update(attrs)


def copy_bandwidth():
    a = torch.empty(2**29, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = bench(lambda: b.copy_(a))
    return 2 * a.numel() / ms / 1e6  # GB/s


def tune_nf4():
    from slothkit.bench.kernel_cases import _nf4_inputs

    chosen = nf4_mod.ELEMENTS_PER_PROGRAM, nf4_mod.NUM_WARPS
    for name, shape in NF4_SHAPES.items():
        weight = _nf4_inputs(*shape, torch.bfloat16, "cuda")["weight"]
        out = torch.empty(shape, device="cuda", dtype=torch.bfloat16)
        src = torch.empty_like(out)
        nbytes = out.numel() * 2.5  # 0.5 byte in, 2 bytes out
        fill_ms = bench_graph(lambda: out.fill_(1.0))
        copy_ms = bench_graph(lambda: out.copy_(src))
        print(
            f"{name} {shape}: fill {fill_ms * 1e3:.1f} us ({out.numel() * 2 / fill_ms / 1e6:.0f} GB/s), "
            f"copy {copy_ms * 1e3:.1f} us ({out.numel() * 4 / copy_ms / 1e6:.0f} GB/s)"
        )
        reference = nf4_mod.dequantize_nf4(weight)
        for elements in (2048, 4096, 8192, 16384, 32768):
            for warps in (2, 4, 8, 16):
                nf4_mod.ELEMENTS_PER_PROGRAM, nf4_mod.NUM_WARPS = elements, warps
                assert torch.equal(nf4_mod.dequantize_nf4(weight, out=out), reference), (elements, warps)
                ms = bench_graph(lambda: nf4_mod.dequantize_nf4(weight, out=out))
                mark = "  (the kernel's setting)" if (elements, warps) == chosen else ""
                print(
                    f"  elements={elements:5d} warps={warps:2d}: {ms * 1e3:6.1f} us "
                    f"{nbytes / ms / 1e6:6.0f} GB/s, {fill_ms / ms * 100:5.1f}% of the fill's time{mark}"
                )
        nf4_mod.ELEMENTS_PER_PROGRAM, nf4_mod.NUM_WARPS = chosen


def main(only=None):
    if only == "nf4":
        tune_nf4()
        return
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw:.0f} GB/s")

    # RMSNorm backward (dx and dw), bf16.
    for rows, h in [(16384, 4096), (8192, 3072)]:
        x = torch.randn(rows, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn_like(x)
        y = rms_mod.rms_norm(x, w)
        nbytes = 3 * x.numel() * 2  # read x, dy; write dx (dw is H-sized)
        for tile in (4096, 8192, 16384, 32768):
            for per_sm in (1, 2, 4, 8):
                for warps in (8, 16):
                    rms_mod.BACKWARD_PROGRAMS_PER_SM, rms_mod.BACKWARD_NUM_WARPS = per_sm, warps
                    rms_mod.BACKWARD_TILE_ELEMENTS = tile
                    ms = bench(lambda: torch.autograd.grad(y, (x, w), dy, retain_graph=True))
                    node = y.grad_fn
                    while "RMSNorm" not in type(node).__name__:
                        node = node.next_functions[0][0]
                    ctx = _SavedContext(node.saved_tensors, (True, True), gemma=False, x_shape=x.shape)
                    ms_graph = bench_graph(lambda: rms_mod._RMSNormFunction.backward(ctx, dy))
                    print(
                        f"rms_norm bwd {rows}x{h} tile={tile:5d} per_sm={per_sm:2d} "
                        f"warps={warps:2d}: {ms * 1e3:7.1f} us {nbytes / ms / 1e6 / bw * 100:5.1f}% copy; "
                        f"graphed {ms_graph * 1e3:7.1f} us {nbytes / ms_graph / 1e6 / bw * 100:5.1f}% copy"
                    )
    rms_mod.BACKWARD_PROGRAMS_PER_SM, rms_mod.BACKWARD_NUM_WARPS = 1, 16
    rms_mod.BACKWARD_TILE_ELEMENTS = 16384

    # RMSNorm backward with a frozen weight (dx only), as every LoRA run calls it.
    for rows, h in [(4096, 4096), (16384, 4096), (4096, 3072), (16384, 3072)]:
        x = torch.randn(rows, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(h, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn_like(x)
        y = rms_mod.rms_norm(x, w)
        nbytes = 3 * x.numel() * 2  # read x, dy; write dx
        node = y.grad_fn
        while "RMSNorm" not in type(node).__name__:
            node = node.next_functions[0][0]
        ctx = _SavedContext(node.saved_tensors, (True, False), gemma=False, x_shape=x.shape)
        for tile in (4096, 8192, 16384):
            for tiles_per_program in (1, 2, 4):
                for warps in (4, 8, 16):
                    rms_mod.BACKWARD_TILE_ELEMENTS_NO_DW = tile
                    rms_mod.BACKWARD_TILES_PER_PROGRAM_NO_DW = tiles_per_program
                    rms_mod.BACKWARD_NUM_WARPS_NO_DW = warps
                    ms = bench_graph(lambda: rms_mod._RMSNormFunction.backward(ctx, dy))
                    print(
                        f"rms_norm bwd no-dw {rows}x{h} tile={tile:5d} tiles/program="
                        f"{tiles_per_program} warps={warps:2d}: {ms * 1e3:7.1f} us "
                        f"{nbytes / ms / 1e6 / bw * 100:5.1f}% copy (graphed)"
                    )
    rms_mod.BACKWARD_TILE_ELEMENTS_NO_DW = 4096
    rms_mod.BACKWARD_TILES_PER_PROGRAM_NO_DW, rms_mod.BACKWARD_NUM_WARPS_NO_DW = 1, 8
    if only == "rms_norm":
        return

    # SwiGLU / GeGLU backward: read dh, e, g; write h, de, dg.
    n = 16384 * 14336
    dh, e, g = (torch.randn(n, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for name, mod, fn in (
        ("swiglu", swiglu_mod, lambda: swiglu_mod.swiglu_backward(dh, e, g)),
        ("geglu", geglu_mod, lambda: geglu_mod.geglu_backward(dh, e, g)),
    ):
        for block in (1024, 2048, 4096, 8192):
            for warps in (4, 8, 16):
                mod.BLOCK_SIZE, mod.NUM_WARPS = block, warps
                ms = bench(fn)
                print(
                    f"{name} bwd block={block:5d} warps={warps:2d}: {ms * 1e3:7.1f} us "
                    f"{6 * n * 2 / ms / 1e6 / bw * 100:5.1f}% copy"
                )
        mod.BLOCK_SIZE, mod.NUM_WARPS = 1024, 4

    # RoPE backward on one gradient (q-shaped), as autograd calls it.
    b, hq, t, d = 2, 32, 4096, 128
    grad = torch.randn(b, hq, t, d, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(grad)
    pos = torch.arange(t, device="cuda")
    inv = 1.0 / (500000 ** (torch.arange(0, d, 2, device="cuda").float() / d))
    freqs = torch.cat([pos[:, None] * inv, pos[:, None] * inv], -1)
    cos, sin = freqs.cos()[None].bfloat16(), freqs.sin()[None].bfloat16()
    for tile in (512, 1024, 2048, 4096):
        for warps in (2, 4, 8):
            rope_mod.MAX_TILE, rope_mod.NUM_WARPS = tile, warps
            ms = bench(lambda: rope_mod._launch(grad, out, None, None, cos, sin, None, inverse=True))
            print(
                f"rope bwd q tile={tile:5d} warps={warps}: {ms * 1e3:7.1f} us "
                f"{2 * grad.numel() * 2 / ms / 1e6 / bw * 100:5.1f}% copy"
            )


if __name__ == "__main__":
    import sys

    main(sys.argv[1] if len(sys.argv) > 1 else None)
