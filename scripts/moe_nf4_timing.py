"""Forward + backward of slothkit_kernels.moe.moe_lora_experts at a real layer's shape, with
16-bit experts and with NF4 experts at several sizes of the dequantised run, on one CUDA
GPU; the same two through the torch._grouped_mm backend (slothkit_kernels/moe/grouped_mm.py); and the dequantisation of all experts alone.

    python3 scripts/moe_nf4_timing.py [--shape qwen3-30b-a3b|gpt-oss-20b] [--tokens 4096]

Prints one line per setting: milliseconds (median of triton.testing.do_bench), the peak
memory the step allocated beyond what was held before it, and the largest difference of
the output from the 16-bit experts' run on the same dequantised weights (0: the NF4 path
multiplies the same 16-bit values with the same kernel).
"""

from __future__ import annotations

import argparse

import torch
from triton.testing import do_bench

import slothkit_kernels.moe.grouped_gemm as grouped_gemm
from slothkit_kernels.moe import ExpertLoRA, dequantize_nf4_experts, moe_lora_experts
from slothkit_kernels.moe.grouped_mm import set_backend
from slothkit_kernels.moe.nf4_quantize import quantize_nf4_experts

SHAPES = {  # hidden, intermediate, experts, top-k, activation, weights stored (in, out)
    "qwen3-30b-a3b": (2048, 768, 128, 8, "swiglu", False),
    "gpt-oss-20b": (2880, 2880, 32, 4, "gpt_oss", True),
}
STAGE_MIB = (128, 256, 512, 1024, 4096)  # sizes of the dequantised run tried, MiB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()
    hidden, inter, experts, top_k, activation, in_out = SHAPES[args.shape]
    torch.manual_seed(0)
    device, dtype = "cuda", torch.bfloat16
    gu_shape = (experts, hidden, 2 * inter) if in_out else (experts, 2 * inter, hidden)
    d_shape = (experts, inter, hidden) if in_out else (experts, hidden, inter)
    gate_up = torch.randn(gu_shape, device=device, dtype=dtype) * hidden**-0.5
    down = torch.randn(d_shape, device=device, dtype=dtype) * inter**-0.5
    nf4 = (quantize_nf4_experts(gate_up), quantize_nf4_experts(down))
    dequantised = tuple(w.dequantize() for w in nf4)
    r = args.rank

    def lora(inp: int, out: int) -> ExpertLoRA:
        a = (torch.randn(experts, r, inp, device=device) * inp**-0.5).requires_grad_()
        b = (torch.randn(experts, out, r, device=device) * 0.01).requires_grad_()
        return ExpertLoRA(a, b, 2.0)

    gu_lora, d_lora = lora(hidden, 2 * inter), lora(inter, hidden)
    x = torch.randn(args.tokens, hidden, device=device, dtype=dtype, requires_grad=True)
    logits = torch.randn(args.tokens, experts, device=device)
    weights, ids = torch.topk(logits.softmax(-1), top_k, dim=-1)
    weights = weights.requires_grad_()
    grad = torch.randn(args.tokens, hidden, device=device, dtype=dtype)
    options = dict(gate_up_lora=gu_lora, down_lora=d_lora, activation=activation, weights_in_out=in_out)

    def step(weights_pair):
        out = moe_lora_experts(x, ids, weights, *weights_pair, **options)
        out.backward(grad)
        return out

    def timed(name, run):
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = run()
        torch.cuda.synchronize()
        extra = (torch.cuda.max_memory_allocated() - held) / 2**20
        difference = 0.0 if out is None else (out.detach().float() - reference.float()).abs().max().item()
        ms = do_bench(run, warmup=25, rep=100)
        print(f"| {name} | {ms:.2f} | {extra:,.0f} | {difference:.3g} |")

    reference = step(dequantised).detach()
    print(f"| {args.shape}, {args.tokens} tokens, r={r} | ms | peak MiB beyond held | max |out - 16-bit| |")
    print("|---|---|---|---|")
    timed("16-bit experts, fwd+bwd", lambda: step(dequantised))
    default = grouped_gemm.NF4_STAGE_BYTES
    for mib in STAGE_MIB:
        grouped_gemm.NF4_STAGE_BYTES = mib * 2**20
        marker = " (default)" if mib * 2**20 == default else ""
        timed(f"NF4 experts, runs of <= {mib} MiB{marker}, fwd+bwd", lambda: step(nf4))
    grouped_gemm.NF4_STAGE_BYTES = default
    set_backend("grouped_mm")
    timed("16-bit experts, torch._grouped_mm backend, fwd+bwd", lambda: step(dequantised))
    timed("NF4 experts, torch._grouped_mm backend, fwd+bwd", lambda: step(nf4))
    set_backend("triton")
    timed(
        "dequantise all experts (gate_up + down), once",
        lambda: [dequantize_nf4_experts(w) for w in nf4] and None,
    )


if __name__ == "__main__":
    main()
