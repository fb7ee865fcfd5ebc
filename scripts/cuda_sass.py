"""Compile a decode GEMV (nf4_lora_gemv, or the 16-bit lora_gemv) for a CUDA GPU on a
machine without one, and count the machine instructions of its main loop: what a weight
costs in each tile, multiplier and lookup (slothkit_kernels/nf4/level_lookup.py).

Triton compiles for any target it is told (its ptxas and cuobjdump ship with it); only
launching needs the GPU.  So the kernel is compiled through the op's ``launch`` (the
arguments and constexprs it launches with, on CPU tensors of the shape) under a
stand-in driver that names the target, and ``cuobjdump -sass`` disassembles the cubin.
The main loop is the longest backward branch's body; instructions per weight are its
length over the weights a thread reads per iteration (BLOCK_N * BLOCK_K * STEPS / threads).
Counts, not timings: a GPU says what they cost (scripts/decode_gemv_sweep.py).

    python scripts/cuda_sass.py --shape 4096,4096 --rows 1,8 --arch 90 [--json out.json]
    python scripts/cuda_sass.py --op lora_gemv --rows 1,8
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile

os.environ["TRITON_INTERPRET"] = "0"  # compile, never interpret: before triton is imported

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402

from slothkit_kernels.lora.gemv import CANDIDATES as DENSE_CANDIDATES  # noqa: E402
from slothkit_kernels.lora.gemv import launch as dense_launch  # noqa: E402
from slothkit_kernels.nf4 import gemv as nf4_gemv  # noqa: E402
from slothkit_kernels.nf4.weight import NF4Weight  # noqa: E402

INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)[^;]*;")
BRANCH_TARGET = re.compile(r"BRA\s+(?:`\(\.L_x_\d+\)|0x([0-9a-f]+))")


class TargetOnly:
    """The parts of a Triton driver that compiling (not launching) asks for."""

    def __init__(self, arch: int):
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


def disassemble(cubin: bytes) -> tuple[str, int]:
    """The SASS of a cubin and the registers a thread uses."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        run = subprocess.run(
            [tool, "-sass", "-res-usage", f.name], check=True, capture_output=True, text=True
        )
    return run.stdout, int(re.search(r"REG:(\d+)", run.stdout).group(1))


def main_loop(sass: str) -> list[str]:
    """Opcodes of the longest loop: from a backward branch's target to the branch."""
    lines = [(int(m.group(1), 16), m.group(3), m.group(0)) for m in INSTRUCTION.finditer(sass)]
    labels = {}  # cuobjdump names targets as `(.L_x_N): find them by the label lines
    for match in re.finditer(r"\.L_x_(\d+):\s*\n\s*/\*([0-9a-f]{4,})\*/", sass):
        labels[match.group(1)] = int(match.group(2), 16)
    best: list[str] = []
    for address, opcode, text in lines:
        if opcode != "BRA":
            continue
        label = re.search(r"\.L_x_(\d+)", text)
        literal = re.search(r"BRA\s+0x([0-9a-f]+)", text)
        target = labels.get(label.group(1)) if label else int(literal.group(1), 16) if literal else None
        if target is not None and target < address:
            body = [op for a, op, _ in lines if target <= a <= address]
            best = max(best, body, key=len)
    return best


