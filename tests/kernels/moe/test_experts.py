"""moe_lora_experts: forward and every gradient against the loop over experts in float64,
and the semantics against transformers' own expert modules (Qwen3-MoE, Mixtral, gpt-oss,
Gemma 4)."""

import math
from dataclasses import dataclass

import pytest
import torch

from slothkit_kernels.moe import ExpertLoRA, moe_lora_experts, moe_lora_experts_reference
from slothkit_kernels.moe.activation import expert_activation, expert_activation_backward
from slothkit_kernels.moe.routing import route_to_experts
from slothkit_kernels.testing import relative_error

# The interpreter evaluates exp() with numpy, which warns when exp(-x) overflows in sigmoid.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

# Error bounds, norm-wise relative, against float64 from the same (rounded) inputs.  Every
# value passes through at most four products (gate/up, down, and their transposes in
# backward) of length K <= 2 * 48; with random signs each product's rounding error grows
# like sqrt(K) u in norm (u = 2^-24 in fp32).  Sixteen times that per product covers the
# activation, the combine and the routing weight.  In bf16 (u = 2^-9) the stored G, h, Y,
# gY and dG each round once more, which dominates; the interpreter's casts to bf16
# truncate rather than round to nearest, which doubles each of those errors (measured
# here: 1.1e-2 to 1.7e-2 under the interpreter): 16 u, with u = 2^-9 in bf16 and 2^-12
# in fp16 (measured: under 5e-3).
FP32_RTOL = 4 * 16 * math.sqrt(96) * 2.0**-24  # about 4e-5


@dataclass
class Case:
    id: str
    tokens: int = 13
    hidden: int = 37
    inter: int = 23
    experts: int = 5
    top_k: int = 2
    rank: int | None = 3  # None: no adapters
    bias: bool = False
    activation: str = "swiglu"
    interleaved: bool = False
    weights_in_out: bool = False
    used_experts: int | None = None  # route to the first few experts only: the rest get none
    dropped: bool = False  # some ids are E, which no expert takes (Qwen3-MoE's skipped id)
    limit: float = 1.0  # gpt_oss: small, so that the clamps act on many values


CASES = [
    Case("swiglu"),
    Case("swiglu-top1", top_k=1),
    Case("swiglu-no-lora", rank=None),
    Case("swiglu-bias", bias=True),
    Case("swiglu-interleaved", interleaved=True),
    Case("swiglu-in-out", weights_in_out=True, rank=5),
    Case("idle-experts", experts=6, used_experts=3, top_k=3),
    Case("dropped-ids", dropped=True),
    Case("gpt-oss", activation="gpt_oss", interleaved=True, weights_in_out=True, bias=True, rank=4),
    Case("gpt-oss-halves", activation="gpt_oss", bias=True),
    Case(
        "gpt-oss-no-lora-top1",
        activation="gpt_oss",
        interleaved=True,
        weights_in_out=True,
        rank=None,
        top_k=1,
    ),
    Case("geglu-tanh", activation="geglu_tanh", rank=4),
    Case("geglu-tanh-no-lora-top1", activation="geglu_tanh", rank=None, top_k=1, dropped=True),
    Case("wide", tokens=21, hidden=48, inter=40, experts=3, rank=16, top_k=2, bias=True),
]


def _routing(case: Case, gen):
    used = case.used_experts or case.experts
    # Distinct experts per token, as top-k routing gives.
    ids = torch.stack([torch.randperm(used, generator=gen)[: case.top_k] for _ in range(case.tokens)])
    if case.dropped:
        ids[::3, 0] = case.experts
    weights = torch.rand(case.tokens, case.top_k, generator=gen, dtype=torch.float64)
    return ids, weights


