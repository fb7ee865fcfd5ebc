"""A decode step's expert products at a real layer's shape, on one CUDA GPU: each (token,
choice) pair's chosen expert through slothkit_kernels.moe.expert_gemv (read where it
lies, at a few tile sizes) against the gather and batched matmul of expert_gemv_reference,
for the gate/up and the down product, at batch 1 and 8, bf16.

    python3 scripts/moe_decode_timing.py [--shape qwen3-30b-a3b|gpt-oss-20b] [--batch 1,8]

Prints one Markdown row per (product, batch, path): microseconds (median of
triton.testing.do_bench, which clears the L2 cache between calls, so each call reads its
weights from memory as a decode step does), the GB/s of the distinct experts' bytes the
call needs at the least, and the largest difference from the reference's output.
"""

from __future__ import annotations

import argparse

import torch
from triton.testing import do_bench

from slothkit_kernels.moe.gemv import DEFAULT_TILES, expert_gemv, expert_gemv_reference

SHAPES = {  # hidden, intermediate, experts, top-k, weights stored (in, out)
    "qwen3-30b-a3b": (2048, 768, 128, 8, False),
    "gpt-oss-20b": (2880, 2880, 32, 4, True),
}
TILES = ((16, 256, 4), (32, 128, 4), (8, 512, 4), (32, 256, 8), (64, 128, 8))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    parser.add_argument("--batch", default="1,8")
    args = parser.parse_args()
    hidden, inter, experts, top_k, in_out = SHAPES[args.shape]
    torch.manual_seed(0)
    device, dtype = "cuda", torch.bfloat16
    gu_shape = (experts, hidden, 2 * inter) if in_out else (experts, 2 * inter, hidden)
    d_shape = (experts, inter, hidden) if in_out else (experts, hidden, inter)
    weights = {
        "gate_up": (torch.randn(gu_shape, device=device, dtype=dtype) * hidden**-0.5, hidden),
        "down": (torch.randn(d_shape, device=device, dtype=dtype) * inter**-0.5, inter),
    }
    print(f"{args.shape} on {torch.cuda.get_device_name()}, default tiles {DEFAULT_TILES}")
    print("| product | batch | path | us | GB/s of the distinct experts | max diff |")
    print("|---|---|---|---|---|---|")
    for batch in [int(b) for b in args.batch.split(",")]:
        logits = torch.randn(batch, experts, device=device)
        ids = torch.topk(logits, top_k, dim=-1).indices.reshape(-1)  # (P,)
        distinct = ids.unique().numel()
        for name, (weight, k) in weights.items():
            group = top_k if name == "gate_up" else 1
            x = torch.randn(batch * top_k // group, k, device=device, dtype=dtype)
            nbytes = distinct * weight[0].numel() * weight.element_size()
            gold = expert_gemv_reference(x, ids, weight, group, weights_in_out=in_out)
            paths = {
                "gather + bmm": lambda: expert_gemv_reference(x, ids, weight, group, weights_in_out=in_out)
            }
            for tiles in TILES:
                paths[f"expert_gemv {tiles}"] = lambda tiles=tiles: expert_gemv(
                    x, ids, weight, group, weights_in_out=in_out, tiles=tiles
                )
            for path, call in paths.items():
                diff = (call().float() - gold.float()).abs().max().item()
                us = do_bench(call, return_mode="median") * 1e3
                print(f"| {name} | {batch} | {path} | {us:.1f} | {nbytes / us / 1e3:.0f} | {diff:.2e} |")


if __name__ == "__main__":
    main()
