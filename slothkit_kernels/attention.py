"""Causal attention with optional score soft-capping, an additive mask, a sliding window
and per-head sink logits, in tiles: the (T, S) score matrix is never written to memory.

For one query row q_i (absolute position p_i = S - T + i: the queries are the last T
of the S keys) and keys k_j, with c the soft-cap (Gemma 2's attn_logit_softcapping):

    s_ij = scaling * q_i . k_j
    z_ij = c * tanh(s_ij / c)                          (z = s without a cap)
         + mask_ij                                     (additive: 0 or a large negative)
         - inf where j > p_i (causal) or p_i - j >= W (window W)
    P_ij = exp(z_ij - lse_i),   lse_i = log(exp(sink_h) + sum_j exp(z_ij))
    o_i  = sum_j P_ij v_j

A sink (gpt-oss's per-head ``sinks``) is one more logit in every row of query head h that
takes part in the softmax's denominator and has no value: it draws weight away from the
keys, so a row's P sums to 1 - exp(sink_h - lse_i).  Without sinks the exp(sink_h) term
is absent (sink_h = -inf).  transformers' gpt-oss eager attention computes the same by
appending the sink as an extra column of the scores, taking the softmax (after
subtracting the row maximum, which changes nothing) and dropping that column.

This is transformers' eager attention (scores, cap, mask, fp32 softmax, values) computed
the flash-attention way: each program keeps a running row maximum m, sum l and output
accumulator over key tiles, rescaling by exp(m_old - m_new) when the maximum grows, and
saves m_i and log l_i (lse_i = m_i + log l_i) for the backward pass.  With a sink the
running pair starts from the sink itself, (m, l) = (sink_h, 1), rather than (-inf, 0);
the accumulator starts at 0 as the sink has no value.  Grouped-query attention: query
head h reads key/value head h // (Hq / Hkv).

Backward, with g_i = dL/do_i and D_i = sum_d g_id o_id (= sum_j P_ij g_i . v_j):

    dv_j  = sum_i P_ij g_i
    dP_ij = g_i . v_j
    dz_ij = P_ij (dP_ij - D_i)                         (softmax's Jacobian)
    ds_ij = dz_ij (1 - tanh^2(s_ij / c))               (dz/ds of the cap; 1 without one)
    dq_i  = scaling * sum_j ds_ij k_j,   dk_j = scaling * sum_i ds_ij q_i

The sink is a column whose value is 0, so dP_i,sink = g_i . 0 = 0 and the keys' dz above
is unchanged (lse_i, saved, already holds the sink).  Its own gradient, with
P_i,sink = exp(sink_h - lse_i), is that column's dz summed over the rows it joins (every
query of head h, in every batch row):

    d sink_h = sum_(b, i) P_i,sink (0 - D_i) = -sum_(b, i) exp(sink_h - lse_i) D_i

computed in torch from the saved row statistics and D.

The mask is a constant (no gradient).  P is recomputed from the saved row maximum and log-sum, once in the
kernel that owns a key tile (dk, dv: summed over the query tiles and the query heads that
share the key head, with no atomics) and once in the kernel that owns a query tile (dq).

Tiles wholly above the diagonal, or wholly outside the window, are skipped; the mask is
still applied in full, so a window or padding that only the mask knows is honoured.  A row
whose every causal key the mask hides (a padding row under left padding) weighs those keys
alike, as the mask's huge negative value swamps the scores; transformers' eager attention,
whose causal rule is in the mask too, weighs all S keys alike there.  Such rows are the
padding's own outputs, which reach no loss.
Everything is fp32 inside; the two products of each step read 16-bit operands in their
own dtype on a GPU (the tensor cores) and fp32 in full precision (no TF32), and all of
them in fp32 under the interpreter, which gets bf16 arithmetic wrong.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from slothkit_kernels.utils import (
    check_float_dtype,
    check_same_device,
    interpreter_enabled,
    tanh,
    use_triton,
    warn_reference_once,
)


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scaling: float,
    mask: torch.Tensor | None = None,
    softcap: float | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The same function in plain torch, as transformers' eager attention computes it
    (gpt-oss's with ``sinks``: an extra column of the scores, dropped after the softmax).

    q: (B, Hq, T, D); k, v: (B, Hkv, S, D); sinks: (Hq,). Returns (B, T, Hq, D)."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = (q @ k.transpose(-1, -2)) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.float() + _visible_keys(q.shape[2], k.shape[2], window, q.device)
    if mask is not None:
        scores = scores + _additive(mask, q.shape[2], k.shape[2]).unsqueeze(1).float()
    if sinks is not None:
        batch, heads, q_len, _ = scores.shape
        column = sinks.float().reshape(1, heads, 1, 1).expand(batch, heads, q_len, 1)
        probabilities = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1].to(q.dtype)
        return (probabilities @ v).transpose(1, 2).contiguous()
    probabilities = torch.softmax(scores, dim=-1).to(q.dtype)
    return (probabilities @ v).transpose(1, 2).contiguous()


def _visible_keys(q_len: int, kv_len: int, window: int | None, device) -> torch.Tensor:
    """0 where query i may see key j (causal, inside the window), -inf elsewhere."""
    position = torch.arange(q_len, device=device)[:, None] + (kv_len - q_len)
    key = torch.arange(kv_len, device=device)[None, :]
    visible = key <= position
    if window is not None:
        visible &= position - key < window
    return torch.zeros(visible.shape, device=device).masked_fill(~visible, float("-inf"))


def _additive(mask: torch.Tensor, q_len: int, kv_len: int) -> torch.Tensor:
    """A (B or 1, [1,] T, >= S) mask as (B or 1, T, S): additive as given, or from a boolean
    one (True: attend) as 0 / the dtype's lowest value, as transformers builds it."""
    if mask.dim() == 4:
        if mask.shape[1] != 1:
            raise ValueError(f"mask must have one head (B, 1, T, S); got shape {tuple(mask.shape)}")
        mask = mask[:, 0]
    if mask.dim() != 3 or mask.shape[1] != q_len or mask.shape[2] < kv_len:
        raise ValueError(
            f"mask must be (B, 1, T, S) or (B, T, S) with T = {q_len} queries and at least "
            f"S = {kv_len} keys; got shape {tuple(mask.shape)}"
        )
    mask = mask[:, :, :kv_len]
    if mask.dtype == torch.bool:
        lowest = torch.finfo(torch.float32).min
        return torch.zeros(mask.shape, device=mask.device).masked_fill(~mask, lowest)
    return mask


