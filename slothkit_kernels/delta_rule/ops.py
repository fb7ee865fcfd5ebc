"""``gated_delta_rule``: the chunked gated delta rule as a differentiable op, with the
arguments and results of transformers' ``torch_chunk_gated_delta_rule``.

The l2 normalisation and scaling of queries and keys run in torch (autograd takes their
backward); the Function launches three kernels forward (ut_inverse, forward) and one
backward, and sums the backward's partial gradients over value-feature blocks and over
the value heads that share a query/key head.
"""

from __future__ import annotations

import torch
import triton

from slothkit_kernels.delta_rule.backward import delta_rule_backward_kernel
from slothkit_kernels.delta_rule.forward import delta_rule_forward_kernel
from slothkit_kernels.delta_rule.reference import gated_delta_rule_reference, prepare_queries_and_keys
from slothkit_kernels.delta_rule.ut_inverse import ut_inverse_kernel
from slothkit_kernels.utils import check_float_dtype, check_same_device, use_triton, warn_reference_once

# Positions per chunk: the size of the triangular system each chunk solves.
CHUNK = 64
# Largest key/value head dim: a program holds a (dk, value block) state and (C, dk) tiles.
MAX_HEAD_DIM = 256
# Value features per program: a head's dv = 128 makes 4 programs, each with smaller tiles.
VALUE_BLOCK = 32
NUM_WARPS = 4
# The walks carry the state from one chunk to the next; their loads are not pipelined
# across chunks, which would multiply the shared memory the large tiles already need.
NUM_STAGES = 1


class _GatedDeltaRuleFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, g, beta, initial_state, output_final_state):
        batch, seq_len, num_k_heads, k_dim = key.shape
        num_v_heads, v_dim = value.shape[-2:]
        query, key, value, g, beta = (t.contiguous() for t in (query, key, value, g, beta))
        n_chunks = triton.cdiv(seq_len, CHUNK)
        block_k = max(16, triton.next_power_of_2(k_dim))
        block_v = min(VALUE_BLOCK, max(16, triton.next_power_of_2(v_dim)))
        n_value_blocks = triton.cdiv(v_dim, block_v)
        f32 = dict(dtype=torch.float32, device=value.device)
        tinv = torch.empty(batch, num_v_heads, n_chunks, CHUNK, CHUNK, **f32)
        output = torch.empty(batch, seq_len, num_v_heads, v_dim, **f32)
        states = torch.empty(batch, num_v_heads, n_chunks, k_dim, v_dim, **f32)
        final_state = torch.empty(batch, num_v_heads, k_dim, v_dim, **f32)
        has_initial = initial_state is not None
        # fp32 values keep fp32 products (a float32 model's rounding); 16-bit ones lose more
        # in their own rounding than tf32's 10-bit mantissa adds.
        ctx.precision = "ieee" if value.dtype == torch.float32 else "tf32"
        initial = initial_state.contiguous() if has_initial else final_state  # never read when absent
        shape_args = (seq_len, num_k_heads, num_v_heads, k_dim)
        ut_inverse_kernel[(n_chunks, batch * num_v_heads)](
            key, g, beta, tinv, *shape_args, num_v_heads // num_k_heads, n_chunks, C=CHUNK, BK=block_k
        )
        delta_rule_forward_kernel[(n_value_blocks, batch * num_v_heads)](
            query,
            key,
            value,
            g,
            beta,
            tinv,
            initial,
            output,
            states,
            final_state,
            *shape_args,
            v_dim,
            num_v_heads // num_k_heads,
            n_chunks,
            HAS_H0=has_initial,
            C=CHUNK,
            BK=block_k,
            BV=block_v,
            num_warps=NUM_WARPS,
            PRECISION=ctx.precision,
            num_stages=NUM_STAGES,
        )
        ctx.save_for_backward(query, key, value, g, beta, tinv, states)
        ctx.settings = (block_k, block_v, n_value_blocks, n_chunks)
        ctx.dtypes = (query.dtype, key.dtype, value.dtype, g.dtype, beta.dtype)
        ctx.initial_dtype = initial_state.dtype if has_initial else None
        return output.to(query.dtype), final_state

    @staticmethod
    def backward(ctx, d_output, d_final_state):
        query, key, value, g, beta, tinv, states = ctx.saved_tensors
        block_k, block_v, n_value_blocks, n_chunks = ctx.settings
        batch, seq_len, num_k_heads, k_dim = key.shape
        num_v_heads, v_dim = value.shape[-2:]
        group = num_v_heads // num_k_heads
        f32 = dict(dtype=torch.float32, device=value.device)
        d_q = torch.empty(n_value_blocks, batch, seq_len, num_v_heads, k_dim, **f32)
        d_k = torch.empty_like(d_q)
        d_v = torch.empty(batch, seq_len, num_v_heads, v_dim, **f32)
        d_beta = torch.empty(n_value_blocks, batch, seq_len, num_v_heads, **f32)
        d_g = torch.empty_like(d_beta)
        d_initial = torch.empty(batch, num_v_heads, k_dim, v_dim, **f32)
        has_d_final = d_final_state is not None
        delta_rule_backward_kernel[(n_value_blocks, batch * num_v_heads)](
            query,
            key,
            value,
            g,
            beta,
            tinv,
            states,
            d_output.contiguous(),
            d_final_state.contiguous() if has_d_final else d_initial,  # never read when absent
            d_q,
            d_k,
            d_v,
            d_beta,
            d_g,
            d_initial,
            batch,
            seq_len,
            num_k_heads,
            num_v_heads,
            k_dim,
            v_dim,
            group,
            n_chunks,
            HAS_DHT=has_d_final,
            C=CHUNK,
            BK=block_k,
            BV=block_v,
            num_warps=NUM_WARPS,
            PRECISION=ctx.precision,
            num_stages=NUM_STAGES,
        )
        # (NV, B, T, HV, dk) -> (B, T, HK, dk): sum the value blocks, then each key head's group.
        d_q = d_q.sum(0).view(batch, seq_len, num_k_heads, group, k_dim).sum(3)
        d_k = d_k.sum(0).view(batch, seq_len, num_k_heads, group, k_dim).sum(3)
        q_dtype, k_dtype, v_dtype, g_dtype, beta_dtype = ctx.dtypes
        return (
            d_q.to(q_dtype),
            d_k.to(k_dtype),
            d_v.to(v_dtype),
            d_g.sum(0).to(g_dtype),
            d_beta.sum(0).to(beta_dtype),
            d_initial.to(ctx.initial_dtype) if ctx.initial_dtype is not None else None,
            None,
        )


