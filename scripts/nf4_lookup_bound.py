"""How much of the one-row NF4 GEMV's time its level lookup takes: ``nf4_lora_gemv``'s
CUDA-core candidates timed with each real lookup and with two stand-ins that give wrong
levels at a known cost, beside bitsandbytes' GEMV.

    shuffle     the lookup decode runs on CUDA cores (warp shuffles, level_lookup.py)
    registers   the byte-permute lookup
    shifts      stand-in: a code's level is 1 + code / 2^19, made by a shift and a mask
                (two integer instructions a code, no shuffle)
    no lookup   stand-in: every level is the packed word's own bits (no instruction a
                code; the codes are still loaded and multiplied)

The rest of the kernel (loads, scales, x, the multiply-adds, split K, the epilogue) is
the same in all four, so "no lookup" is what the loop costs without a lookup, and the
others say what each lookup adds.  If "no lookup" is far from the bandwidth, the lookup
is not what bounds the kernel.  Timed as the decode step's choice times (CUDA-graph
replays, the codes cycled through copies beyond twice the L2; gemv_choice), LoRA r = 16,
one row.  Without a GPU, ``--compile-only ARCH`` compiles every variant for that compute
capability and counts its main loop (scripts/cuda_sass.py).

    python scripts/nf4_lookup_bound.py --shape 14336,4096 --candidates 1,2,4,5 --output out.json
    python scripts/nf4_lookup_bound.py --compile-only 90 --shape 1024,4096
"""

from __future__ import annotations

import argparse
import json
import os
import sys

# cuda_sass sets TRITON_INTERPRET=0 before triton is imported; the GPU scripts run with
# PYTHONSAFEPATH, which leaves this folder off the path.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cuda_sass  # noqa: E402
import torch  # noqa: E402

from slothkit_kernels.nf4 import gemv as nf4_gemv  # noqa: E402
from slothkit_kernels.nf4 import level_lookup  # noqa: E402

VARIANTS = ("shuffle", "registers", "shifts", "no lookup")
RANK = 16


def stand_in_asm(variant: str) -> str:
    """PTX taking the 32-bit lookup's operands (level_lookup.operands(32)) that writes
    wrong levels at a known cost."""
    names = level_lookup.operands(32)
    word = f"${names.index(level_lookup.WORD)}"
    by_nibble = [f"${names.index(name)}" for name in level_lookup.nibble_outputs()]
    if variant == "no lookup":
        return "{\n" + "\n".join(f"mov.b32 {out}, {word};" for out in by_nibble) + "\n}"
    if variant == "shifts":  # ((word >> 4i) & 15) << 19 | 1.0f: shift, then one LOP3
        lines = [".reg .b32 %t;"]
        for i, out in enumerate(by_nibble):
            shift = 4 * i - 19
            move = f"shr.b32 %t, {word}, {shift};" if shift > 0 else f"shl.b32 %t, {word}, {-shift};"
            lines += [move, "and.b32 %t, %t, 0x00780000;", f"or.b32 {out}, %t, 0x3f800000;"]
        return "{\n" + "\n".join(lines) + "\n}"
    raise ValueError(f"no stand-in {variant!r}; stand-ins: shifts, no lookup")


def variant_launch(x, weight, xa, lora_b, out, candidate: int, variant: str):
    """``nf4_gemv.launch``'s tuple for a CUDA-core candidate with the variant's lookup."""
    if nf4_gemv.CANDIDATES[candidate][4] != "cuda cores":
        raise ValueError(f"candidate {candidate} runs on tensor cores; the stand-ins are 32-bit lookups")
    lookup = variant if variant in ("shuffle", "registers") else "shuffle"
    kernel, grid, arguments, constants = nf4_gemv.launch(
        x, weight, None, xa, lora_b, 2.0, out, candidate, lookup
    )
    if variant not in ("shuffle", "registers"):
        constants = {**constants, "LOOKUP_ASM": stand_in_asm(variant)}
    return kernel, grid, arguments, constants


