"""The torch._grouped_mm backend of the experts' grouped GEMM (set_backend("grouped_mm")):
its product and the whole experts op against float64 loops, and when it applies."""

import math
import warnings

import pytest
import torch

from slothkit_kernels.moe import (
    ExpertLoRA,
    grouped_gemm,
    grouped_lora_gemm,
    grouped_lora_gemm_reference,
    grouped_mm,
    moe_lora_experts,
    moe_lora_experts_reference,
    quantize_nf4_experts,
    route_to_experts,
)
from slothkit_kernels.moe.grouped_gemm import tile_sizes
from slothkit_kernels.testing import relative_error

BF16_U = 2.0**-9
pytestmark = pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no _grouped_mm")


@pytest.fixture
def grouped_mm_backend(monkeypatch):
    """The backend switched on, and a count of the grouped GEMMs it ran."""
    monkeypatch.setattr(grouped_mm, "BACKEND", "grouped_mm")
    calls = []
    real = grouped_gemm.grouped_mm_lora_gemm

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(grouped_gemm, "grouped_mm_lora_gemm", counted)
    return calls


def _routing(tokens, top_k, experts, used, gen, device, dropped=False):
    ids = torch.stack([torch.randperm(used, generator=gen)[:top_k] for _ in range(tokens)])
    if dropped:
        ids[::4, 0] = experts  # Qwen3-MoE's skipped id: no expert takes these rows
    return ids.to(device), route_to_experts(ids.to(device), experts, tile_sizes(torch.bfloat16)["BLOCK_M"])


@pytest.mark.parametrize("layout", ["out_in", "in_out"])
@pytest.mark.parametrize("gather", [True, False])
@pytest.mark.parametrize("lora,bias", [(False, False), (True, False), (True, True)])
def test_product_matches_the_loop_in_float64(layout, gather, lora, bias, device, grouped_mm_backend):
    gen = torch.Generator().manual_seed(5)
    tokens, top_k, experts, n, k, r = 19, 2, 6, 24, 40, 8
    _, routing = _routing(tokens, top_k, experts, used=5, gen=gen, device=device, dropped=True)
    m = routing.num_rows

    def randn(*shape, std=1.0):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * std).to(device)

    x = randn(tokens if gather else m, k).bfloat16()
    stored = randn(experts, n, k) if layout == "out_in" else randn(experts, k, n)
    stored = (stored / math.sqrt(k)).bfloat16()
    weight = stored if layout == "out_in" else stored.transpose(1, 2)  # logical (E, N, K)
    adapter = None
    if lora:  # fp32, B a non-contiguous view, as PEFT's parameters give them
        adapter = ExpertLoRA(
            randn(experts, r, k, std=k**-0.5).float(),
            randn(n, r, experts, std=r**-0.5).float().permute(2, 0, 1),
            0.7,
        )
    b = randn(experts, n).bfloat16() if bias else None

    y, xa = grouped_lora_gemm(x, routing, weight, adapter, b, gather=gather, store_xa=True)
    assert len(grouped_mm_backend) == 1
    gold = grouped_lora_gemm_reference(
        x.double(),
        routing,
        weight.double(),
        None if adapter is None else ExpertLoRA(adapter.A.double(), adapter.B.double(), adapter.scale),
        None if b is None else b.double(),
        gather=gather,
    )
    rows = int(routing.offsets[-1])  # rows past it belong to no expert and are left unwritten
    assert y.dtype == torch.bfloat16 and rows < m
    # The base product, the adapter's term and their sum each round once to bf16.
    assert relative_error(y[:rows], gold[:rows]) < 4 * BF16_U
    if lora:
        src = x[routing.tokens.long()] if gather else x
        xa_gold = torch.einsum(
            "mk,mrk->mr", src.double(), adapter.A.double()[routing.row_expert.long().clamp(max=experts - 1)]
        )
        assert relative_error(xa[:rows], xa_gold[:rows]) < 4 * BF16_U
    else:
        assert xa is None