def _check_inputs(query, key, value, g, beta, initial_state) -> None:
    for name, tensor in (("query", query), ("key", key), ("value", value), ("g", g), ("beta", beta)):
        check_float_dtype(f"gated_delta_rule: {name}", tensor)
    check_same_device(query=query, key=key, value=value, g=g, beta=beta, initial_state=initial_state)
    if query.dim() != 4 or query.shape != key.shape:
        raise ValueError(
            f"gated_delta_rule: query {tuple(query.shape)} and key {tuple(key.shape)} must both be "
            f"(batch, seq_len, num_k_heads, k_head_dim)"
        )
    batch, seq_len, num_k_heads, k_dim = key.shape
    if value.dim() != 4 or value.shape[:2] != (batch, seq_len) or value.shape[2] % num_k_heads:
        raise ValueError(
            f"gated_delta_rule: value has shape {tuple(value.shape)}; expected (batch={batch}, "
            f"seq_len={seq_len}, num_v_heads, v_head_dim) with num_v_heads a multiple of {num_k_heads}"
        )
    num_v_heads, v_dim = value.shape[2:]
    for name, tensor in (("g", g), ("beta", beta)):
        if tensor.shape != (batch, seq_len, num_v_heads):
            raise ValueError(
                f"gated_delta_rule: {name} has shape {tuple(tensor.shape)}; expected "
                f"(batch, seq_len, num_v_heads) = {(batch, seq_len, num_v_heads)}"
            )
    if initial_state is not None and initial_state.shape != (batch, num_v_heads, k_dim, v_dim):
        raise ValueError(
            f"gated_delta_rule: initial_state has shape {tuple(initial_state.shape)}; expected "
            f"(batch, num_v_heads, k_head_dim, v_head_dim) = {(batch, num_v_heads, k_dim, v_dim)}"
        )
    if max(k_dim, v_dim) > MAX_HEAD_DIM:
        raise ValueError(
            f"gated_delta_rule: head dims k={k_dim}, v={v_dim}; the kernels hold at most {MAX_HEAD_DIM}"
        )


def gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule over whole sequences, chunked, differentiable in every input.

    Args:
        query, key: (batch, seq_len, num_k_heads, k_head_dim).
        value: (batch, seq_len, num_v_heads, v_head_dim); num_v_heads a multiple of
            num_k_heads, each query/key head serving that many consecutive value heads.
        g: (batch, seq_len, num_v_heads) log decays, <= 0.
        beta: (batch, seq_len, num_v_heads) update strengths, in (0, 1).
        initial_state: optional (batch, num_v_heads, k_head_dim, v_head_dim) state.
        output_final_state: whether to return the state after the last position.
        use_qk_l2norm_in_kernel: l2-normalise queries and keys first (in fp32).

    Returns:
        The output (batch, seq_len, num_v_heads, v_head_dim) in query's dtype, and the final
        state (batch, num_v_heads, k_head_dim, v_head_dim) in fp32 or None.
    """
    _check_inputs(query, key, value, g, beta, initial_state)
    if not use_triton(query):
        warn_reference_once("gated_delta_rule", query.device.type)
        return gated_delta_rule_reference(
            query, key, value, g, beta, initial_state, output_final_state, use_qk_l2norm_in_kernel
        )
    out_dtype = query.dtype
    query, key = prepare_queries_and_keys(query, key, use_qk_l2norm_in_kernel)
    output, final_state = _GatedDeltaRuleFunction.apply(
        query, key, value, g, beta, initial_state, output_final_state
    )
    return output.to(out_dtype), (final_state if output_final_state else None)
