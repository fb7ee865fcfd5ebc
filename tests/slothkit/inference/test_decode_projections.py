"""SharedInputProjections (the decode step's grouped LoRA projections) against each
layer's own forward, on fresh random inputs: plain linears, LoRA adapters of different
ranks and scalings, disabled and merged adapters, adapters changed in place after the
copies were made, and layers it must leave to their own forward (DoRA, two active
adapters)."""

import itertools

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn

from slothkit.inference.decode_projections import SharedInputProjections


class _Block(nn.Module):
    def __init__(self, bias: bool = False):
        super().__init__()
        self.q = nn.Linear(32, 48, bias=bias)
        self.k = nn.Linear(32, 16, bias=bias)
        self.v = nn.Linear(32, 16, bias=bias)


def _adapted(seed: int, **lora):
    torch.manual_seed(seed)
    settings = dict(r=4, lora_alpha=8, target_modules=["q", "k", "v"])
    settings.update(lora)
    model = get_peft_model(_Block(bias=True), LoraConfig(**settings))
    with torch.no_grad():  # B starts at zero: give the adapters an effect
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.5)
    model.eval()
    block = model.base_model.model
    return model, [block.q, block.k, block.v]


def _assert_outputs_equal(layers, projections, rows=(1, 3), width=32, tolerance=1e-5):
    for shape in (rows, (2, 5)):
        x = torch.randn(*shape, width)
        with torch.no_grad():
            expected = [layer(x) for layer in layers]
            got = projections(x)
        for e, g in zip(expected, got):
            torch.testing.assert_close(g, e, rtol=tolerance, atol=tolerance)


def test_plain_linears_are_their_own_outputs():
    torch.manual_seed(0)
    block = _Block(bias=True)
    layers = [block.q, block.k, block.v]
    _assert_outputs_equal(layers, SharedInputProjections(layers, torch.float32))


@pytest.mark.parametrize("use_rslora", [False, True])
def test_lora_layers_equal_peft(use_rslora):
    _, layers = _adapted(1, use_rslora=use_rslora, rank_pattern={"k": 2}, alpha_pattern={"v": 3})
    projections = SharedInputProjections(layers, torch.float32)
    assert not projections.own_forward and len(projections.adapters) == 3
    _assert_outputs_equal(layers, projections)


def test_the_gemv_with_the_adapter_in_its_epilogue_equals_peft(monkeypatch):
    """Where slothkit's GEMV was timed faster (on a GPU), every 16-bit projection of a
    decode step runs through it: here the Triton interpreter runs it for rows of 1 to 8
    (the 10-row batch keeps the base layers), with and without adapters and biases."""
    from slothkit.inference import decode_projections

    launched = []

    def candidate(rows, weight, *rest):
        launched.append((rows.shape[0], weight.shape[0]))
        return 0

    monkeypatch.setattr(decode_projections, "_gemv_may_run", lambda rows: rows.shape[0] <= 8)
    monkeypatch.setattr(decode_projections, "gemv_candidate", candidate)
    _, layers = _adapted(3, rank_pattern={"k": 2}, alpha_pattern={"v": 3})
    _assert_outputs_equal(layers, SharedInputProjections(layers, torch.float32), rows=(1, 3))
    assert sorted({rows for rows, _ in launched}) == [3]  # the (2, 5) batch has 10 rows
    torch.manual_seed(4)
    block = _Block(bias=False)
    plain = [block.q, block.k, block.v]
    _assert_outputs_equal(plain, SharedInputProjections(plain, torch.float32), rows=(8,))
    assert (8, 48) in launched


def test_adapters_changed_in_place_are_seen_after_refresh():
    _, layers = _adapted(2)
    projections = SharedInputProjections(layers, torch.float32)
    with torch.no_grad():
        for layer in layers:
            layer.lora_A["default"].weight.add_(torch.randn_like(layer.lora_A["default"].weight))
            layer.lora_B["default"].weight.mul_(-2.0)
    x = torch.randn(3, 32)
    with torch.no_grad():
        stale = projections(x)[0]
        projections.refresh()
        fresh = projections(x)[0]
        expected = layers[0](x)
    assert not torch.allclose(stale, expected, atol=1e-3), "the copies should have been stale"
    torch.testing.assert_close(fresh, expected, rtol=1e-5, atol=1e-5)


def test_disabled_and_merged_adapters_apply_the_base_only():
    model, layers = _adapted(3)
    with model.disable_adapter():
        _assert_outputs_equal(layers, SharedInputProjections(layers, torch.float32))
    model.merge_adapter()
    projections = SharedInputProjections(layers, torch.float32)
    assert not projections.adapters
    _assert_outputs_equal(layers, projections)


