"""moe_lora_experts_forward and moe_lora_experts(..., forward=): a forward computed once and
handed to a later call on the same inputs (a checkpointed layer's re-run) gives that
call's output and every gradient bit for bit without running a product again; a record
of other inputs is refused, and the plain-torch reference keeps none."""

import math

import pytest
import torch

import slothkit_kernels.moe.experts as experts_op
from slothkit_kernels.moe import ExpertLoRA, ExpertsForward, moe_lora_experts, moe_lora_experts_forward
from slothkit_kernels.utils import warn_reference_once

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

LAYOUTS = {  # Qwen3-MoE's and gpt-oss's experts
    "swiglu": dict(activation="swiglu"),
    "gpt_oss": dict(activation="gpt_oss", interleaved=True, weights_in_out=True, limit=1.0),
}


def _problem(device, seed, *, tokens=13, hidden=37, inter=23, experts=5, top_k=2, rank=3, layout="swiglu"):
    """(differentiable leaves, the op's arguments as a function of them)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, std=1.0):
        return (torch.randn(*shape, generator=gen) * std).to(device)

    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]).to(device)
    options = dict(LAYOUTS[layout])
    gate_up = randn(experts, 2 * inter, hidden, std=1.5 / math.sqrt(hidden))
    down = randn(experts, hidden, inter, std=1 / math.sqrt(inter))
    if options.get("weights_in_out"):
        gate_up, down = gate_up.mT.contiguous(), down.mT.contiguous()
        options.update(
            gate_up_bias=randn(experts, 2 * inter, std=0.5), down_bias=randn(experts, hidden, std=0.5)
        )
    leaves = {
        "x": randn(tokens, hidden),
        "weights": torch.rand(tokens, top_k, generator=gen).to(device),
    }
    if rank:
        leaves.update(
            gu_a=randn(experts, rank, hidden, std=0.5 / math.sqrt(hidden)),
            gu_b=randn(experts, 2 * inter, rank, std=0.5 / math.sqrt(rank)),
            d_a=randn(experts, rank, inter, std=0.5 / math.sqrt(inter)),
            d_b=randn(experts, hidden, rank, std=0.5 / math.sqrt(rank)),
        )
    leaves = {name: t.requires_grad_() for name, t in leaves.items()}

    def arguments(values):
        kwargs = dict(options)
        if rank:
            kwargs["gate_up_lora"] = ExpertLoRA(values["gu_a"], values["gu_b"], 2.0)
            kwargs["down_lora"] = ExpertLoRA(values["d_a"], values["d_b"], 0.5)
        return (values["x"], ids, values["weights"], gate_up, down), kwargs

    return leaves, arguments


@pytest.fixture
def products(monkeypatch):
    """How many grouped GEMMs the op ran."""
    calls = []
    real = experts_op.grouped_lora_gemm

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(experts_op, "grouped_lora_gemm", counted)
    return calls


def _output_and_grads(leaves, args, kwargs, seed=11):
    out = moe_lora_experts(*args, **kwargs)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.device)
    return out.detach(), torch.autograd.grad(out, list(leaves.values()), grad)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("rank", [3, None])
def test_a_handed_on_forward_gives_the_same_output_and_gradients(layout, rank, device, products):
    leaves, arguments = _problem(device, seed=5, rank=rank, layout=layout)
    args, kwargs = arguments(leaves)
    out, done = moe_lora_experts_forward(*args, **kwargs)
    assert isinstance(done, ExpertsForward) and products == [1, 1]
    assert (done.xa is None) == (done.ha is None) == (rank is None)

    products.clear()
    plain_out, plain_grads = _output_and_grads(leaves, args, kwargs)
    assert len(products) == 4  # two forward, two backward
    assert torch.equal(out, plain_out)

    # As a checkpointer hands it on: its tensors, copied, rebuilt into a record.
    copied = ExpertsForward.from_tensors({name: t.clone() for name, t in done.tensors().items()})
    products.clear()
    taken_out, taken_grads = _output_and_grads(leaves, args, {**kwargs, "forward": copied})
    assert len(products) == 2  # the backward's only
    assert torch.equal(taken_out, plain_out)
    for name, a, b in zip(leaves, taken_grads, plain_grads):
        assert torch.equal(a, b), name


def test_a_forward_of_other_inputs_is_refused(device):
    leaves, arguments = _problem(device, seed=6)
    args, kwargs = arguments(leaves)
    _, done = moe_lora_experts_forward(*args, **kwargs)

    other_leaves, other_arguments = _problem(device, seed=6, tokens=9)
    other_args, other_kwargs = other_arguments(other_leaves)
    with pytest.raises(ValueError, match=r"forward\.out is .*\(13, 37\).*needs .*\(9, 37\)"):
        moe_lora_experts(*other_args, **other_kwargs, forward=done)

    unadapted = {name: value for name, value in kwargs.items() if not name.endswith("_lora")}
    with pytest.raises(ValueError, match=r"forward\.xa is .*this call needs none"):
        moe_lora_experts(*args, **unadapted, forward=done)

    with pytest.raises(TypeError, match="forward= must be an ExpertsForward"):
        moe_lora_experts(*args, **kwargs, forward=done.tensors())


def test_the_reference_keeps_nothing_to_hand_on(device, monkeypatch):
    leaves, arguments = _problem(device, seed=7)
    args, kwargs = arguments(leaves)
    _, done = moe_lora_experts_forward(*args, **kwargs)
    monkeypatch.setattr(experts_op, "use_triton", lambda *tensors: False)
    # Said once per process: another test on this worker may have said it already.
    warn_reference_once.cache_clear()
    with pytest.warns(UserWarning, match="plain-torch reference"):
        out, nothing = moe_lora_experts_forward(*args, **kwargs)
    assert nothing is None
    reference = experts_op.moe_lora_experts_reference(*args, **kwargs)
    torch.testing.assert_close(out, reference.detach(), rtol=0, atol=0)
    with pytest.raises(ValueError, match="plain-torch reference runs here"):
        moe_lora_experts(*args, **kwargs, forward=done)