def test_nf4_experts_are_dequantised_once_and_multiplied(device, grouped_mm_backend, monkeypatch):
    gen = torch.Generator().manual_seed(9)
    _, routing = _routing(15, 2, 4, used=4, gen=gen, device=device)
    x = torch.randn(15, 64, generator=gen).to(device).bfloat16()
    record = quantize_nf4_experts(torch.randn(4, 32, 64, generator=gen).to(device).bfloat16())
    y, _ = grouped_lora_gemm(x, routing, record, gather=True)
    assert len(grouped_mm_backend) == 1
    gold = grouped_lora_gemm_reference(x.double(), routing, record.dequantize().double(), gather=True)
    assert relative_error(y, gold) < 2 * BF16_U
    # Experts larger than one dequantisation run: the Triton kernel's runs, said once.
    stage = grouped_gemm.NF4_STAGE_BYTES
    monkeypatch.setattr(grouped_gemm, "NF4_STAGE_BYTES", 2 * 32 * 64 * 2)  # two of the four experts
    monkeypatch.setattr(grouped_mm, "_said", set())
    with pytest.warns(UserWarning, match="larger than one dequantisation run"):
        y_runs, _ = grouped_lora_gemm(x, routing, record, gather=True)
    assert len(grouped_mm_backend) == 1
    assert relative_error(y_runs, gold) < 4 * BF16_U  # the interpreter's bf16 casts truncate
    monkeypatch.setattr(grouped_gemm, "NF4_STAGE_BYTES", stage)
    # Its transposed reading: the backward's product.
    dy = torch.randn(routing.num_rows, 32, generator=gen).to(device).bfloat16()
    dx, _ = grouped_lora_gemm(dy, routing, record.mT, gather=False)
    dx_gold = grouped_lora_gemm_reference(dy.double(), routing, record.dequantize().mT.double(), gather=False)
    assert relative_error(dx, dx_gold) < 2 * BF16_U


@pytest.mark.parametrize("activation", ["swiglu", "gpt_oss"])
def test_experts_forward_and_gradients_match_float64(activation, device, grouped_mm_backend):
    """The whole op (both products, forward and backward) through the backend: output and
    every gradient within bf16's rounding of float64 from the same rounded inputs."""
    gen = torch.Generator().manual_seed(3)
    tokens, hidden, inter, experts, top_k, r = 21, 48, 40, 5, 2, 8
    ids, _ = _routing(tokens, top_k, experts, used=experts, gen=gen, device=device)

    def randn(*shape, std=1.0):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * std).to(device)

    x = randn(tokens, hidden).bfloat16().double()
    weights = randn(tokens, top_k).abs()
    gate_up = (randn(experts, 2 * inter, hidden) * 1.5 / math.sqrt(hidden)).bfloat16().double()
    down = (randn(experts, hidden, inter) / math.sqrt(inter)).bfloat16().double()
    biases = (
        randn(experts, 2 * inter, std=0.5).bfloat16().double(),
        randn(experts, hidden, std=0.5).bfloat16().double(),
    )
    adapters = [
        randn(experts * r, hidden, std=0.5 / math.sqrt(hidden)),
        randn(2 * inter, r * experts, std=0.5 / math.sqrt(r)),
        randn(experts * r, inter, std=0.5 / math.sqrt(inter)),
        randn(hidden, r * experts, std=0.5 / math.sqrt(r)),
    ]
    upstream = randn(tokens, hidden)

    def run(fn, dtype, adapter_dtype):
        xs = x.to(dtype).requires_grad_()
        ws = weights.to(adapter_dtype).requires_grad_()
        params = [p.to(adapter_dtype).requires_grad_() for p in adapters]
        a1, b1, a2, b2 = params
        out = fn(
            xs,
            ids,
            ws,
            gate_up.to(dtype),
            down.to(dtype),
            gate_up_lora=ExpertLoRA(a1.view(experts, r, -1), b1.view(-1, r, experts).permute(2, 0, 1), 2.0),
            down_lora=ExpertLoRA(a2.view(experts, r, -1), b2.view(-1, r, experts).permute(2, 0, 1), 0.5),
            gate_up_bias=biases[0].to(dtype),
            down_bias=biases[1].to(dtype),
            activation=activation,
            limit=1.0,
        )
        grads = torch.autograd.grad(out, [xs, ws, *params], upstream.to(out.dtype))
        return [out.detach(), *grads]

    ours = run(moe_lora_experts, torch.bfloat16, torch.float32)
    assert len(grouped_mm_backend) == 4  # gate/up and down, forward and backward
    gold = run(moe_lora_experts_reference, torch.float64, torch.float64)
    torch_way = run(moe_lora_experts_reference, torch.bfloat16, torch.float32)
    names = ["out", "d x", "d expert_weights", "d gate_up A", "d gate_up B", "d down A", "d down B"]
    for name, a, b, c in zip(names, ours, gold, torch_way):
        # As test_experts.py's 16-bit bound: 16 u, or 2.5 times torch's own bf16 loop's
        # error where gpt-oss's clamps cut.
        bound = max(16 * BF16_U, 2.5 * relative_error(c, b))
        err = relative_error(a, b)
        assert err < bound, f"{name}: relative error {err:.2e} >= {bound:.1e}"


