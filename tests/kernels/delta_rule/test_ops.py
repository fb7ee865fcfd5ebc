"""gated_delta_rule (chunked, Triton) against the per-token recurrence in fp32 and, on a
GPU, against transformers' torch_chunk_gated_delta_rule at Qwen3.5's sizes.

Outputs, the final state and the gradients of every input (q, k, v, g, beta, the initial
state) are compared by relative error over the whole tensor.  In fp32 both sides sum the
same terms in other orders: each entry is a sum over at most T * dk products of values of
order 1, so rounding leaves it within about sqrt(T * dk) * 2^-24 of the exact value
relative to the tensor's norm, 1e-5 with margin for T <= 130.  In bf16 (GPU) both sides
compute in fp32 from the same bf16 inputs and round the output to bf16 (2^-8 relative);
the chunked kernels' tensor-core products carry tf32 (2^-11) rounding, so 1e-2.
"""

import pytest
import torch

from slothkit_kernels.delta_rule import gated_delta_rule, gated_delta_rule_reference
from slothkit_kernels.testing import relative_error

FP32_BOUND = 1e-5


def _inputs(batch, seq_len, k_heads, v_heads, k_dim, v_dim, with_initial_state, device, dtype=torch.float32):
    q = torch.randn(batch, seq_len, k_heads, k_dim, device=device, dtype=dtype)
    k = torch.randn(batch, seq_len, k_heads, k_dim, device=device, dtype=dtype)
    v = torch.randn(batch, seq_len, v_heads, v_dim, device=device, dtype=dtype)
    # Qwen3.5's g = -exp(A_log) softplus(a + dt_bias) <= 0 and beta = sigmoid(b).
    g = -torch.nn.functional.softplus(torch.randn(batch, seq_len, v_heads, device=device)) * 0.5
    beta = torch.rand(batch, seq_len, v_heads, device=device, dtype=dtype)
    state = torch.randn(batch, v_heads, k_dim, v_dim, device=device) if with_initial_state else None
    return [x.requires_grad_() if x is not None else None for x in (q, k, v, g, beta, state)]


def _outputs_and_grads(fn, inputs, d_output, d_state):
    output, state = fn(*inputs, output_final_state=True, use_qk_l2norm_in_kernel=True)
    loss = (output.float() * d_output).sum() + (state * d_state).sum()
    leaves = [x for x in inputs if x is not None]
    return [output, state, *torch.autograd.grad(loss, leaves)]


NAMES = ["output", "final state", "dq", "dk", "dv", "dg", "dbeta", "d initial state"]


@pytest.mark.parametrize("seq_len", [1, 17, 64, 130])
@pytest.mark.parametrize("with_initial_state", [False, True])
@pytest.mark.parametrize("k_dim,v_dim", [(16, 32), (32, 16)])
def test_matches_the_recurrence_in_fp32(device, seq_len, with_initial_state, k_dim, v_dim):
    torch.manual_seed(seq_len + 7 * k_dim + int(with_initial_state))
    inputs = _inputs(1, seq_len, 2, 4, k_dim, v_dim, with_initial_state, device)
    d_output = torch.randn(1, seq_len, 4, v_dim, device=device)
    d_state = torch.randn(1, 4, k_dim, v_dim, device=device)
    ours = _outputs_and_grads(gated_delta_rule, inputs, d_output, d_state)
    expected = _outputs_and_grads(gated_delta_rule_reference, inputs, d_output, d_state)
    for name, a, e in zip(NAMES, ours, expected):
        if e.norm() == 0:  # dg of one token without an initial state: exp(g) scales a zero state
            assert a.abs().max() == 0, name
            continue
        assert relative_error(a, e) < FP32_BOUND, f"{name}: relative error {relative_error(a, e):.2e}"