def _problem(case: Case, seed: int):
    """Float64 inputs: x, ids, routing weights, stored weights, biases, adapter tensors."""
    gen = torch.Generator().manual_seed(seed)
    e, h, i, r = case.experts, case.hidden, case.inter, case.rank

    def randn(*shape, std=1.0):
        return torch.randn(*shape, generator=gen, dtype=torch.float64) * std

    x = randn(case.tokens, h)
    ids, weights = _routing(case, gen)
    gate_up = randn(e, 2 * i, h, std=1.5 / math.sqrt(h))  # gate/up values of a few units
    down = randn(e, h, i, std=1 / math.sqrt(i))
    if case.weights_in_out:
        gate_up, down = gate_up.transpose(1, 2).contiguous(), down.transpose(1, 2).contiguous()
    biases = (randn(e, 2 * i, std=0.5), randn(e, h, std=0.5)) if case.bias else (None, None)
    adapters = []
    if r is not None:
        # A as PEFT stores a target parameter's lora_A (E * r, in), B as (out, r * E): the
        # op gets views, B a non-contiguous one.
        # Sized so that the adapter's term is about half the base product's at any width.
        a_std, b_std = 0.5 / math.sqrt(h), 0.5 / math.sqrt(r)
        adapters = [randn(e * r, h, std=a_std), randn(2 * i, r * e, std=b_std)]
        adapters += [randn(e * r, i, std=0.5 / math.sqrt(i)), randn(h, r * e, std=b_std)]
    return x, ids, weights, gate_up, down, biases, adapters


def _run(fn, case: Case, problem, dtype, adapter_dtype, seed: int):
    """fn's output and the gradients of x, the routing weights and the adapter parameters."""
    x, ids, weights, gate_up, down, biases, adapters = problem
    e, r = case.experts, case.rank
    x = x.to(dtype).requires_grad_()
    weights = weights.to(adapter_dtype).requires_grad_()
    params = [p.to(adapter_dtype).requires_grad_() for p in adapters]
    loras = {}
    if params:
        a1, b1, a2, b2 = params
        loras["gate_up_lora"] = ExpertLoRA(a1.view(e, r, -1), b1.view(-1, r, e).permute(2, 0, 1), 2.0)
        loras["down_lora"] = ExpertLoRA(a2.view(e, r, -1), b2.view(-1, r, e).permute(2, 0, 1), 0.5)
    out = fn(
        x,
        ids,
        weights,
        gate_up.to(dtype),
        down.to(dtype),
        **loras,
        gate_up_bias=None if biases[0] is None else biases[0].to(dtype),
        down_bias=None if biases[1] is None else biases[1].to(dtype),
        activation=case.activation,
        interleaved=case.interleaved,
        limit=case.limit,
        weights_in_out=case.weights_in_out,
    )
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    inputs = [x, weights, *params]
    grads = torch.autograd.grad(out, inputs, grad.to(out.device, out.dtype))
    return out.detach(), list(grads)


NAMES = ["out", "d x", "d expert_weights", "d gate_up A", "d gate_up B", "d down A", "d down B"]


def _compare(ours, gold, rtol):
    out, grads = ours
    gold_out, gold_grads = gold
    for name, a, b in zip(NAMES, [out, *grads], [gold_out, *gold_grads]):
        assert a.shape == b.shape, f"{name}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
        err = relative_error(a, b)
        assert err < rtol, f"{name}: relative error {err:.2e} >= {rtol:.1e}"


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_moe_lora_experts_fp32_matches_float64_loop(case, device):
    problem = _problem(case, seed=len(case.id))
    problem = [t.to(device) if isinstance(t, torch.Tensor) else t for t in problem]
    problem[5] = tuple(None if b is None else b.to(device) for b in problem[5])
    problem[6] = [p.to(device) for p in problem[6]]
    ours = _run(moe_lora_experts, case, problem, torch.float32, torch.float32, seed=7)
    gold = _run(moe_lora_experts_reference, case, problem, torch.float64, torch.float64, seed=7)
    _compare(ours, gold, FP32_RTOL)
    if case.activation == "gpt_oss":  # the clamps were exercised
        x, ids, _, gate_up, *_ = problem
        w = gate_up if case.weights_in_out else gate_up.transpose(1, 2)
        product = torch.einsum("th,ehn->ten", x, w)
        assert (product.abs() > case.limit).float().mean() > 0.2
    if case.used_experts:  # experts that received no token get zero adapter gradients
        for grad in ours[1][2:]:
            assert grad.abs().sum() > 0
        e, r = case.experts, case.rank
        d_a1 = ours[1][2].view(e, r, -1)
        assert (d_a1[case.used_experts :] == 0).all()


