"""The hand-derived backward of the chunked gated delta rule: one program per (batch,
value head, block of value features) walks the chunks from last to first, carrying
dS, the gradient of the state at the current chunk's end.

With the forward's names (forward.py), Vb = beta * V, Kb = beta * exp(gamma) * K,
Qg = exp(gamma) * Q, Kc = exp(gamma_C - gamma) * K, D[i, j] = exp(gamma_i - gamma_j),
and S0 read back from the forward, one chunk's backward given dO and dS is

    dVn = P^T dO + Kc dS
    dP  = dO Vn^T                (j <= i)          dQg = dO S0^T      dKc = Vn dS^T
    dS0 = Qg^T dO + exp(gamma_C) dS - W^T dVn      (dS for the previous chunk)
    dVb = Tinv^T dVn             dKb = -Tinv^T dVn S0^T
    dA  = -(dVb U^T + dKb W^T)   (j < i: d(I + A)^-1 = -Tinv dA Tinv, and U = Tinv Vb)

then, with GP = dP * D and GA = dA * D (the products through the decays),

    dQ    = GP K + exp(gamma) dQg
    dK    = GP^T Q + beta * (GA K) + GA^T (beta * K) + exp(gamma_C - gamma) dKc
            + beta exp(gamma) dKb
    dV    = beta dVb
    dbeta = rowsum(GA * K K^T) + rowsum(dVb * V) + exp(gamma) rowsum(dKb * K)
    dg_m  = sum_{i >= m} (rowsum_i(dQg * Qg) + rowsum_i(dKb * Kb))
            + sum_{i < m} rowsum_i(dKc * Kc)
            + sum_{i >= m > j} E[i, j]      for E = dA * A + dP * P  (the decays' exponents)
            + exp(gamma_C) sum(dS * S0)
    since gamma_i = g_1 + ... + g_i depends on g_m exactly when i >= m.

Every term is linear in (dO, dS) restricted to the program's value features, so the
programs of one head write partial dQ, dK, dbeta, dg that the caller sums; dV and dS
are complete per block.
"""

import triton
import triton.language as tl

from slothkit_kernels.delta_rule.chunk import chunk_decays, load_rows


