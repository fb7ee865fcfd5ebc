"""grouped_lora_gemm and expert_sums alone, against loops over experts in float64."""

import math

import pytest
import torch

from slothkit_kernels.moe import ExpertLoRA, grouped_lora_gemm, grouped_lora_gemm_reference, route_to_experts
from slothkit_kernels.moe.expert_sums import expert_sums
from slothkit_kernels.moe.grouped_gemm import tile_sizes
from slothkit_kernels.testing import relative_error

# One product of length K <= 45 and a rank-r one, each rounding like sqrt(K) u in norm
# (u = 2^-24); 16 times that leaves room for the bias and the accumulation order.
FP32_RTOL = 16 * math.sqrt(45) * 2.0**-24  # about 6e-6


def _routing(tokens, top_k, experts, used, gen, device, dtype=torch.float32):
    ids = torch.stack([torch.randperm(used, generator=gen)[:top_k] for _ in range(tokens)]).to(device)
    return route_to_experts(ids, experts, tile_sizes(dtype)["BLOCK_M"])


@pytest.mark.parametrize("layout", ["out_in", "in_out"])
@pytest.mark.parametrize("gather", [True, False])
@pytest.mark.parametrize("lora,bias", [(False, False), (True, False), (True, True)])
def test_grouped_lora_gemm_matches_loop(layout, gather, lora, bias, device):
    gen = torch.Generator().manual_seed(11)
    tokens, top_k, experts, n, k, r = 17, 2, 5, 29, 45, 3
    routing = _routing(tokens, top_k, experts, used=4, gen=gen, device=device)  # expert 4 idle
    m = routing.num_rows

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(device)

    x = randn(tokens if gather else m, k)
    stored = randn(experts, n, k) if layout == "out_in" else randn(experts, k, n)
    weight = stored if layout == "out_in" else stored.transpose(1, 2)  # logical (E, N, K) view
    adapter = None
    if lora:
        # B as a non-contiguous view, as of PEFT's (out, r * E) parameter.
        adapter = ExpertLoRA(randn(experts, r, k), randn(n, r, experts).permute(2, 0, 1), 0.7)
    b = randn(experts, n) if bias else None

    def as32(t):
        return None if t is None else t.float()

    lora32 = None if adapter is None else ExpertLoRA(as32(adapter.A), as32(adapter.B), adapter.scale)
    y, xa = grouped_lora_gemm(as32(x), routing, as32(weight), lora32, as32(b), gather=gather, store_xa=True)
    gold = grouped_lora_gemm_reference(x, routing, weight, adapter, b, gather=gather)
    assert y.shape == (m, n) and y.dtype == torch.float32
    assert relative_error(y, gold) < FP32_RTOL
    if lora:
        rows = x[routing.tokens.long()] if gather else x
        xa_gold = torch.einsum("mk,mrk->mr", rows, adapter.A[routing.row_expert.long()])
        assert relative_error(xa, xa_gold) < FP32_RTOL
    else:
        assert xa is None


def test_grouped_lora_gemm_transposed_adapter_is_the_backward_product(device):
    """dY W_e + s (dY B_e) A_e: the kernel on the transposed views of W and the adapter."""
    gen = torch.Generator().manual_seed(12)
    tokens, experts, n, k, r = 11, 3, 21, 18, 5
    routing = _routing(tokens, 2, experts, used=experts, gen=gen, device=device)
    dy = torch.randn(routing.num_rows, n, generator=gen, dtype=torch.float64).to(device)
    weight = torch.randn(experts, n, k, generator=gen, dtype=torch.float64).to(device)
    adapter = ExpertLoRA(
        torch.randn(experts, r, k, generator=gen, dtype=torch.float64).to(device),
        torch.randn(experts, n, r, generator=gen, dtype=torch.float64).to(device),
        1.5,
    )
    t = adapter.transposed()
    dx, _ = grouped_lora_gemm(
        dy.float(),
        routing,
        weight.float().transpose(1, 2),
        ExpertLoRA(t.A.float(), t.B.float(), t.scale),
        gather=False,
    )
    e = routing.row_expert.long()
    gold = torch.einsum("mn,mnk->mk", dy, weight[e])
    gold += adapter.scale * torch.einsum(
        "mr,mrk->mk", torch.einsum("mn,mnr->mr", dy, adapter.B[e]), adapter.A[e]
    )
    assert relative_error(dx, gold) < FP32_RTOL


@pytest.mark.parametrize(
    "u_gather,v_gather,weighted", [(False, False, False), (True, False, True), (False, True, False)]
)
def test_expert_sums_match_loop(u_gather, v_gather, weighted, device):
    gen = torch.Generator().manual_seed(13)
    tokens, top_k, experts, p, q = 19, 2, 6, 3, 37
    routing = _routing(tokens, top_k, experts, used=5, gen=gen, device=device)  # expert 5 idle
    m = routing.num_rows
    u = torch.randn(tokens if u_gather else m, p, generator=gen, dtype=torch.float64).to(device)
    v = torch.randn(tokens if v_gather else m, q, generator=gen, dtype=torch.float64).to(device)
    w = torch.rand(m, generator=gen, dtype=torch.float64).to(device) if weighted else None
    c = expert_sums(
        u.float(),
        v.float(),
        routing,
        u_gather=u_gather,
        v_gather=v_gather,
        u_weight=None if w is None else w.float(),
        scale=0.5,
    )
    tokens_of_rows = routing.tokens.long()
    us = u[tokens_of_rows] if u_gather else u
    vs = v[tokens_of_rows] if v_gather else v
    if w is not None:
        us = us * w[:, None]
    offsets = routing.offsets.tolist()
    gold = torch.stack([0.5 * us[a:b].t() @ vs[a:b] for a, b in zip(offsets[:-1], offsets[1:])])
    assert c.shape == (experts, p, q)
    assert relative_error(c, gold) < FP32_RTOL
    assert (c[5] == 0).all()
