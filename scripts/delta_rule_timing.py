"""slothkit's chunked gated delta rule (slothkit_kernels.delta_rule) against transformers'
pure-torch torch_chunk_gated_delta_rule, which Qwen3.5's layers run where
flash-linear-attention does not, on one CUDA GPU.

    python3 scripts/delta_rule_timing.py [--batch 1] [--tokens 2048] [--k-heads 16] [--v-heads 32]

Inputs as Qwen3.5's layer gives them (bf16 q, k, v, fp32 g, bf16 beta; head dims 128;
q and k l2-normalised inside).  Prints a table: milliseconds (median of
triton.testing.do_bench) of the forward and of forward + backward, and the largest
relative difference of slothkit's output from transformers'.
"""

from __future__ import annotations

import argparse

import torch
from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule
from triton.testing import do_bench

from slothkit_kernels.delta_rule import gated_delta_rule


def _inputs(batch, tokens, k_heads, v_heads, dim):
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    q = torch.randn(batch, tokens, k_heads, dim, **bf16)
    k = torch.randn(batch, tokens, k_heads, dim, **bf16)
    v = torch.randn(batch, tokens, v_heads, dim, **bf16)
    g = -torch.nn.functional.softplus(torch.randn(batch, tokens, v_heads, device="cuda")) * 2
    beta = torch.rand(batch, tokens, v_heads, **bf16)
    return [x.requires_grad_() for x in (q, k, v, g, beta)]


def _timings(fn, inputs):
    def forward():
        return fn(*inputs, use_qk_l2norm_in_kernel=True)[0]

    d_output = torch.randn_like(forward())

    def forward_backward():
        torch.autograd.grad(forward(), inputs, d_output)

    with torch.no_grad():
        forward_ms = do_bench(forward)
    return forward_ms, do_bench(forward_backward), forward().detach()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--k-heads", type=int, default=16)
    parser.add_argument("--v-heads", type=int, default=32)
    parser.add_argument("--dim", type=int, default=128)
    args = parser.parse_args()
    torch.manual_seed(0)
    inputs = _inputs(args.batch, args.tokens, args.k_heads, args.v_heads, args.dim)
    rows = [(name, *_timings(fn, inputs)) for name, fn in (
        ("slothkit gated_delta_rule", gated_delta_rule),
        ("transformers torch_chunk_gated_delta_rule", torch_chunk_gated_delta_rule),
    )]  # fmt: skip
    reference = rows[1][3].float()
    print(
        f"{torch.cuda.get_device_name()}: B={args.batch} T={args.tokens} heads {args.k_heads}->{args.v_heads} "
        f"dk=dv={args.dim} bf16"
    )
    print("| implementation | forward ms | forward+backward ms | output vs transformers |")
    print("|---|---|---|---|")
    for name, forward_ms, both_ms, output in rows:
        difference = ((output.float() - reference).norm() / reference.norm()).item()
        print(f"| {name} | {forward_ms:.3f} | {both_ms:.3f} | {difference:.1e} |")


if __name__ == "__main__":
    main()
