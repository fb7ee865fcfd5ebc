"""Per-expert sums of outer products over the expert's rows, for the adapters' gradients:

    C_e = scale * sum over rows i of expert e of  (u_i U[src_u(i)])^T V[src_v(i)]     (P, Q)

with U (rows, P) and V (rows, Q) each read in sorted order or gathered by token, and U's
rows optionally scaled by a per-row weight u_i (the routing weight).  The LoRA gradients
of one expert projection Y = X W_e^T + s (X A_e^T) B_e^T are two of these:

    dA_e = s (dY_e B_e)^T X_e           U = dY B (rows, r),  V = X (rows, in)
    dB_e = s dY_e^T (X_e A_e^T)         U = dY (rows, out),   V = X A^T (rows, r)

A program owns one expert and one (BLOCK_P, BLOCK_Q) slab of C_e, and walks the
expert's rows BLOCK_M at a time, accumulating in fp32: every C_e is written by
programs of its own, with no atomics, so the result is deterministic, and an expert
that received no rows gets zeros.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slothkit_kernels.moe.grouped_gemm import dot_in_fp32
from slothkit_kernels.moe.routing import ExpertRouting
from slothkit_kernels.utils import interpreter_enabled


@triton.jit
def _expert_sums_kernel(
    U,  # pointer to the left rows, (M, P) sorted, or (T, P) read through ROWS when U_GATHER
    stride_um,  # U's row stride
    stride_up,  # U's column stride
    U_WEIGHT,  # pointer to a weight per sorted row, (M,) (U_WEIGHTED only)
    V,  # pointer to the right rows, (M, Q) sorted, or (T, Q) read through ROWS when V_GATHER
    stride_vm,  # V's row stride
    stride_vq,  # V's column stride
    ROWS,  # pointer to the token of each sorted row, (M,) int32
    C,  # pointer to the output, (E, P, Q)
    stride_ce,  # C's expert stride
    stride_cp,  # C's stride along P
    stride_cq,  # C's stride along Q
    OFFSETS,  # pointer to (E + 1,) int32: expert e's rows are OFFSETS[e] .. OFFSETS[e+1] - 1
    P,  # columns of U
    Q,  # columns of V
    scale,  # factor on every sum
    U_GATHER: tl.constexpr,  # read U's rows through ROWS
    V_GATHER: tl.constexpr,  # read V's rows through ROWS
    U_WEIGHTED: tl.constexpr,  # scale U's rows by U_WEIGHT
    DOT_FP32: tl.constexpr,  # multiply in fp32 (else 16-bit tensor cores, fp32 accumulation)
    BLOCK_M: tl.constexpr,  # rows per step
    BLOCK_P: tl.constexpr,  # rows of C per program
    BLOCK_Q: tl.constexpr,  # columns of C per program
):
    expert = tl.program_id(0)
    offs_p = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_q = tl.program_id(2) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    p_mask = offs_p < P
    q_mask = offs_q < Q
    start = tl.load(OFFSETS + expert)
    end = tl.load(OFFSETS + expert + 1)
    acc = tl.zeros((BLOCK_P, BLOCK_Q), dtype=tl.float32)
    for m0 in range(start, end, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        m_mask = offs_m < end
        u_rows = offs_m.to(tl.int64)
        v_rows = offs_m.to(tl.int64)
        if U_GATHER:
            u_rows = tl.load(ROWS + offs_m, mask=m_mask, other=0).to(tl.int64)
        if V_GATHER:
            v_rows = tl.load(ROWS + offs_m, mask=m_mask, other=0).to(tl.int64)
        u = tl.load(
            U + u_rows[:, None] * stride_um + offs_p[None, :] * stride_up,
            mask=m_mask[:, None] & p_mask[None, :],
            other=0.0,
        )  # (BLOCK_M, BLOCK_P)
        v = tl.load(
            V + v_rows[:, None] * stride_vm + offs_q[None, :] * stride_vq,
            mask=m_mask[:, None] & q_mask[None, :],
            other=0.0,
        )  # (BLOCK_M, BLOCK_Q)
        if U_WEIGHTED:
            weight = tl.load(U_WEIGHT + offs_m, mask=m_mask, other=0.0).to(tl.float32)
            u = (u.to(tl.float32) * weight[:, None]).to(u.dtype)
        if DOT_FP32:
            acc = tl.dot(tl.trans(u.to(tl.float32)), v.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(tl.trans(u), v.to(u.dtype), acc)
    c_ptrs = C + expert.to(tl.int64) * stride_ce + offs_p[:, None] * stride_cp + offs_q[None, :] * stride_cq
    tl.store(c_ptrs, (scale * acc).to(C.dtype.element_ty), mask=p_mask[:, None] & q_mask[None, :])


def _block(n: int, most: int) -> int:
    return min(most, max(16, triton.next_power_of_2(n)))


def expert_sums(
    u: torch.Tensor,
    v: torch.Tensor,
    routing: ExpertRouting,
    *,
    u_gather: bool = False,
    v_gather: bool = False,
    u_weight: torch.Tensor | None = None,
    scale: float = 1.0,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """C (E, P, Q): C_e = scale * sum over expert e's rows of (w_i u_i)^T v_i (module
    docstring), no autograd.  u_weight: (M,) per sorted row; out_dtype defaults to u's."""
    num_experts = routing.num_experts
    p, q = u.shape[1], v.shape[1]
    c = torch.empty((num_experts, p, q), dtype=out_dtype or u.dtype, device=u.device)
    if interpreter_enabled():
        block_m, block_p, block_q, warps = 16, _block(p, 32), _block(q, 32), 4
    else:
        block_m, block_p, block_q, warps = 64, _block(p, 64), _block(q, 128), 4
    grid = (num_experts, triton.cdiv(p, block_p), triton.cdiv(q, block_q))
    _expert_sums_kernel[grid](
        u, u.stride(0), u.stride(1),
        u_weight if u_weight is not None else u,
        v, v.stride(0), v.stride(1),
        routing.tokens,
        c, *c.stride(),
        routing.offsets,
        p, q, float(scale),
        U_GATHER=u_gather,
        V_GATHER=v_gather,
        U_WEIGHTED=u_weight is not None,
        DOT_FP32=dot_in_fp32(u.dtype),
        BLOCK_M=block_m,
        BLOCK_P=block_p,
        BLOCK_Q=block_q,
        num_warps=warps,
    )  # fmt: skip
    return c