def test_dora_and_two_active_adapters_run_their_own_forward():
    _, layers = _adapted(4, use_dora=True)
    projections = SharedInputProjections(layers, torch.float32)
    assert projections.own_forward
    _assert_outputs_equal(layers, projections)

    model, layers = _adapted(5)
    model.add_adapter("second", LoraConfig(r=2, lora_alpha=2, target_modules=["q", "k", "v"]))
    model.base_model.set_adapter(["default", "second"])
    projections = SharedInputProjections(layers, torch.float32)
    assert projections.own_forward
    _assert_outputs_equal(layers, projections)


def test_bf16_copies_match_the_fp32_adapters_to_bf16_precision():
    _, layers = _adapted(6)
    for layer in layers:
        layer.base_layer.to(torch.bfloat16)
    projections = SharedInputProjections(layers, torch.bfloat16)
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    with torch.no_grad():
        got = projections(x)
        expected = [layer(x) for layer in layers]
    for e, g in zip(expected, got):
        assert g.dtype == torch.bfloat16
        torch.testing.assert_close(g.float(), e.float(), rtol=2e-2, atol=2e-2)


# Rows of whole 64-element blocks, as in every real model: bitsandbytes 0.50's AVX512 CPU
# dequantisation (its forward's too) gives the wrong scales to rows that are a multiple
# of 16 elements but not of the block (32 or 96 with blocks of 64).
NF4_WIDTH = 64


def _nf4_block(compute_dtype):
    """q, k, v as bitsandbytes NF4 Linear4bit layers (quantised on the CPU) with LoRA."""
    import bitsandbytes as bnb

    torch.manual_seed(7)
    block = _Block()
    for name in ("q", "k", "v"):
        dense = getattr(block, name)
        quantised = bnb.nn.Linear4bit(
            NF4_WIDTH, dense.out_features, bias=True, compute_dtype=compute_dtype, quant_type="nf4"
        )
        weight = torch.randn(dense.out_features, NF4_WIDTH) / NF4_WIDTH**0.5
        quantised.load_state_dict({"weight": weight, "bias": torch.randn(dense.out_features)})
        setattr(block, name, quantised.to("cpu"))
    model = get_peft_model(block, LoraConfig(r=4, lora_alpha=8, target_modules=["q", "k", "v"]))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.5)
    model.eval()
    return [model.base_model.model.q, model.base_model.model.k, model.base_model.model.v]


def test_nf4_bases_dequantise_with_slothkit_for_several_rows_only(monkeypatch, bitsandbytes_repacks_on_cpu):
    """One row: bitsandbytes' own layer (its GEMV); several rows (prefill, a batch):
    slothkit's dequantisation, which gives bitsandbytes' weight bit for bit, then F.linear.
    bitsandbytes takes the CPU for one with AVX512-BF16, where it would repack the weights
    at their first eval forward (48 and 16 rows: it could not) unless slothkit kept them."""
    from slothkit_kernels import nf4

    layers = _nf4_block(torch.float32)
    projections = SharedInputProjections(layers, torch.float32)
    assert all(entry is not None for entry in projections.nf4)
    calls = []
    dequantize = nf4.dequantize_nf4
    monkeypatch.setattr(
        nf4, "dequantize_nf4", lambda weight: calls.append(weight.shape) or dequantize(weight)
    )
    _assert_outputs_equal(layers, projections, rows=(1, 1), width=NF4_WIDTH)  # (1, 1, 64), (2, 5, 64)
    assert calls == [(48, NF4_WIDTH), (16, NF4_WIDTH), (16, NF4_WIDTH)]  # the (2, 5) call only
    weight = projections.nf4[0][0]
    base = layers[0].base_layer
    import bitsandbytes.functional as bnbf

    torch.testing.assert_close(
        dequantize(weight), bnbf.dequantize_4bit(base.weight.data, base.weight.quant_state), rtol=0, atol=0
    )


def test_nf4_bases_of_another_compute_dtype_keep_their_own_forward():
    layers = _nf4_block(torch.bfloat16)  # the layers compute in bf16, the step in fp32
    projections = SharedInputProjections(layers, torch.float32)
    assert projections.nf4 == [None, None, None]