def test_it_applies_only_where_asked_and_possible_saying_why_once(monkeypatch):
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    lora8 = ExpertLoRA(torch.zeros(2, 8, 64), torch.zeros(2, 32, 8), 1.0)
    lora4 = ExpertLoRA(torch.zeros(2, 4, 64), torch.zeros(2, 32, 4), 1.0)
    monkeypatch.setattr(grouped_mm, "_said", set())
    monkeypatch.setattr(grouped_mm, "BACKEND", "auto")  # the default, restored after the test
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "auto" takes it on compute capability 9.0+ only, silently
        assert not grouped_mm.grouped_mm_applies(x, 32, 64, lora8)  # on the CPU
        assert not grouped_mm.grouped_mm_applies(x.float(), 32, 64, lora8)
    grouped_mm.set_backend("triton")
    assert not grouped_mm.grouped_mm_applies(x, 32, 64, lora8)  # not asked for
    with pytest.raises(ValueError, match="not one of"):
        grouped_mm.set_backend("cutlass")
    grouped_mm.set_backend("grouped_mm")
    assert grouped_mm.grouped_mm_applies(x, 32, 64, lora8)
    for args, reason in [
        ((x.float(), 32, 64, lora8), "bf16 only"),
        ((x, 32, 64, lora4), "LoRA rank = 4"),
        ((x, 36, 64, None), "output features = 36"),
    ]:
        with pytest.warns(UserWarning, match=reason):
            assert not grouped_mm.grouped_mm_applies(*args)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # said once
            assert not grouped_mm.grouped_mm_applies(*args)


@pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)),
    reason="needs a GPU of compute capability 9.0 or newer; run on the GPU machine",
)
def test_the_default_takes_it_on_compute_capability_9_and_up(monkeypatch):
    monkeypatch.setattr(grouped_mm, "BACKEND", "auto")
    calls = []
    real = grouped_gemm.grouped_mm_lora_gemm
    monkeypatch.setattr(
        grouped_gemm, "grouped_mm_lora_gemm", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    gen = torch.Generator().manual_seed(8)
    _, routing = _routing(64, 2, 4, used=4, gen=gen, device="cuda")
    x = torch.randn(64, 32, generator=gen).to("cuda", torch.bfloat16)
    weight = torch.randn(4, 48, 32, generator=gen).to("cuda", torch.bfloat16)
    y, _ = grouped_lora_gemm(x, routing, weight, gather=True)
    assert calls == [1]
    # Both round their fp32 sums to bf16 once: a unit in the last place apart at most.
    reference = grouped_lora_gemm_reference(x, routing, weight, gather=True).float()
    torch.testing.assert_close(y.float(), reference, rtol=2 * BF16_U, atol=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # fp32 takes the Triton kernel, silently
        grouped_lora_gemm(x.float(), routing, weight.float(), gather=True)
    assert calls == [1]