LOW_CASES = [c for c in CASES if c.id in ("swiglu", "idle-experts", "dropped-ids", "gpt-oss", "geglu-tanh")]


def _round_inputs(problem, dtype):
    """The problem with what the op takes in ``dtype`` rounded to it, back in float64."""
    rounded = list(problem)
    rounded[0] = problem[0].to(dtype).double()
    rounded[3], rounded[4] = problem[3].to(dtype).double(), problem[4].to(dtype).double()
    rounded[5] = tuple(None if b is None else b.to(dtype).double() for b in problem[5])
    return rounded


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", LOW_CASES, ids=[c.id for c in LOW_CASES])
def test_moe_lora_experts_16bit_with_fp32_adapters(case, dtype, device):
    """PEFT keeps adapters in fp32 and Mixtral's routing weights are fp32: the gradients
    come back in those dtypes.  The gold is float64 from the same rounded inputs.  Besides
    16 u (above), a result may be off by as much as 2.5 times the error of the same loop
    run by torch in ``dtype`` (transformers' way): where the gpt-oss clamps cut, a value
    within a rounding of the limit that lands on the other side than in float64 gets or
    loses its whole gradient, in torch's computation as in ours, and the few such values
    put the gradients' norm-wise error at about the square root of their share."""
    problem = _problem(case, seed=len(case.id))
    problem = [t.to(device) if isinstance(t, torch.Tensor) else t for t in problem]
    problem[5] = tuple(None if b is None else b.to(device) for b in problem[5])
    problem[6] = [p.to(device) for p in problem[6]]
    ours = _run(moe_lora_experts, case, problem, dtype, torch.float32, seed=7)
    gold = _run(
        moe_lora_experts_reference, case, _round_inputs(problem, dtype), torch.float64, torch.float64, seed=7
    )
    torch_way = _run(moe_lora_experts_reference, case, problem, dtype, torch.float32, seed=7)
    assert ours[0].dtype == dtype and ours[1][0].dtype == dtype
    assert all(g.dtype == torch.float32 for g in ours[1][1:])
    u = 2.0**-9 if dtype == torch.bfloat16 else 2.0**-12
    for name, a, b, c in zip(NAMES, [ours[0], *ours[1]], [gold[0], *gold[1]], [torch_way[0], *torch_way[1]]):
        bound = max(16 * u, 2.5 * relative_error(c, b))
        err = relative_error(a, b)
        assert err < bound, f"{name}: relative error {err:.2e} >= {bound:.1e}"


@pytest.mark.cuda
@pytest.mark.parametrize("activation", ["swiglu", "gpt_oss", "geglu_tanh"])
def test_moe_lora_experts_large(activation):
    """A Qwen3-MoE-like layer slice in bf16 on the GPU: the tensor-core path, many tiles
    per expert, and the float64 gold on the same rounded inputs (bounds as above)."""
    gpt_oss = activation == "gpt_oss"
    case = Case(
        "large", tokens=1024, hidden=1024, inter=384, experts=16, top_k=4, rank=16,
        activation=activation, interleaved=gpt_oss, weights_in_out=gpt_oss, bias=gpt_oss, limit=7.0,
    )  # fmt: skip
    problem = _problem(case, seed=21)
    problem = [t.cuda() if isinstance(t, torch.Tensor) else t for t in problem]
    problem[5] = tuple(None if b is None else b.cuda() for b in problem[5])
    problem[6] = [p.cuda() for p in problem[6]]
    ours = _run(moe_lora_experts, case, problem, torch.bfloat16, torch.float32, seed=7)
    gold = _run(
        moe_lora_experts_reference,
        case,
        _round_inputs(problem, torch.bfloat16),
        torch.float64,
        torch.float64,
        seed=7,
    )
    torch_way = _run(moe_lora_experts_reference, case, problem, torch.bfloat16, torch.float32, seed=7)
    for name, a, b, c in zip(NAMES, [ours[0], *ours[1]], [gold[0], *gold[1]], [torch_way[0], *torch_way[1]]):
        bound = max(16 * 2.0**-9, 2.5 * relative_error(c, b))
        err = relative_error(a, b)
        assert err < bound, f"{name}: relative error {err:.2e} >= {bound:.1e}"