@triton.jit
def _scores(
    q,  # (BLOCK_M, BLOCK_D) query tile, fp32 or the dot's dtype
    k,  # (BLOCK_N, BLOCK_D) key tile
    MASK,  # pointer to this batch row's mask, (T, S) with the given strides
    stride_mt,
    stride_ms,
    offs_m,  # (BLOCK_M,) query indices 0..T-1
    offs_n,  # (BLOCK_N,) key indices 0..S-1
    q_len,
    kv_len,
    scaling,
    softcap,
    window,
    HAS_MASK: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    IEEE: tl.constexpr,
):
    """z (the capped, masked scores) and t = tanh(s / c) (0 without a cap), both fp32."""
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scaling
    else:
        s = tl.dot(q, tl.trans(k)) * scaling
    t = tl.zeros_like(s)
    if HAS_SOFTCAP:
        t = tanh(s / softcap)
        z = softcap * t
    else:
        z = s
    position = offs_m + (kv_len - q_len)
    visible = (offs_n[None, :] <= position[:, None]) & (offs_n[None, :] < kv_len)
    if HAS_WINDOW:
        visible = visible & (position[:, None] - offs_n[None, :] < window)
    if HAS_MASK:
        in_bounds = (offs_m[:, None] < q_len) & (offs_n[None, :] < kv_len)
        tile = tl.load(
            MASK + offs_m[:, None] * stride_mt + offs_n[None, :] * stride_ms, mask=in_bounds, other=0.0
        )
        z = z + tile.to(tl.float32)
    z = tl.where(visible, z, float("-inf"))
    return z, t


@triton.jit
def _load_tile(HEAD, offs, stride_t, offs_d, stride_d, length, head_dim, DOT_FP32: tl.constexpr):
    """Rows `offs` (< length) of one head's (length, head_dim) matrix, zero-padded to the
    tile; in fp32 when the products run in fp32."""
    rows_in = (offs[:, None] < length) & (offs_d[None, :] < head_dim)
    tile = tl.load(HEAD + offs[:, None] * stride_t + offs_d[None, :] * stride_d, mask=rows_in, other=0.0)
    if DOT_FP32:
        tile = tile.to(tl.float32)
    return tile


