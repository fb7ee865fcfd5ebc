"""moe_lora_experts on NF4 experts against the same op on the experts dequantised first.

The NF4 path dequantises a run of experts (to the values NF4Experts.dequantize gives,
checked against bitsandbytes in test_nf4_experts.py and for the launch in
test_nf4_dequantize.py) and multiplies it with the 16-bit path's kernel, restricted to
that run's tiles: the same products in the same order.  So the output and every gradient
equal those of the dense path bit for bit, on the GPU and under the interpreter, whether
the experts go in one run or one per run, and whether their shapes are whole blocks (one
launch) or not (dequantised in torch).
"""

import math

import pytest
import torch

import slothkit_kernels.moe.grouped_gemm as grouped_gemm
from slothkit_kernels.moe import ExpertLoRA, NF4Experts, moe_lora_experts, quantize_nf4_experts
from slothkit_kernels.testing import relative_error

pytestmark = [
    pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:.*not whole blocks:UserWarning"),
]

# (activation, interleaved, weights_in_out, bias, rank): the activations with and without
# biases, both storages, an expert block without adapters; odd sizes throughout.
CASES = {
    "swiglu": ("swiglu", False, False, False, 3),
    "swiglu-bias": ("swiglu", False, False, True, 3),
    "gpt-oss": ("gpt_oss", True, True, True, 4),
    "gpt-oss-no-bias": ("gpt_oss", True, True, False, 5),
    "gpt-oss-halves-no-lora": ("gpt_oss", False, False, True, None),
    "geglu-tanh": ("geglu_tanh", False, False, False, 3),
}
TOKENS, EXPERTS, TOP_K = 13, 5, 2
# (hidden, intermediate): odd sizes, experts not whole blocks of 64; and whole blocks.
SIZES = {"odd": (37, 23), "whole-blocks": (32, 24)}
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _problem(seed: int, weights_in_out: bool, bias: bool, rank, sizes=SIZES["odd"]):
    hidden, inter = sizes
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(TOKENS, hidden, generator=gen)
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(TOKENS)])
    ids[::4, 1] = EXPERTS  # an id no expert takes contributes nothing
    weights = torch.rand(TOKENS, TOP_K, generator=gen)
    gate_up = torch.randn(EXPERTS, 2 * inter, hidden, generator=gen) * 1.5 / math.sqrt(hidden)
    down = torch.randn(EXPERTS, hidden, inter, generator=gen) / math.sqrt(inter)
    if weights_in_out:
        gate_up, down = gate_up.mT.contiguous(), down.mT.contiguous()
    biases = (torch.randn(EXPERTS, 2 * inter, generator=gen), torch.randn(EXPERTS, hidden, generator=gen))
    adapters = []
    if rank is not None:
        adapters = [
            torch.randn(EXPERTS, rank, hidden, generator=gen) * 0.5 / math.sqrt(hidden),
            torch.randn(EXPERTS, 2 * inter, rank, generator=gen) * 0.5 / math.sqrt(rank),
            torch.randn(EXPERTS, rank, inter, generator=gen) * 0.5 / math.sqrt(inter),
            torch.randn(EXPERTS, hidden, rank, generator=gen) * 0.5 / math.sqrt(rank),
        ]
    return x, ids, weights, gate_up, down, biases if bias else (None, None), adapters


def _run(case, problem, gate_up, down, dtype, device):
    activation, interleaved, weights_in_out, _, _ = case
    x, ids, weights, _, _, biases, adapters = problem
    x = x.to(device, dtype).requires_grad_()
    weights = weights.to(device).requires_grad_()
    params = [p.to(device).requires_grad_() for p in adapters]
    loras = {}
    if params:
        loras = {"gate_up_lora": ExpertLoRA(*params[:2], 2.0), "down_lora": ExpertLoRA(*params[2:], 0.5)}
    out = moe_lora_experts(
        x,
        ids.to(device),
        weights,
        gate_up,
        down,
        **loras,
        gate_up_bias=None if biases[0] is None else biases[0].to(device, dtype),
        down_bias=None if biases[1] is None else biases[1].to(device, dtype),
        activation=activation,
        interleaved=interleaved,
        limit=1.0,
        weights_in_out=weights_in_out,
    )
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(device, dtype)
    return [out.detach(), *torch.autograd.grad(out, [x, weights, *params], grad)]


NAMES = ["out", "d x", "d expert_weights", "d gate_up A", "d gate_up B", "d down A", "d down B"]


# Every case in every dtype at whole blocks in one run; the odd sizes and a run per expert
# on the cases that differ in storage.
MATRIX = [(name, dtype, "whole-blocks", "one-run") for name in CASES for dtype in DTYPES]
MATRIX += [(name, torch.float32, "odd", "one-run") for name in CASES]
MATRIX += [(name, torch.float16, "whole-blocks", "run-per-expert") for name in ("swiglu-bias", "gpt-oss")]


@pytest.mark.parametrize(("name", "dtype", "sizes", "runs"), MATRIX)
def test_nf4_experts_match_their_dequantised_weights(name, dtype, sizes, runs, device, monkeypatch):
    if runs == "run-per-expert":
        monkeypatch.setattr(grouped_gemm, "NF4_STAGE_BYTES", 1)
    case = CASES[name]
    problem = _problem(len(name), case[2], case[3], case[4], SIZES[sizes])
    gate_up = quantize_nf4_experts(problem[3].to(device, dtype))
    down = quantize_nf4_experts(problem[4].to(device, dtype))
    ours = _run(case, problem, gate_up, down, dtype, device)
    gold = _run(case, problem, gate_up.dequantize(), down.dequantize(), dtype, device)
    for label, a, b in zip(NAMES, ours, gold):
        assert torch.equal(a, b), f"{label}: differs from the dequantised weights' result"


def test_nf4_experts_under_autocast_read_as_their_dequantised_weights(device):
    """Under autocast an fp32 record is dequantised to fp32, then rounded to the compute
    dtype in the kernel, as autocast rounds a dense fp32 weight."""
    case = CASES["swiglu-bias"]
    problem = _problem(3, False, True, 3)
    gate_up = quantize_nf4_experts(problem[3].to(device))
    down = quantize_nf4_experts(problem[4].to(device))
    with torch.autocast(torch.device(device).type, dtype=torch.float16):
        ours = _run(case, problem, gate_up, down, torch.float32, device)
        gold = _run(case, problem, gate_up.dequantize(), down.dequantize(), torch.float32, device)
    for label, a, b in zip(NAMES, ours, gold):
        assert relative_error(a, b) < 8 * 2.0**-11, label


def test_moe_lora_experts_refuses_a_malformed_record(device):
    problem = _problem(4, False, False, 3)
    gate_up = quantize_nf4_experts(problem[3].to(device))
    down = quantize_nf4_experts(problem[4].to(device))
    x, ids, weights = problem[0].to(device), problem[1].to(device), problem[2].to(device)
    short = NF4Experts(**{**vars(down), "absmax": down.absmax[:, :-1]})
    with pytest.raises(ValueError, match="NF4Experts.absmax"):
        moe_lora_experts(x, ids, weights, gate_up, short)
    with pytest.raises(TypeError, match="float16 but x has torch.float32"):
        moe_lora_experts(x, ids, weights, gate_up, quantize_nf4_experts(problem[4].to(device, torch.float16)))