@triton.jit
def delta_rule_backward_kernel(
    Q,  # pointer to queries (B, T, HK, DK), normalised and scaled
    K,  # pointer to keys (B, T, HK, DK)
    V,  # pointer to values (B, T, HV, DV)
    G,  # pointer to log decays (B, T, HV)
    BETA,  # pointer to betas (B, T, HV)
    TINV,  # pointer to each chunk's (I + A)^-1, (B, HV, NC, C, C) fp32
    STATES,  # pointer to each chunk's starting state (B, HV, NC, DK, DV) fp32
    DO,  # pointer to the output's gradient (B, T, HV, DV)
    DHT,  # pointer to the final state's gradient (B, HV, DK, DV), read if HAS_DHT
    DQ,  # pointer to partial query gradients, output (NV, B, T, HV, DK) fp32
    DK_,  # pointer to partial key gradients, output (NV, B, T, HV, DK) fp32
    DV_,  # pointer to the value gradient, output (B, T, HV, DV) fp32
    DBETA,  # pointer to partial beta gradients, output (NV, B, T, HV) fp32
    DG,  # pointer to partial log-decay gradients, output (NV, B, T, HV) fp32
    DH0,  # pointer to the initial state's gradient, output (B, HV, DK, DV) fp32
    B,  # batch size
    T,  # sequence length
    HK,  # query/key heads
    HV,  # value heads
    DK,  # key head dim
    DV,  # value head dim
    GROUP,  # HV // HK
    NC,  # chunks
    HAS_DHT: tl.constexpr,  # whether DHT holds a gradient (else zeros)
    C: tl.constexpr,  # chunk length
    BK: tl.constexpr,  # DK rounded up to a power of two
    BV: tl.constexpr,  # value features per program
    PRECISION: tl.constexpr,  # tl.dot's input_precision: "ieee" for fp32 inputs, else "tf32"
):
    v_block = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // HV
    hv = bh % HV
    hk = hv // GROUP
    offs_c = tl.arange(0, C)
    offs_k = tl.arange(0, BK)
    offs_v = v_block * BV + tl.arange(0, BV)
    k_ok = offs_k < DK
    v_ok = offs_v < DV
    qk_base = (b * T * HK + hk) * DK
    v_base = (b * T * HV + hv) * DV
    part_base = ((v_block * B + b) * T * HV + hv) * DK  # into (NV, B, T, HV, DK)
    scalar_base = (v_block * B + b) * T * HV + hv  # into (NV, B, T, HV)
    state_offs = offs_k[:, None] * DV + offs_v[None, :]
    state_ok = k_ok[:, None] & v_ok[None, :]
    causal = offs_c[:, None] >= offs_c[None, :]
    strict = offs_c[:, None] > offs_c[None, :]
    if HAS_DHT:
        ds = tl.load(DHT + bh * DK * DV + state_offs, mask=state_ok, other=0.0).to(tl.float32)
    else:
        ds = tl.zeros((BK, BV), dtype=tl.float32)

    for step in range(0, NC):
        chunk = NC - 1 - step
        t_idx = chunk * C + offs_c
        t_ok = t_idx < T
        q = load_rows(Q, qk_base, t_idx, t_ok, HK * DK, offs_k, k_ok)  # (C, BK)
        k = load_rows(K, qk_base, t_idx, t_ok, HK * DK, offs_k, k_ok)  # (C, BK)
        v = load_rows(V, v_base, t_idx, t_ok, HV * DV, offs_v, v_ok)  # (C, BV)
        do = load_rows(DO, v_base, t_idx, t_ok, HV * DV, offs_v, v_ok)  # (C, BV)
        g = tl.load(G + b * T * HV + hv + t_idx * HV, mask=t_ok, other=0.0).to(tl.float32)
        beta = tl.load(BETA + b * T * HV + hv + t_idx * HV, mask=t_ok, other=0.0).to(tl.float32)
        gamma, gamma_last, decay = chunk_decays(g, offs_c, C)
        tinv = tl.load(TINV + (bh * NC + chunk) * C * C + offs_c[:, None] * C + offs_c[None, :])
        s0 = tl.load(STATES + (bh * NC + chunk) * DK * DV + state_offs, mask=state_ok, other=0.0)

        # The forward's chunk, recomputed.
        exp_gamma = tl.exp(gamma)
        to_end = tl.exp(gamma_last - gamma)
        v_beta = v * beta[:, None]
        k_beta = k * (beta * exp_gamma)[:, None]
        u = tl.dot(tinv, v_beta, input_precision=PRECISION)  # (C, BV)
        w = tl.dot(tinv, k_beta, input_precision=PRECISION)  # (C, BK)
        v_new = u - tl.dot(w, s0, input_precision=PRECISION)  # (C, BV)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # (C, C)
        kk = tl.dot(k, tl.trans(k), input_precision=PRECISION)  # (C, C)
        p = qk * decay
        a = tl.where(strict, beta[:, None] * kk * decay, 0.0)
        q_g = q * exp_gamma[:, None]
        k_c = k * to_end[:, None]

        d_v_new = tl.dot(tl.trans(p), do, input_precision=PRECISION) + tl.dot(
            k_c, ds, input_precision=PRECISION
        )  # (C, BV)
        d_p = tl.where(causal, tl.dot(do, tl.trans(v_new), input_precision=PRECISION), 0.0)  # (C, C)
        d_q_g = tl.dot(do, tl.trans(s0), input_precision=PRECISION)  # (C, BK)
        d_k_c = tl.dot(v_new, tl.trans(ds), input_precision=PRECISION)  # (C, BK)
        d_s0 = (
            tl.dot(tl.trans(q_g), do, input_precision=PRECISION)
            + tl.exp(gamma_last) * ds
            - tl.dot(tl.trans(w), d_v_new, input_precision=PRECISION)
        )
        d_v_beta = tl.dot(tl.trans(tinv), d_v_new, input_precision=PRECISION)  # (C, BV)
        d_k_beta = -tl.dot(
            tl.trans(tinv),
            tl.dot(d_v_new, tl.trans(s0), input_precision=PRECISION),
            input_precision=PRECISION,
        )  # (C, BK)
        d_a = tl.where(
            strict,
            -(
                tl.dot(d_v_beta, tl.trans(u), input_precision=PRECISION)
                + tl.dot(d_k_beta, tl.trans(w), input_precision=PRECISION)
            ),
            0.0,
        )
        g_p = d_p * decay
        g_a = d_a * decay

        d_q = tl.dot(g_p, k, input_precision=PRECISION) + d_q_g * exp_gamma[:, None]
        d_k = (
            tl.dot(tl.trans(g_p), q, input_precision=PRECISION)
            + beta[:, None] * tl.dot(g_a, k, input_precision=PRECISION)
            + tl.dot(tl.trans(g_a), k * beta[:, None], input_precision=PRECISION)
            + d_k_c * to_end[:, None]
            + d_k_beta * (beta * exp_gamma)[:, None]
        )
        d_v = d_v_beta * beta[:, None]
        d_beta = (
            tl.sum(g_a * kk, axis=1) + tl.sum(d_v_beta * v, axis=1) + tl.sum(d_k_beta * k, axis=1) * exp_gamma
        )
        # d/dg_m, term by term (module docstring), each summed only where it depends on g_m:
        # exp(gamma_i) on Qg and Kb for i >= m, exp(gamma_C - gamma_i) on Kc for i < m
        # (gamma_C - gamma_i = g_{i+1} + ... + g_C), decay[i, j] = exp(gamma_i - gamma_j) for
        # i >= m > j (decay[i, i] = 1 for none).  Summing per position first and then
        # differencing cumulative sums would cancel terms of order one down to the small dg
        # of a fast decay.
        grows = tl.sum(d_q_g * q_g, axis=1) + tl.sum(d_k_beta * k_beta, axis=1)  # (C,) over i
        to_end_terms = tl.sum(d_k_c * k_c, axis=1)
        spans = d_a * a + tl.where(strict, d_p * p, 0.0)  # (C, C): pair (i, j), j < i
        spans_before = tl.cumsum(spans, axis=1) - spans  # [i, m]: sum over j < m
        d_g = (
            tl.sum(tl.where(causal, grows[:, None] + spans_before, 0.0), axis=0)
            + tl.sum(tl.where(offs_c[:, None] < offs_c[None, :], to_end_terms[:, None], 0.0), axis=0)
            + tl.exp(gamma_last) * tl.sum(tl.sum(ds * s0, axis=1), axis=0)
        )

        rows_k = t_idx[:, None] * (HV * DK) + offs_k[None, :]
        tl.store(DQ + part_base + rows_k, d_q, mask=t_ok[:, None] & k_ok[None, :])
        tl.store(DK_ + part_base + rows_k, d_k, mask=t_ok[:, None] & k_ok[None, :])
        tl.store(
            DV_ + v_base + t_idx[:, None] * (HV * DV) + offs_v[None, :],
            d_v,
            mask=t_ok[:, None] & v_ok[None, :],
        )
        tl.store(DBETA + scalar_base + t_idx * HV, d_beta, mask=t_ok)
        tl.store(DG + scalar_base + t_idx * HV, d_g, mask=t_ok)
        ds = d_s0

    tl.store(DH0 + bh * DK * DV + state_offs, ds, mask=state_ok)