def _compile_only(args, candidates) -> list[dict]:
    from triton.runtime import driver

    driver.set_active(cuda_sass.TargetOnly(args.compile_only))
    n, k = args.shape
    weight = cuda_sass.record(n, k, torch.bfloat16)
    x, xa = torch.randn(1, k, dtype=torch.bfloat16), torch.randn(1, RANK, dtype=torch.bfloat16)
    lora_b, out = torch.randn(n, RANK, dtype=torch.bfloat16), torch.empty(1, n, dtype=torch.bfloat16)
    results = []
    for candidate in candidates:
        for variant in VARIANTS:
            launch = variant_launch(x, weight, xa, lora_b, out, candidate, variant)
            results.append({"candidate": candidate, "variant": variant, **cuda_sass.compiled_loop(*launch)})
            r = results[-1]
            top = ", ".join(f"{op} {count}" for op, count in list(r["opcodes"].items())[:6])
            print(
                f"candidate {candidate} {variant:10} {r['instructions_per_weight']} instructions a weight ({top})"
            )
    return results


def _timed(args, candidates) -> list[dict]:
    from decode_gemv_sweep import _nf4_layer  # this folder is on the path (above)

    from slothkit.engine.lora_projection import base_weight
    from slothkit.inference import gemv_choice
    from slothkit.inference.decode_projections import _nf4_base_output

    n, k = args.shape
    layer = _nf4_layer(n, k)  # as QLoRA loads it: double quantisation, blocks of 64
    weight = base_weight(layer)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)

    x, xa, lora_b, out = randn(1, k), randn(1, RANK), randn(n, RANK) * 0.01, randn(1, n)
    copies = gemv_choice._copies(
        weight, weight.packed.numel(), lambda: weight.with_packed(weight.packed.clone()), x.device
    )
    nbytes = weight.packed.numel() + n * k // weight.blocksize  # codes and one byte a block scale
    results = [{"candidate": None, "variant": "bitsandbytes"}]
    results[0]["us"] = 1e3 * gemv_choice._graph_ms(lambda w: _nf4_base_output(layer, x, w, None), copies)
    for candidate in candidates:
        for variant in VARIANTS:
            launches = {id(w): variant_launch(x, w, xa, lora_b, out, candidate, variant) for w in copies}

            def call(w, launches=launches):
                kernel, grid, arguments, constants = launches[id(w)]
                kernel[grid](*arguments, **constants)

            results.append(
                {"candidate": candidate, "variant": variant, "us": 1e3 * gemv_choice._graph_ms(call, copies)}
            )
    for r in results:
        r["gb_per_s"] = nbytes / r["us"] / 1e3
        print(f"candidate {r['candidate']} {r['variant']:12} {r['us']:7.1f} us {r['gb_per_s']:6.0f} GB/s")
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="14336,4096", help="N,K of the weight")
    parser.add_argument("--candidates", help="CUDA-core indices into nf4_gemv.CANDIDATES; all by default")
    parser.add_argument(
        "--compile-only", type=int, metavar="ARCH", help="count loops for this compute capability"
    )
    parser.add_argument("--output", help="JSON file for the figures")
    args = parser.parse_args(argv)
    args.shape = tuple(int(v) for v in args.shape.split(","))
    cuda_cores = [c for c, tile in enumerate(nf4_gemv.CANDIDATES) if tile[4] == "cuda cores"]
    candidates = [int(c) for c in args.candidates.split(",")] if args.candidates else cuda_cores
    with torch.no_grad():
        results = _compile_only(args, candidates) if args.compile_only else _timed(args, candidates)
    if args.output:
        setting = {"shape": list(args.shape), "rows": 1, "rank": RANK, "compile_only": args.compile_only}
        if not args.compile_only:
            setting["gpu"] = torch.cuda.get_device_name()
        with open(args.output, "w") as f:
            json.dump({"setting": setting, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