def test_without_final_state_gradient_and_two_sequences(device):
    torch.manual_seed(3)
    q, k, v, g, beta, _ = _inputs(2, 70, 1, 2, 16, 16, False, device)
    ours, state = gated_delta_rule(q, k, v, g, beta)
    expected, _ = gated_delta_rule_reference(q, k, v, g, beta)
    assert state is None
    d_output = torch.randn_like(expected)
    grads = torch.autograd.grad((ours * d_output).sum(), (q, k, v, g, beta))
    expected_grads = torch.autograd.grad((expected * d_output).sum(), (q, k, v, g, beta))
    assert relative_error(ours, expected) < FP32_BOUND
    for name, a, e in zip(["dq", "dk", "dv", "dg", "dbeta"], grads, expected_grads):
        assert relative_error(a, e) < FP32_BOUND, f"{name}: relative error {relative_error(a, e):.2e}"


def test_head_dims_off_powers_of_two_and_value_features_over_two_programs(device):
    """dk = 24 (a masked 32-wide tile), dv = 48: two programs of 32 value features per head,
    whose partial dq, dk, dg, dbeta are summed."""
    torch.manual_seed(4)
    inputs = _inputs(1, 70, 1, 2, 24, 48, True, device)
    d_output = torch.randn(1, 70, 2, 48, device=device)
    d_state = torch.randn(1, 2, 24, 48, device=device)
    ours = _outputs_and_grads(gated_delta_rule, inputs, d_output, d_state)
    expected = _outputs_and_grads(gated_delta_rule_reference, inputs, d_output, d_state)
    for name, a, e in zip(NAMES, ours, expected):
        assert relative_error(a, e) < FP32_BOUND, f"{name}: relative error {relative_error(a, e):.2e}"


def test_fast_decays_keep_their_small_gradients(device):
    """Qwen3.5's decays reach g = -20 per position (exp(A_log) up to 16): the state is then
    nearly reset at each step and dg is small next to the chunk's terms it is made of
    (their rounding, 2^-24 of terms about ten times dg's size, is what is left: 1e-4)."""
    torch.manual_seed(5)
    q, k, v, _, beta, _ = _inputs(1, 100, 2, 4, 16, 16, False, device)
    g = (-20 * torch.rand(1, 100, 4, device=device)).requires_grad_()
    ours, _ = gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    expected, _ = gated_delta_rule_reference(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    d_output = torch.randn_like(expected)
    (d_g,) = torch.autograd.grad((ours * d_output).sum(), (g,))
    (expected_d_g,) = torch.autograd.grad((expected * d_output).sum(), (g,))
    assert relative_error(ours, expected) < FP32_BOUND
    assert relative_error(d_g, expected_d_g) < 1e-4, f"dg: {relative_error(d_g, expected_d_g):.2e}"


def test_refuses_value_heads_that_key_heads_do_not_divide(device):
    q, k, v, g, beta, _ = _inputs(1, 4, 2, 3, 16, 16, False, device)
    with pytest.raises(ValueError, match="multiple of 2"):
        gated_delta_rule(q, k, v, g, beta)


@pytest.mark.cuda
@pytest.mark.parametrize("k_heads,v_heads", [(16, 32), (16, 16)])
def test_matches_transformers_chunked_rule_at_qwen3_5_sizes_in_bf16(k_heads, v_heads):
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    torch.manual_seed(0)
    inputs = _inputs(1, 2048, k_heads, v_heads, 128, 128, True, "cuda", dtype=torch.bfloat16)
    d_output = torch.randn(1, 2048, v_heads, 128, device="cuda")
    d_state = torch.randn(1, v_heads, 128, 128, device="cuda")
    ours = _outputs_and_grads(gated_delta_rule, inputs, d_output, d_state)
    expected = _outputs_and_grads(torch_chunk_gated_delta_rule, inputs, d_output, d_state)
    for name, a, e in zip(NAMES, ours, expected):
        assert a.dtype == e.dtype, f"{name}: dtype {a.dtype} vs {e.dtype}"
        assert relative_error(a, e) < 1e-2, f"{name}: relative error {relative_error(a, e):.2e}"