def _group_timed_faster(monkeypatch, kernel: str, candidates: list[int]) -> list:
    """Decode-step conditions on the CPU, with the timings given: each projection apart
    keeps the library's path, the group launch ``kernel`` (the decode_projections name
    of lora_gemv_group or nf4_lora_gemv_group) is timed at ``candidates`` and the last
    one is the fastest.  Returns the candidates the group kernel runs at, and the shapes
    of the 16-bit weights whose own decisions were asked for."""
    from slothkit.inference import decode_projections, gemv_choice

    monkeypatch.setattr(decode_projections, "_gemv_may_run", lambda rows: rows.shape[0] <= 8)
    monkeypatch.setattr(gemv_choice, "_considered", lambda rows: rows.shape[0] <= 8)
    asked = []  # the 16-bit weights' shapes each decode call asked a decision for
    monkeypatch.setattr(  # apart: the library's path
        gemv_choice, "gemv_candidate", lambda rows, weight, *rest: asked.append(tuple(weight.shape))
    )
    monkeypatch.setattr(gemv_choice, "nf4_gemv_candidate", lambda *args: None)
    monkeypatch.setattr(gemv_choice, "_usable", lambda tiles, uses_tensor_cores, device: candidates)
    monkeypatch.setattr(gemv_choice, "_copies", lambda first, nbytes, clone, device: [first])
    monkeypatch.setattr(gemv_choice, "_choices", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    # Per decision: apart, then each candidate.
    answers = itertools.cycle([1.0] + [0.6] * (len(candidates) - 1) + [0.5])
    monkeypatch.setattr(gemv_choice, "_graph_ms", lambda call, copies: next(answers))
    launches = []
    group = getattr(decode_projections, kernel)
    monkeypatch.setattr(
        decode_projections, kernel, lambda *a, **k: launches.append(k["candidate"]) or group(*a, **k)
    )
    return launches, asked


@pytest.mark.parametrize("adapters", ["ranks and scalings of their own", "merged"])
def test_a_group_timed_faster_runs_in_one_launch_and_equals_each_layer(monkeypatch, adapters):
    """Where lora_gemv_group was timed faster than the projections apart (the timings
    given; the kernel runs under the Triton interpreter), q, k and v of a decode step's
    rows take one launch of it and give each layer's own output; more rows than a decode
    step's take the layers' path."""
    from slothkit.inference import gemv_choice

    seed = int(torch.randint(0, 2**31, ()))
    model, layers = _adapted(seed, rank_pattern={"k": 2}, alpha_pattern={"v": 3})
    if adapters == "merged":
        model.merge_adapter()
    launches, asked = _group_timed_faster(monkeypatch, "lora_gemv_group", [0, 5])
    projections = SharedInputProjections(layers, torch.float32)
    assert projections.dense_group is not None
    _assert_outputs_equal(layers, projections)  # 3 rows, then 10
    assert launches == [5]  # the 3-row call, at the faster candidate; none for 10 rows
    # The adapters' x A^T (stacked A: 4 + 2 + 4 rows) is a decode GEMV decided by its shape too.
    assert ((10, 32) in asked) == (adapters != "merged")
    (decision,) = gemv_choice.choices()
    assert decision["weight"] == "16-bit group" and decision["out_features"] == "48+16+16"
    assert decision["runs"] == "lora_gemv_group" and decision["rank"] == (0 if adapters == "merged" else 10)


def test_an_nf4_group_timed_faster_runs_in_one_launch_and_equals_each_layer(
    monkeypatch, bitsandbytes_repacks_on_cpu
):
    """The same for q, k and v as bitsandbytes NF4 layers with LoRA: one
    nf4_lora_gemv_group launch (under the interpreter) gives each layer's own output
    (bitsandbytes' for one row), to the rounding of its 4-bit GEMV."""
    from slothkit.inference import gemv_choice

    layers = _nf4_block(torch.float32)
    launches, _ = _group_timed_faster(monkeypatch, "nf4_lora_gemv_group", [0, 4])
    projections = SharedInputProjections(layers, torch.float32)
    assert projections.nf4_group is not None and projections.dense_group is None
    for rows in ((1, 1), (1, 3)):  # one row, three; then ten each time, more than a decode step's
        _assert_outputs_equal(layers, projections, rows=rows, width=NF4_WIDTH, tolerance=1e-4)
    assert launches == [4, 4]
    (decision,) = [c for c in gemv_choice.choices() if c["weight"] == "nf4 group" and c["rows"] == 1]
    assert decision["out_features"] == "48+16+16" and decision["runs"] == "nf4_lora_gemv_group"


def test_a_group_is_left_apart_where_its_biases_differ():
    torch.manual_seed(int(torch.randint(0, 2**31, ())))
    block = _Block(bias=True)
    block.k.bias = None
    assert SharedInputProjections([block.q, block.k, block.v], torch.float32).dense_group is None
    assert SharedInputProjections([block.q, block.v], torch.float32).dense_group is not None
    assert SharedInputProjections([block.q], torch.float32).dense_group is None  # one layer: nothing to group