def test_moe_lora_experts_only_the_gradients_asked_for(device):
    case = Case("partial", bias=True)
    x, ids, weights, gate_up, down, biases, adapters = (
        t.to(device) if isinstance(t, torch.Tensor) else t for t in _problem(case, seed=3)
    )
    e, r = case.experts, case.rank
    b_up = adapters[1].to(device).requires_grad_()
    a_down = adapters[2].to(device).float().requires_grad_()

    def run(fn, dtype):
        gu_lora = ExpertLoRA(
            adapters[0].to(device, dtype).view(e, r, -1), b_up.to(dtype).view(-1, r, e).permute(2, 0, 1), 2.0
        )
        d_lora = ExpertLoRA(
            a_down.to(dtype).view(e, r, -1),
            adapters[3].to(device, dtype).view(-1, r, e).permute(2, 0, 1),
            0.5,
        )
        out = fn(
            x.to(dtype), ids, weights.to(dtype), gate_up.to(dtype), down.to(dtype),
            gate_up_lora=gu_lora, down_lora=d_lora,
            gate_up_bias=biases[0].to(device, dtype), down_bias=biases[1].to(device, dtype),
        )  # fmt: skip
        return torch.autograd.grad(out.sum(), [b_up, a_down])

    ours = run(moe_lora_experts, torch.float32)
    gold = run(moe_lora_experts_reference, torch.float64)
    for a, b in zip(ours, gold):
        assert relative_error(a, b) < FP32_RTOL