@triton.jit
def _load_row_stats(ROW_MAX, LOG_SUM, DELTA, row, offs_m, m_in):
    """The forward pass's row maximum and log-sum, and D = rowsum(dout * out), for rows
    `offs_m` of one head (its rows start at `row`)."""
    row_max = tl.load(ROW_MAX + row + offs_m, mask=m_in, other=0.0)
    log_sum = tl.load(LOG_SUM + row + offs_m, mask=m_in, other=0.0)
    delta = tl.load(DELTA + row + offs_m, mask=m_in, other=0.0)
    return row_max, log_sum, delta


@triton.jit
def _key_range(
    start_m, q_len, kv_len, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr
):
    """The key tiles a query tile can see: [lo, hi), lo a multiple of BLOCK_N."""
    offset = kv_len - q_len
    hi = tl.minimum(kv_len, offset + (start_m + 1) * BLOCK_M)  # causal: no key past the last query
    lo = 0
    if HAS_WINDOW:  # key j is seen by query position p only when p - j < window
        lo = tl.maximum(0, offset + start_m * BLOCK_M - window + 1)
        lo = (lo // BLOCK_N) * BLOCK_N
    return lo, hi


@triton.jit
def _attention_forward_kernel(
    Q,  # (B, Hq, T, D), any strides
    K,  # (B, Hkv, S, D)
    V,  # (B, Hkv, S, D)
    MASK,  # (B or 1, T, S) additive mask (unused unless HAS_MASK)
    SINKS,  # (Hq,) sink logits, any float dtype (unused unless HAS_SINKS)
    OUT,  # (B, T, Hq, D) contiguous, written
    ROW_MAX,  # (B, Hq, T) fp32 contiguous, written: each row's largest score (or sink)
    LOG_SUM,  # (B, Hq, T) fp32 contiguous, written: log (exp(sink - max) + sum_j exp(z_ij - max))
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_mb, stride_mt, stride_ms,
    n_q_heads, group, q_len, kv_len, head_dim,
    scaling, softcap, window,
    HAS_MASK: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    DOT_FP32: tl.constexpr,  # fp32 operands for the products (fp32 inputs, or the interpreter)
    IEEE: tl.constexpr,  # full-precision fp32 products (no TF32)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    start_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // n_q_heads).to(tl.int64)
    h = bh % n_q_heads
    kv_h = (h // group).to(tl.int64)
    h = h.to(tl.int64)

    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_in = offs_m < q_len
    d_in = offs_d < head_dim
    q = _load_tile(
        Q + b * stride_qb + h * stride_qh, offs_m, stride_qt, offs_d, stride_qd, q_len, head_dim, DOT_FP32
    )
    K_head = K + b * stride_kb + kv_h * stride_kh
    V_head = V + b * stride_vb + kv_h * stride_vh
    MASK_row = MASK + b * stride_mb

    if HAS_SINKS:  # the sink is the row's first logit: exp(sink - m) = 1 with m = sink
        row_max = tl.zeros((BLOCK_M,), tl.float32) + tl.load(SINKS + h).to(tl.float32)
        row_sum = tl.full((BLOCK_M,), 1.0, tl.float32)
    else:
        row_max = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        row_sum = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    lo, hi = _key_range(start_m, q_len, kv_len, window, BLOCK_M, BLOCK_N, HAS_WINDOW)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = _load_tile(K_head, offs_n, stride_kt, offs_d, stride_kd, kv_len, head_dim, DOT_FP32)
        v = _load_tile(V_head, offs_n, stride_vt, offs_d, stride_vd, kv_len, head_dim, DOT_FP32)
        z, _ = _scores(
            q, k, MASK_row, stride_mt, stride_ms, offs_m, offs_n, q_len, kv_len,
            scaling, softcap, window, HAS_MASK, HAS_SOFTCAP, HAS_WINDOW, IEEE,
        )  # fmt: skip
        new_max = tl.maximum(row_max, tl.max(z, axis=1))
        # A row that has seen no visible key yet keeps -inf: subtract 0 instead, so that
        # exp(-inf - -inf) never makes a NaN.
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        rescale = tl.exp(row_max - safe_max)
        p = tl.exp(z - safe_max[:, None])
        row_sum = row_sum * rescale + tl.sum(p, axis=1)
        acc = acc * rescale[:, None]
        if IEEE:
            acc += tl.dot(p, v, input_precision="ieee")
        else:
            acc += tl.dot(p.to(v.dtype), v)
        row_max = new_max

    # Every causal row sees at least its own key (or holds its sink), so row_sum > 0 for
    # real rows.
    row_sum = tl.where(row_sum == 0.0, 1.0, row_sum)
    out = acc / row_sum[:, None]
    out_ptrs = OUT + b * q_len * n_q_heads * head_dim + offs_m[:, None] * (n_q_heads * head_dim)
    out_ptrs += h * head_dim + offs_d[None, :]
    tl.store(out_ptrs, out.to(OUT.dtype.element_ty), mask=m_in[:, None] & d_in[None, :])
    # lse = row_max + log(row_sum), kept as its two terms: under an additive mask of the
    # dtype's lowest value (-3.4e38) a fully masked row's maximum is so large that adding
    # log(row_sum) would be lost to rounding, and exp(z - lse) would be off by row_sum.
    row = (b * n_q_heads + h) * q_len + offs_m
    tl.store(ROW_MAX + row, tl.where(row_max == float("-inf"), 0.0, row_max), mask=m_in)
    tl.store(LOG_SUM + row, tl.log(row_sum), mask=m_in)


@triton.jit
def _attention_backward_kv_kernel(
    Q, K, V, MASK, DO, ROW_MAX, LOG_SUM, DELTA,  # DO: (B, T, Hq, D); the rest (B, Hq, T) fp32
    DK, DV,  # (B, Hkv, S, D) contiguous, written
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_mb, stride_mt, stride_ms,
    n_q_heads, group, q_len, kv_len, head_dim,
    scaling, softcap, window,
    HAS_MASK: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    DOT_FP32: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    start_n = tl.program_id(0)
    bh = tl.program_id(1)
    n_kv_heads = n_q_heads // group
    b = (bh // n_kv_heads).to(tl.int64)
    kv_h = (bh % n_kv_heads).to(tl.int64)

    offs_n = start_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_in = offs_d < head_dim
    kv_mask = (offs_n[:, None] < kv_len) & d_in[None, :]
    k = _load_tile(
        K + b * stride_kb + kv_h * stride_kh, offs_n, stride_kt, offs_d, stride_kd, kv_len, head_dim, DOT_FP32
    )
    v = _load_tile(
        V + b * stride_vb + kv_h * stride_vh, offs_n, stride_vt, offs_d, stride_vd, kv_len, head_dim, DOT_FP32
    )
    MASK_row = MASK + b * stride_mb
    dk = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)

    offset = kv_len - q_len
    # Queries that can see this key tile: positions p >= its first key (causal) and, with a
    # window, p < its last key + window.
    m_lo = tl.maximum(0, start_n * BLOCK_N - offset)
    m_lo = (m_lo // BLOCK_M) * BLOCK_M
    m_hi = q_len
    if HAS_WINDOW:
        m_hi = tl.minimum(q_len, (start_n + 1) * BLOCK_N - 1 + window - offset)
    for g in range(0, group):
        h = kv_h * group + g
        Q_head = Q + b * stride_qb + h * stride_qh
        DO_head = DO + b * q_len * n_q_heads * head_dim + h * head_dim  # (T, D) rows Hq * D apart
        row = (b * n_q_heads + h) * q_len
        for start_m in range(m_lo, m_hi, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            m_in = offs_m < q_len
            q = _load_tile(Q_head, offs_m, stride_qt, offs_d, stride_qd, q_len, head_dim, DOT_FP32)
            do = _load_tile(DO_head, offs_m, n_q_heads * head_dim, offs_d, 1, q_len, head_dim, DOT_FP32)
            row_max, log_sum, delta = _load_row_stats(ROW_MAX, LOG_SUM, DELTA, row, offs_m, m_in)
            z, t = _scores(
                q, k, MASK_row, stride_mt, stride_ms, offs_m, offs_n, q_len, kv_len,
                scaling, softcap, window, HAS_MASK, HAS_SOFTCAP, HAS_WINDOW, IEEE,
            )  # fmt: skip
            p = tl.exp((z - row_max[:, None]) - log_sum[:, None])  # (BLOCK_M, BLOCK_N); 0 where hidden
            p = tl.where(m_in[:, None], p, 0.0)
            if IEEE:
                dv += tl.dot(tl.trans(p), do, input_precision="ieee")
                dp = tl.dot(do, tl.trans(v), input_precision="ieee")
            else:
                dv += tl.dot(tl.trans(p.to(do.dtype)), do)
                dp = tl.dot(do, tl.trans(v))
            ds = p * (dp - delta[:, None])
            if HAS_SOFTCAP:
                ds = ds * (1.0 - t * t)
            if IEEE:
                dk += tl.dot(tl.trans(ds), q, input_precision="ieee")
            else:
                dk += tl.dot(tl.trans(ds.to(q.dtype)), q)

    out = (b * n_kv_heads + kv_h) * kv_len * head_dim + offs_n[:, None] * head_dim + offs_d[None, :]
    tl.store(DK + out, (dk * scaling).to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _attention_backward_q_kernel(
    Q, K, V, MASK, DO, ROW_MAX, LOG_SUM, DELTA,
    DQ,  # (B, Hq, T, D) contiguous, written
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_mb, stride_mt, stride_ms,
    n_q_heads, group, q_len, kv_len, head_dim,
    scaling, softcap, window,
    HAS_MASK: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    DOT_FP32: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    start_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // n_q_heads).to(tl.int64)
    h = bh % n_q_heads
    kv_h = (h // group).to(tl.int64)
    h = h.to(tl.int64)

    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_in = offs_m < q_len
    d_in = offs_d < head_dim
    q_mask = m_in[:, None] & d_in[None, :]
    q = _load_tile(
        Q + b * stride_qb + h * stride_qh, offs_m, stride_qt, offs_d, stride_qd, q_len, head_dim, DOT_FP32
    )
    DO_head = DO + b * q_len * n_q_heads * head_dim + h * head_dim  # (T, D) rows Hq * D apart
    do = _load_tile(DO_head, offs_m, n_q_heads * head_dim, offs_d, 1, q_len, head_dim, DOT_FP32)
    row = (b * n_q_heads + h) * q_len
    row_max, log_sum, delta = _load_row_stats(ROW_MAX, LOG_SUM, DELTA, row, offs_m, m_in)
    K_head = K + b * stride_kb + kv_h * stride_kh
    V_head = V + b * stride_vb + kv_h * stride_vh
    MASK_row = MASK + b * stride_mb

    dq = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    lo, hi = _key_range(start_m, q_len, kv_len, window, BLOCK_M, BLOCK_N, HAS_WINDOW)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = _load_tile(K_head, offs_n, stride_kt, offs_d, stride_kd, kv_len, head_dim, DOT_FP32)
        v = _load_tile(V_head, offs_n, stride_vt, offs_d, stride_vd, kv_len, head_dim, DOT_FP32)
        z, t = _scores(
            q, k, MASK_row, stride_mt, stride_ms, offs_m, offs_n, q_len, kv_len,
            scaling, softcap, window, HAS_MASK, HAS_SOFTCAP, HAS_WINDOW, IEEE,
        )  # fmt: skip
        p = tl.exp((z - row_max[:, None]) - log_sum[:, None])
        if IEEE:
            dp = tl.dot(do, tl.trans(v), input_precision="ieee")
        else:
            dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        if HAS_SOFTCAP:
            ds = ds * (1.0 - t * t)
        if IEEE:
            dq += tl.dot(ds, k, input_precision="ieee")
        else:
            dq += tl.dot(ds.to(k.dtype), k)

    out = (b * n_q_heads + h) * q_len * head_dim + offs_m[:, None] * head_dim + offs_d[None, :]
    tl.store(DQ + out, (dq * scaling).to(DQ.dtype.element_ty), mask=q_mask)


class Tiles(NamedTuple):
    """One kernel's launch: the query and key tile heights, warps and pipeline stages."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# Launches measured fastest by scripts/tune_attention.py, per head width, on GPUs with
# at least 200 KB of shared memory per block (H100, H200); elsewhere (a T4 has 64 KB, an
# A100 164 KB) the small tiles of _small_tiles, which fit 64 KB.
_LARGE_SHARED_MEMORY = 200 * 1024
# Gemma-2-9B's shape (2 x 16/8 heads x 2048 x 256, soft-capped, eager's causal mask):
# forward 0.41 ms against 1.32 with the small tiles, each backward kernel about 0.7 ms
# against 1.76; Gemma-2-27B's (2 x 32/16 x 2048 x 128): forward 0.46 against 1.00.
_TUNED: dict[int, tuple[Tiles, Tiles, Tiles]] = {  # head width: (forward, backward_kv, backward_q)
    256: (Tiles(128, 64, 8, 2), Tiles(64, 32, 4, 2), Tiles(64, 32, 4, 1)),
    128: (Tiles(64, 32, 4, 3), Tiles(64, 64, 4, 1), Tiles(64, 32, 4, 1)),
}


def _small_tiles(block_d: int, kernel: str) -> Tiles:
    """Tiles that fit 64 KB of shared memory: a 256-wide head keeps one stage of 32-row
    tiles (the backward holds q, do, k, v and two accumulators at once)."""
    block = 64 if block_d <= 128 and kernel == "forward" else 32
    if block_d <= 64:
        block = 64
    return Tiles(block, block, 4 if block_d <= 64 else 8, 2 if block_d <= 128 else 1)


def _shared_memory(device: torch.device) -> int:
    """Shared memory per block on `device`, in bytes (0 off a CUDA GPU)."""
    if device.type != "cuda":
        return 0
    return _cuda_shared_memory(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_shared_memory(index: int) -> int:
    # Asked of the driver once per GPU: one query took 1.4 ms on an H200 host, four times
    # the soft-capped forward kernel at Gemma-2-9B's training shape.
    return triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"]


def tiles_for(kernel: str, head_dim: int, q_len: int, kv_len: int, device: torch.device) -> Tiles:
    """The launch of `kernel` ("forward", "backward_kv" or "backward_q"); tl.dot needs
    every side >= 16, so short sequences shrink the tiles to at least 16 rows."""
    block_d = _block_d(head_dim)
    tiles = _small_tiles(block_d, kernel)
    if block_d in _TUNED and _shared_memory(device) >= _LARGE_SHARED_MEMORY:
        tiles = _TUNED[block_d][("forward", "backward_kv", "backward_q").index(kernel)]
    return tiles._replace(
        block_m=max(16, min(tiles.block_m, triton.next_power_of_2(q_len))),
        block_n=max(16, min(tiles.block_n, triton.next_power_of_2(kv_len))),
    )


def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def _launch(tiles: Tiles, head_dim: int) -> dict:
    return {
        "BLOCK_M": tiles.block_m,
        "BLOCK_N": tiles.block_n,
        "BLOCK_D": _block_d(head_dim),
        "num_warps": tiles.num_warps,
        "num_stages": tiles.num_stages,
    }


def _launch_arguments(q, k, v, mask3, scaling, softcap, window):
    """The arguments every kernel takes after its tensors, in order: q's, k's, v's and the
    mask's strides, the sizes, the settings, and the constexpr flags."""
    mask_strides = (0, 0, 0)
    if mask3 is not None:
        mask_strides = (mask3.stride(0) if mask3.shape[0] > 1 else 0, mask3.stride(1), mask3.stride(2))
    batch, n_q_heads, q_len, head_dim = q.shape
    sizes = (n_q_heads, n_q_heads // k.shape[1], q_len, k.shape[2], head_dim)
    settings = (float(scaling), float(softcap or 0.0), int(window or 0))
    return (*q.stride(), *k.stride(), *v.stride(), *mask_strides, *sizes, *settings), _flags(
        q, mask3, softcap, window
    )


def _smaller(tiles: Tiles) -> Tiles | None:
    """The next smaller launch: one pipeline stage, then the taller tile halved (to 16
    rows at least); None when nothing is left to shrink."""
    if tiles.num_stages > 1:
        return tiles._replace(num_stages=1)
    if max(tiles.block_m, tiles.block_n) > 16:
        if tiles.block_m >= tiles.block_n:
            return tiles._replace(block_m=tiles.block_m // 2)
        return tiles._replace(block_n=tiles.block_n // 2)
    return None


def _launch_fitting(kernel, grid, tiles: Tiles, head_dim: int, *args, **flags) -> None:
    """``kernel`` launched over ``grid(tiles)``, or with the largest smaller tiles that
    fit: the tuned tiles assume 16-bit operands, and fp32 ones (4 bytes an element) or a
    GPU with less shared memory can need more than a block has, which Triton reports as
    OutOfResources when it compiles the launch."""
    while True:
        try:
            kernel[grid(tiles)](*args, **flags, **_launch(tiles, head_dim))
            return
        except triton.runtime.errors.OutOfResources:
            smaller = _smaller(tiles)
            if smaller is None:
                raise
            tiles = smaller


def attention_forward(q, k, v, mask3, scaling, softcap, window, sinks=None, tiles: Tiles | None = None):
    """The forward kernel: (out (B, T, Hq, D), row_max, log_sum (B, Hq, T) fp32); sinks
    None or (Hq,) contiguous."""
    batch, n_q_heads, q_len, head_dim = q.shape
    tiles = tiles or tiles_for("forward", head_dim, q_len, k.shape[2], q.device)
    out = torch.empty((batch, q_len, n_q_heads, head_dim), device=q.device, dtype=q.dtype)
    row_max = torch.empty((batch, n_q_heads, q_len), device=q.device, dtype=torch.float32)
    log_sum = torch.empty_like(row_max)
    arguments, flags = _launch_arguments(q, k, v, mask3, scaling, softcap, window)
    _launch_fitting(
        _attention_forward_kernel, lambda t: (triton.cdiv(q_len, t.block_m), batch * n_q_heads), tiles, head_dim,
        q, k, v, mask3 if mask3 is not None else q, sinks if sinks is not None else q, out, row_max, log_sum,
        *arguments, **flags, HAS_SINKS=sinks is not None,
    )  # fmt: skip
    return out, row_max, log_sum


def attention_backward(
    q, k, v, mask3, out, row_max, log_sum, grad_out, scaling, softcap, window, sinks=None,
    kv_tiles: Tiles | None = None, q_tiles: Tiles | None = None,
):  # fmt: skip
    """The two backward kernels and the sinks' gradient: (dq, dk, dv, dsinks) from
    grad_out (B, T, Hq, D); dsinks None without sinks.  The kernels read the sinks only
    through the saved row statistics."""
    batch, n_q_heads, q_len, head_dim = q.shape
    n_kv_heads, kv_len = k.shape[1], k.shape[2]
    kv_tiles = kv_tiles or tiles_for("backward_kv", head_dim, q_len, kv_len, q.device)
    q_tiles = q_tiles or tiles_for("backward_q", head_dim, q_len, kv_len, q.device)
    grad_out = grad_out.contiguous()
    # D_i = sum_d g_id o_id, per query head: (B, Hq, T) fp32.
    delta = (grad_out.float() * out.float()).sum(-1).transpose(1, 2).contiguous()
    dq = torch.empty((batch, n_q_heads, q_len, head_dim), device=q.device, dtype=q.dtype)
    dk = torch.empty((batch, n_kv_heads, kv_len, head_dim), device=k.device, dtype=k.dtype)
    dv = torch.empty((batch, n_kv_heads, kv_len, head_dim), device=v.device, dtype=v.dtype)
    arguments, flags = _launch_arguments(q, k, v, mask3, scaling, softcap, window)
    mask_arg = mask3 if mask3 is not None else q
    _launch_fitting(
        _attention_backward_kv_kernel, lambda t: (triton.cdiv(kv_len, t.block_n), batch * n_kv_heads), kv_tiles,
        head_dim, q, k, v, mask_arg, grad_out, row_max, log_sum, delta, dk, dv, *arguments, **flags,
    )  # fmt: skip
    _launch_fitting(
        _attention_backward_q_kernel, lambda t: (triton.cdiv(q_len, t.block_m), batch * n_q_heads), q_tiles,
        head_dim, q, k, v, mask_arg, grad_out, row_max, log_sum, delta, dq, *arguments, **flags,
    )  # fmt: skip
    return dq, dk, dv, None if sinks is None else sink_gradient(sinks, row_max, log_sum, delta)


def sink_gradient(sinks, row_max, log_sum, delta) -> torch.Tensor:
    """d sink_h = -sum_(b, i) exp(sink_h - lse_i) D_i (module docstring), in sinks' dtype;
    row_max, log_sum and delta (B, Hq, T) fp32, lse = row_max + log_sum."""
    sink_weight = torch.exp((sinks.float()[None, :, None] - row_max) - log_sum)  # P_i,sink
    return -(sink_weight * delta).sum(dim=(0, 2)).to(sinks.dtype)


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask3, scaling, softcap, window, sinks):
        out, row_max, log_sum = attention_forward(q, k, v, mask3, scaling, softcap, window, sinks)
        ctx.save_for_backward(q, k, v, mask3, out, row_max, log_sum, sinks)
        ctx.settings = (scaling, softcap, window)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, mask3, out, row_max, log_sum, sinks = ctx.saved_tensors
        if not ctx.needs_input_grad[7]:  # frozen sinks (LoRA): no gradient to sum
            sinks = None
        dq, dk, dv, dsinks = attention_backward(
            q, k, v, mask3, out, row_max, log_sum, grad_out, *ctx.settings, sinks=sinks
        )
        return dq, dk, dv, None, None, None, None, dsinks


def _flags(q, mask3, softcap, window) -> dict:
    dot_fp32 = q.dtype == torch.float32 or interpreter_enabled()
    return {
        "HAS_MASK": mask3 is not None,
        "HAS_SOFTCAP": softcap is not None,
        "HAS_WINDOW": window is not None,
        "DOT_FP32": dot_fp32,
        "IEEE": dot_fp32,
    }


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scaling: float,
    mask: torch.Tensor | None = None,
    softcap: float | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of q over k and v, in tiles (module docstring: the math).

    Args:
        q: (B, Hq, T, D) queries, any strides (e.g. a transposed (B, T, Hq, D)).
        k, v: (B, Hkv, S, D) keys and values, S >= T (the queries are the last T of the S
            positions); Hq a multiple of Hkv (grouped-query attention).
        scaling: the factor on q . k (1 / sqrt(D) usually).
        mask: None, or an additive mask (B or 1, 1, T, >= S) such as transformers' eager
            one (0 where attended, a large negative value elsewhere), or a boolean one
            (True where attended). Applied on top of the causal rule; no gradient.
        softcap: c in z = c * tanh(s / c) on the scores (Gemma 2's
            attn_logit_softcapping), or None.
        window: W: query position p sees key j only when p - j < W (transformers'
            sliding_window), or None.
        sinks: (Hq,) sink logits, one per query head, any float dtype (gpt-oss's
            ``sinks``): each row's softmax denominator gains exp(sink_h); differentiable.
            Or None.

    Returns:
        (B, T, Hq, D) in q's dtype, the layout transformers' attention functions return.
    """
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        check_float_dtype(name, tensor)
        if tensor.dim() != 4:
            raise ValueError(
                f"{name} must be (batch, heads, length, head_dim); got shape {tuple(tensor.shape)}"
            )
    check_same_device(q=q, k=k, v=v, mask=mask, sinks=sinks)
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} do not fit together")
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} key heads")
    if q.shape[2] > k.shape[2]:
        raise ValueError(
            f"{q.shape[2]} queries but only {k.shape[2]} keys: the queries are the last keys' positions"
        )
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be a positive number or None; got {softcap!r}")
    if window is not None and not window > 0:
        raise ValueError(f"window must be a positive number of positions or None; got {window!r}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if sinks is not None:
        check_float_dtype("sinks", sinks)
        if sinks.shape != (q.shape[1],):
            raise ValueError(
                f"sinks must hold one logit per query head, shape ({q.shape[1]},); got {tuple(sinks.shape)}"
            )
    mask3 = None if mask is None else _additive(mask, q.shape[2], k.shape[2])
    if not use_triton(q):
        warn_reference_once("attention", q.device.type)
        return attention_reference(q, k, v, scaling, mask, softcap, window, sinks)
    return _Attention.apply(
        q, k, v, mask3, scaling, softcap, window, None if sinks is None else sinks.contiguous()
    )
