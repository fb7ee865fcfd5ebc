"""The gated delta rule as a naive per-token recurrence in fp32: the reference the
chunked kernels are checked against.

Per value head, with the state S of shape (dk, dv) and o_t = S_t^T q_t:

    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T

which is ``S <- exp(g) S`` followed by the delta update ``S += beta k (v - S^T k)^T``.
Query/key heads serve ``num_v_heads // num_k_heads`` consecutive value heads each (GQA);
queries are scaled by ``k_head_dim ** -0.5``, after an optional l2 normalisation of
queries and keys (``x / sqrt(sum x^2 + 1e-6)``).
"""

from __future__ import annotations

import torch

L2NORM_EPS = 1e-6


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(sum(x^2) + 1e-6) over the last dimension."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2NORM_EPS)


def prepare_queries_and_keys(
    query: torch.Tensor, key: torch.Tensor, use_qk_l2norm_in_kernel: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 queries and keys, l2-normalised if asked, queries scaled by k_head_dim ** -0.5."""
    query, key = query.float(), key.float()
    if use_qk_l2norm_in_kernel:
        query, key = l2norm(query), l2norm(key)
    return query * query.shape[-1] ** -0.5, key


def gated_delta_rule_reference(
    query: torch.Tensor,  # (B, T, HK, dk)
    key: torch.Tensor,  # (B, T, HK, dk)
    value: torch.Tensor,  # (B, T, HV, dv)
    g: torch.Tensor,  # (B, T, HV), log decay <= 0
    beta: torch.Tensor,  # (B, T, HV), in (0, 1)
    initial_state: torch.Tensor | None = None,  # (B, HV, dk, dv)
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Outputs (B, T, HV, dv) in query's dtype and, if asked, the final state (B, HV, dk, dv) in fp32."""
    out_dtype = query.dtype
    batch, seq_len, num_k_heads, k_dim = key.shape
    num_v_heads, v_dim = value.shape[-2:]
    query, key = prepare_queries_and_keys(query, key, use_qk_l2norm_in_kernel)
    group = num_v_heads // num_k_heads
    query = query.repeat_interleave(group, dim=2)
    key = key.repeat_interleave(group, dim=2)
    value, g, beta = value.float(), g.float(), beta.float()
    if initial_state is None:
        state = torch.zeros(batch, num_v_heads, k_dim, v_dim, dtype=torch.float32, device=value.device)
    else:
        state = initial_state.float()
    outputs = []
    for t in range(seq_len):
        q_t, k_t, v_t = query[:, t], key[:, t], value[:, t]  # (B, HV, d)
        state = state * g[:, t].exp()[..., None, None]
        predicted = (state * k_t[..., :, None]).sum(-2)
        delta = (v_t - predicted) * beta[:, t, :, None]
        state = state + k_t[..., :, None] * delta[..., None, :]
        outputs.append((state * q_t[..., :, None]).sum(-2))
    output = torch.stack(outputs, dim=1) if outputs else value.new_zeros(value.shape)
    return output.to(out_dtype), (state if output_final_state else None)
