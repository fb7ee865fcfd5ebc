"""Forward + backward of slothkit_kernels.moe.moe_lora_experts at a real layer's shape, with
16-bit experts and with NF4 experts under several tile settings, on one CUDA GPU.

    python3 scripts/moe_nf4_timing.py [--shape qwen3-30b-a3b|gpt-oss-20b] [--tokens 4096]

Prints one line per setting: milliseconds (median of triton.testing.do_bench) and the
largest difference of the output from the 16-bit experts' run on the same dequantised
weights.  The tile settings are tried by replacing grouped_gemm.tile_sizes for the run;
a setting that needs more shared memory than the GPU has is reported as such.
"""

from __future__ import annotations

import argparse

import torch
from triton.testing import do_bench

from slothkit_kernels.moe import ExpertLoRA, grouped_gemm, moe_lora_experts
from slothkit_kernels.moe.nf4_quantize import quantize_nf4_experts

SHAPES = {  # hidden, intermediate, experts, top-k, activation, weights stored (in, out)
    "qwen3-30b-a3b": (2048, 768, 128, 8, "swiglu", False),
    "gpt-oss-20b": (2880, 2880, 32, 4, "gpt_oss", True),
}
NF4_SETTINGS = [  # BLOCK_N, BLOCK_K, warps, stages
    (128, 64, 8, 1),
    (64, 64, 4, 1),
    (128, 64, 4, 1),
    (64, 64, 4, 2),
    (128, 32, 8, 2),
    (256, 64, 8, 1),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument(
        "--setting",
        type=int,
        action="append",
        help="index into NF4_SETTINGS to try (repeatable; default all). A CUDA fault poisons the "
        "process, so to see each setting's own result run them one per process",
    )
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

    reference = step(dequantised).detach()
    print(f"| {args.shape}, {args.tokens} tokens, r={r} | ms fwd+bwd | max |out - 16-bit| |")
    print("|---|---|---|")
    print(f"| 16-bit experts | {do_bench(lambda: step(dequantised), warmup=25, rep=100):.2f} | 0 |")
    original = grouped_gemm.tile_sizes
    chosen = [NF4_SETTINGS[i] for i in args.setting] if args.setting else NF4_SETTINGS
    for block_n, block_k, warps, stages in chosen:
        setting = {
            "BLOCK_M": 64,
            "BLOCK_N": block_n,
            "BLOCK_K": block_k,
            "num_warps": warps,
            "num_stages": stages,
        }

        def sizes(dtype, nf4=False, setting=setting):
            return dict(setting) if nf4 else original(dtype)

        grouped_gemm.tile_sizes = sizes
        name = f"NF4 N{block_n} K{block_k} w{warps} s{stages}"
        try:
            difference = (step(nf4).detach().float() - reference.float()).abs().max().item()
            ms = do_bench(lambda: step(nf4), warmup=25, rep=100)
            print(f"| {name} | {ms:.2f} | {difference:.3g} |")
        except Exception as error:  # noqa: BLE001 - a setting that does not fit is a result
            print(f"| {name} | {type(error).__name__}: {str(error)[:80]} | - |")
        finally:
            grouped_gemm.tile_sizes = original


if __name__ == "__main__":
    main()