def record(n: int, k: int, dtype: torch.dtype, blocksize: int = 64) -> NF4Weight:
    """A CPU NF4 record of shape (n, k) dequantising to ``dtype``: values do not matter
    to the compiler."""
    packed = torch.randint(0, 256, (n * k // 2,), dtype=torch.uint8)
    absmax = torch.rand(n * k // blocksize)
    code = torch.linspace(-1.0, 1.0, 16)
    return NF4Weight(packed, absmax, code, blocksize, torch.Size((n, k)), dtype)


def loop_counts(weight, rows: int, candidate: int, lookup: str | None, rank: int = 16) -> dict:
    """The main loop of nf4_lora_gemv (``weight`` an NF4Weight) or lora_gemv (a tensor;
    ``lookup`` None) for ``rows`` rows of x and a LoRA adapter of ``rank``."""
    n, k = weight.shape
    x = torch.randn(rows, k, dtype=weight.dtype)
    xa = torch.randn(rows, rank, dtype=weight.dtype) if rank else None
    lora_b = torch.randn(n, rank, dtype=weight.dtype) if rank else None
    out = torch.empty(rows, n, dtype=weight.dtype)
    if lookup is None:
        kernel, grid, arguments, constants = dense_launch(x, weight, None, xa, lora_b, 1.0, out, candidate)
        multiplier = "tensor cores" if DENSE_CANDIDATES[candidate][4] else "cuda cores"
    else:
        kernel, grid, arguments, constants = nf4_gemv.launch(
            x, weight, None, xa, lora_b, 1.0, out, candidate, lookup
        )
        multiplier = nf4_gemv.CANDIDATES[candidate][4]
    return {
        "candidate": candidate,
        "multiplier": multiplier,
        "rows": rows,
        "lookup": lookup,
        **compiled_loop(kernel, grid, arguments, constants),
    }


def compiled_loop(kernel, grid, arguments, constants) -> dict:
    """Compile one GEMV launch (an op's ``launch`` tuple) for the active target and count
    its main loop: in all and per weight a thread reads in an iteration."""
    compiled = kernel.warmup(*arguments, grid=grid, **constants)
    sass, registers = disassemble(compiled.asm["cubin"])
    loop = main_loop(sass)
    threads = 32 * constants["num_warps"]
    # Weights per thread per iteration (a CUDA-core NF4 loop takes STEPS steps of BLOCK_K).
    weights = constants["BLOCK_N"] * constants["BLOCK_K"] * constants.get("STEPS", 1) / threads
    return {
        "block": [constants["BLOCK_M"], constants["BLOCK_N"], constants["BLOCK_K"]],
        "steps": constants.get("STEPS", 1),
        "warps": constants["num_warps"],
        "registers": registers,
        "loop_instructions": len(loop),
        "instructions_per_weight": round(len(loop) / weights, 2),
        "opcodes": dict(collections.Counter(loop).most_common()),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--op", default="nf4_lora_gemv", choices=["nf4_lora_gemv", "lora_gemv"])
    parser.add_argument("--shape", default="4096,4096", help="N,K of the weight")
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--candidates", help="indices into the op's CANDIDATES; all by default")
    parser.add_argument(
        "--lookups", default="registers,shuffle,table", help="nf4_lora_gemv's (nf4_gemv.LOOKUPS)"
    )
    parser.add_argument("--arch", type=int, default=90, help="compute capability: 90 H100/H200, 75 T4")
    parser.add_argument(
        "--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"], help="of x and the weight"
    )
    parser.add_argument("--json", help="write the counts here")
    args = parser.parse_args(argv)
    n, k = (int(v) for v in args.shape.split(","))
    dense = args.op == "lora_gemv"
    dtype = getattr(torch, args.dtype)
    weight = torch.randn(n, k, dtype=dtype) if dense else record(n, k, dtype)
    every = range(len(DENSE_CANDIDATES if dense else nf4_gemv.CANDIDATES))
    candidates = [int(c) for c in args.candidates.split(",")] if args.candidates else list(every)
    if not dense and dtype == torch.float32:  # nf4_lora_gemv's tensor-core tiles refuse fp32
        candidates = [c for c in candidates if nf4_gemv.CANDIDATES[c][4] == "cuda cores"]
    lookups = [None] if dense else args.lookups.split(",")
    driver.set_active(TargetOnly(args.arch))
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        for candidate in candidates:
            for lookup in lookups:
                results.append(loop_counts(weight, rows, candidate, lookup))
                r = results[-1]
                top = ", ".join(f"{op} {count}" for op, count in list(r["opcodes"].items())[:6])
                print(f"rows {rows} candidate {candidate} ({r['multiplier']}) {lookup or '':9} block {r['block']} warps {r['warps']}: "
                      f"{r['loop_instructions']} instructions a loop, {r['instructions_per_weight']} a weight, "
                      f"{r['registers']} registers ({top})", flush=True)  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"arch": args.arch, "shape": [n, k], "triton": triton.__version__, "results": results},
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
