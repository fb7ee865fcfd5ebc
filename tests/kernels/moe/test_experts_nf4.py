"""moe_lora_experts on NF4 experts against the same op on the experts dequantised first.

The NF4 path dequantises each weight tile in the K loop to the values
NF4Experts.dequantize gives (checked against bitsandbytes in test_nf4_experts.py), and
multiplies it as the 16-bit path multiplies a tile of the dequantised tensor: the same
products, the same accumulation order, the same epilogue.  So under the interpreter
(where numpy never contracts a product and a sum) the output and every gradient equal
those of the dense path bit for bit.  On the GPU the NF4 launch keeps products and sums
apart (enable_fp_fusion=False, for the block scales), which rounds the epilogue's
s (X A^T) B^T + bias once more per element than an FMA does: at most one unit in the
last place of each of the few values it touches, so the norm-wise relative error stays
under 8 u of the output dtype.
"""

import math

import pytest
import torch

from slothkit_kernels.moe import ExpertLoRA, NF4Experts, moe_lora_experts, quantize_nf4_experts
from slothkit_kernels.testing import relative_error
from slothkit_kernels.utils import interpreter_enabled

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

# (activation, interleaved, weights_in_out, bias, rank): both activations with and without
# biases, both storages, an expert block without adapters; odd sizes throughout.
CASES = {
    "swiglu": ("swiglu", False, False, False, 3),
    "swiglu-bias": ("swiglu", False, False, True, 3),
    "gpt-oss": ("gpt_oss", True, True, True, 4),
    "gpt-oss-no-bias": ("gpt_oss", True, True, False, 5),
    "gpt-oss-halves-no-lora": ("gpt_oss", False, False, True, None),
}
TOKENS, HIDDEN, INTER, EXPERTS, TOP_K = 13, 37, 23, 5, 2


def _problem(seed: int, weights_in_out: bool, bias: bool, rank):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(TOKENS, HIDDEN, generator=gen)
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(TOKENS)])
    ids[::4, 1] = EXPERTS  # an id no expert takes contributes nothing
    weights = torch.rand(TOKENS, TOP_K, generator=gen)
    gate_up = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen) * 1.5 / math.sqrt(HIDDEN)
    down = torch.randn(EXPERTS, HIDDEN, INTER, generator=gen) / math.sqrt(INTER)
    if weights_in_out:
        gate_up, down = gate_up.mT.contiguous(), down.mT.contiguous()
    biases = (torch.randn(EXPERTS, 2 * INTER, generator=gen), torch.randn(EXPERTS, HIDDEN, generator=gen))
    adapters = []
    if rank is not None:
        adapters = [
            torch.randn(EXPERTS, rank, HIDDEN, generator=gen) * 0.5 / math.sqrt(HIDDEN),
            torch.randn(EXPERTS, 2 * INTER, rank, generator=gen) * 0.5 / math.sqrt(rank),
            torch.randn(EXPERTS, rank, INTER, generator=gen) * 0.5 / math.sqrt(INTER),
            torch.randn(EXPERTS, HIDDEN, rank, generator=gen) * 0.5 / math.sqrt(rank),
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", list(CASES))
def test_nf4_experts_match_their_dequantised_weights(name, dtype, device):
    if dtype == torch.bfloat16 and interpreter_enabled():
        pytest.skip("the interpreter truncates casts to bf16, the dequantised tensor rounds")
    case = CASES[name]
    problem = _problem(len(name), case[2], case[3], case[4])
    gate_up = quantize_nf4_experts(problem[3].to(device, dtype))
    down = quantize_nf4_experts(problem[4].to(device, dtype))
    ours = _run(case, problem, gate_up, down, dtype, device)
    gold = _run(case, problem, gate_up.dequantize(), down.dequantize(), dtype, device)
    for label, a, b in zip(NAMES, ours, gold):
        if interpreter_enabled():
            assert torch.equal(a, b), f"{label}: differs from the dequantised weights' result"
        else:
            u = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}[b.dtype]
            assert relative_error(a, b) < 8 * u, f"{label}: relative error {relative_error(a, b):.2e}"


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