@pytest.mark.parametrize("activation", ["swiglu", "gpt_oss", "geglu_tanh"])
def test_activation_gradient_at_the_clamps_is_torch_clamps(activation, device):
    """At g = limit and u = +-limit exactly torch.clamp passes the gradient; beyond, none.
    (The grid of gate and up values, far negative gates included, checks the unclamped
    activations' values and derivatives against torch's autograd as well.)"""
    limit = 1.5
    values = torch.tensor([-3.0, -limit, -1.0, 0.0, 0.5, limit, 2.0, 7.0], dtype=torch.float64)
    gate_up = torch.cartesian_prod(values, values).reshape(-1, 2).to(device)  # (rows, 2): I = 1
    rows = gate_up.shape[0]
    routing = route_to_experts(torch.zeros(rows, 1, dtype=torch.long, device=device), 1, block_m=16)
    grad_h = torch.linspace(-1, 1, rows, dtype=torch.float64, device=device)[:, None]
    weight = torch.full((rows,), 0.75, dtype=torch.float64, device=device)

    from slothkit_kernels.moe.activation import expert_activation_reference

    leaf = gate_up.clone().requires_grad_()
    h_gold = expert_activation_reference(leaf, activation, False, 1.702, limit)
    (d_gold,) = torch.autograd.grad(h_gold, leaf, weight[:, None] * grad_h)

    sorted_gu = gate_up[routing.order].float()  # one expert: the sort keeps the order
    h = expert_activation(sorted_gu, routing, activation, False, 1.702, limit)
    h2, d_gate_up, dw = expert_activation_backward(
        sorted_gu, grad_h.float().clone(), weight.float(), routing, activation, False, 1.702, limit
    )
    torch.testing.assert_close(h.double(), h_gold.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(h2.double(), h_gold.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(d_gate_up.double(), d_gold, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dw.double(), (grad_h * h_gold.detach()).sum(1), rtol=1e-6, atol=1e-6)


def test_moe_lora_experts_under_autocast(device):
    """Under autocast, fp32 x and base weights are computed in autocast's dtype, as
    transformers' loop computes its products; x's gradient comes back in fp32."""
    case = Case("autocast", bias=True)
    x, ids, weights, gate_up, down, biases, adapters = (
        t.to(device) if isinstance(t, torch.Tensor) else t for t in _problem(case, seed=4)
    )
    e, r = case.experts, case.rank
    a = adapters[0].to(device).float().view(e, r, -1)
    b = adapters[1].to(device).float().view(-1, r, e).permute(2, 0, 1)
    x = x.float().requires_grad_()
    args = (ids, weights.float(), gate_up.float(), down.float())
    lora = dict(gate_up_lora=ExpertLoRA(a, b, 2.0), gate_up_bias=biases[0].to(device).float())
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        out = moe_lora_experts(x, *args, **lora)
    (dx,) = torch.autograd.grad(out, x, torch.ones_like(out))
    assert out.dtype == torch.bfloat16 and dx.dtype == torch.float32
    rounded = [t.bfloat16().float() for t in (x, *args[2:], lora["gate_up_bias"])]
    x_gold = rounded[0].double().requires_grad_()
    gold = moe_lora_experts_reference(
        x_gold, ids, args[1].double(), rounded[1].double(), rounded[2].double(),
        gate_up_lora=ExpertLoRA(a.double(), b.double(), 2.0), gate_up_bias=rounded[3].double(),
    )  # fmt: skip
    (dx_gold,) = torch.autograd.grad(gold, x_gold, torch.ones_like(gold))
    assert relative_error(out, gold) < 16 * 2.0**-9
    assert relative_error(dx, dx_gold) < 16 * 2.0**-9


def test_moe_lora_experts_bad_inputs(device):
    x = torch.randn(4, 8, device=device)
    ids = torch.zeros(4, 2, dtype=torch.long, device=device)
    w = torch.rand(4, 2, device=device)
    gate_up = torch.randn(3, 12, 8, device=device)
    down = torch.randn(3, 8, 6, device=device)
    moe_lora_experts(x, ids, w, gate_up, down)  # valid
    with pytest.raises(ValueError, match=r"gate_up must be logically \(E, 2I, 8\)"):
        moe_lora_experts(x, ids, w, gate_up, down, weights_in_out=True)
    with pytest.raises(TypeError, match="expert_ids must be an integer tensor"):
        moe_lora_experts(x, ids.float(), w, gate_up, down)
    with pytest.raises(ValueError, match="expert_weights has shape"):
        moe_lora_experts(x, ids, w[:, :1], gate_up, down)
    with pytest.raises(TypeError, match="down has dtype"):
        moe_lora_experts(x, ids, w, gate_up, down.double())
    with pytest.raises(ValueError, match="unknown activation 'gelu'"):
        moe_lora_experts(x, ids, w, gate_up, down, activation="gelu")
    with pytest.raises(ValueError, match=r"down_lora has A"):
        bad = ExpertLoRA(torch.randn(3, 2, 8, device=device), torch.randn(3, 8, 2, device=device), 1.0)
        moe_lora_experts(x, ids, w, gate_up, down, down_lora=bad)
    with pytest.raises(ValueError, match="rank 65"):
        big = ExpertLoRA(torch.randn(3, 65, 8, device=device), torch.randn(3, 12, 65, device=device), 1.0)
        moe_lora_experts(x, ids, w, gate_up, down, gate_up_lora=big)
    with pytest.raises(ValueError, match="gate_up requires grad"):
        moe_lora_experts(x, ids, w, gate_up.requires_grad_(), down)


# ----------------------------------------------------------------------------
# transformers' expert modules
# ----------------------------------------------------------------------------

transformers = pytest.importorskip("transformers")


def _merged(weight, lora: ExpertLoRA, weights_in_out: bool):
    """The stored weight with the adapter merged in: W + s B A, (out, in) per expert."""
    delta = lora.scale * lora.B @ lora.A  # (E, out, in)
    return weight + (delta.transpose(1, 2) if weights_in_out else delta)


def _random_loras(experts, hidden, inter, rank, gen):
    def randn(*shape):
        return torch.randn(*shape, generator=gen) * 0.3

    gate_up = ExpertLoRA(randn(experts, rank, hidden), randn(experts, 2 * inter, rank), 2.0)
    down = ExpertLoRA(randn(experts, rank, inter), randn(experts, hidden, rank), 0.5)
    return gate_up, down


def _against_merged(ex, x, ids, weights, gu_lora, d_lora, weights_in_out, **options):
    """transformers' experts ``ex`` with the adapters merged into their weights, against
    ours with the adapters apart: the output and the gradients of x, the routing weights
    and the adapters, these from the merged weight's gradient dW by the chain rule
    (W = W0 + s B A: dA = s B^T dW, dB = s dW A^T)."""
    base = ex.gate_up_proj.detach().clone(), ex.down_proj.detach().clone()
    with torch.no_grad():
        ex.gate_up_proj.copy_(_merged(ex.gate_up_proj, gu_lora, weights_in_out))
        ex.down_proj.copy_(_merged(ex.down_proj, d_lora, weights_in_out))
    stored = [ex.gate_up_proj.requires_grad_(), ex.down_proj.requires_grad_()]
    x, weights = x.detach().requires_grad_(), weights.detach().requires_grad_()
    out = ex(x, ids, weights)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(9)).to(out.device)
    dx, dw, *d_stored = torch.autograd.grad(out, [x, weights, *stored], grad)
    expected = [out.detach(), dx, dw]
    for d_weight, lora in zip(d_stored, (gu_lora, d_lora)):
        d_weight = d_weight.transpose(1, 2) if weights_in_out else d_weight  # (E, out, in)
        expected += [
            lora.scale * lora.B.transpose(1, 2) @ d_weight,
            lora.scale * d_weight @ lora.A.transpose(1, 2),
        ]
    for p in stored:
        p.requires_grad_(False)

    params = [t.detach().clone().requires_grad_() for t in (gu_lora.A, gu_lora.B, d_lora.A, d_lora.B)]
    ours = moe_lora_experts(
        x, ids, weights, *base,
        gate_up_lora=ExpertLoRA(params[0], params[1], gu_lora.scale),
        down_lora=ExpertLoRA(params[2], params[3], d_lora.scale),
        weights_in_out=weights_in_out, **options,
    )  # fmt: skip
    grads = torch.autograd.grad(ours, [x, weights, *params], grad)
    for name, a, b in zip(NAMES, [ours, *grads], expected):
        err = relative_error(a, b)
        assert err < FP32_RTOL, f"{name} vs transformers: relative error {err:.2e} >= {FP32_RTOL:.1e}"


def _fill(module, gen, std=0.3):
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * std)
    return module.requires_grad_(False)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_matches_transformers_block(family, device):
    """The whole sparse MoE block of transformers, its router included, against our experts
    fed the router's choice; then its experts with the adapters merged into the weights
    against ours with the adapters apart, gradients included. (The id E, which transformers
    5.2x skips and 5.17 refuses, is the float64 cases' "dropped-ids".)"""
    gen = torch.Generator().manual_seed(5)
    hidden, inter, experts = 24, 19, 5
    common = dict(hidden_size=hidden, num_experts_per_tok=2, num_hidden_layers=1, num_attention_heads=2)
    if family == "qwen3_moe":
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as Block

        config = transformers.Qwen3MoeConfig(
            moe_intermediate_size=inter, num_experts=experts, norm_topk_prob=True, **common
        )
    else:
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock as Block

        config = transformers.MixtralConfig(intermediate_size=inter, num_local_experts=experts, **common)
    # Their own loop, which the reference copies; on a GPU transformers may pick grouped_mm.
    config._experts_implementation = "eager"
    block = _fill(Block(config), gen).to(device).eval()
    x = torch.randn(2, 7, hidden, generator=gen).to(device)

    expected = block(x)
    _, weights, ids = block.gate(x.view(-1, hidden))
    ex = block.experts
    ours = moe_lora_experts(x.view(-1, hidden), ids, weights, ex.gate_up_proj, ex.down_proj)
    assert relative_error(ours, expected.view(-1, hidden)) < FP32_RTOL

    gu_lora, d_lora = (
        ExpertLoRA(lo.A.to(device), lo.B.to(device), lo.scale)
        for lo in _random_loras(experts, hidden, inter, 4, gen)
    )
    _against_merged(ex, x.view(-1, hidden), ids, weights, gu_lora, d_lora, False)


def test_matches_transformers_gpt_oss(device):
    """GptOssMLP (router, interleaved gate/up, biases, clamped SwiGLU, (in, out) weights)
    against our experts fed its router's choice; then its experts with merged adapters,
    gradients included."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    gen = torch.Generator().manual_seed(6)
    hidden, inter, experts = 24, 17, 4
    config = transformers.GptOssConfig(
        hidden_size=hidden,
        intermediate_size=inter,
        num_local_experts=experts,
        num_experts_per_tok=2,
        num_hidden_layers=1,
        num_attention_heads=2,
        swiglu_limit=1.0,  # small, so that both clamps act
    )
    mlp = _fill(GptOssMLP(config), gen, std=0.4).to(device).eval()
    x = torch.randn(2, 5, hidden, generator=gen).to(device)
    ex = mlp.experts
    ex.limit = 1.0  # transformers 5.17 fixes the module's limit at 7 whatever the config says
    options = dict(
        gate_up_bias=ex.gate_up_proj_bias,
        down_bias=ex.down_proj_bias,
        activation="gpt_oss",
        interleaved=True,
        alpha=ex.alpha,
        limit=ex.limit,
        weights_in_out=True,
    )

    expected, _ = mlp(x)
    _, scores, ids = mlp.router(x.view(-1, hidden))
    ours = moe_lora_experts(x.view(-1, hidden), ids, scores, ex.gate_up_proj, ex.down_proj, **options)
    assert relative_error(ours, expected.view(-1, hidden)) < FP32_RTOL

    gu_lora, d_lora = (
        ExpertLoRA(lo.A.to(device), lo.B.to(device), lo.scale)
        for lo in _random_loras(experts, hidden, inter, 3, gen)
    )
    options.pop("weights_in_out")
    _against_merged(ex, x.view(-1, hidden), ids, scores, gu_lora, d_lora, True, **options)


def test_matches_transformers_gemma4_experts(device):
    """Gemma4TextExperts (gelu_pytorch_tanh between the halves of an (out, in) gate/up),
    fed Gemma4TextRouter's choice and weights, against our experts; then with merged
    adapters, gradients included."""
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextExperts, Gemma4TextRouter

    gen = torch.Generator().manual_seed(8)
    hidden, inter, experts = 24, 13, 6
    config = transformers.Gemma4TextConfig(
        hidden_size=hidden,
        moe_intermediate_size=inter,
        num_experts=experts,
        top_k_experts=2,
        enable_moe_block=True,
        hidden_activation="gelu_pytorch_tanh",
        num_hidden_layers=1,
        num_attention_heads=2,
    )
    config._experts_implementation = "eager"
    ex = _fill(Gemma4TextExperts(config), gen, std=0.4).to(device).eval()
    router = _fill(Gemma4TextRouter(config), gen).to(device).eval()
    x = torch.randn(11, hidden, generator=gen).to(device)
    _, weights, ids = router(x)

    expected = ex(x, ids, weights)
    ours = moe_lora_experts(x, ids, weights, ex.gate_up_proj, ex.down_proj, activation="geglu_tanh")
    assert relative_error(ours, expected) < FP32_RTOL

    gu_lora, d_lora = (
        ExpertLoRA(lo.A.to(device), lo.B.to(device), lo.scale)
        for lo in _random_loras(experts, hidden, inter, 3, gen)
    )
    _against_merged(ex, x, ids, weights, gu_lora, d_lora, False, activation="geglu_tanh")
