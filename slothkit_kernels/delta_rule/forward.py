"""The chunked forward of the gated delta rule: one program per (batch, value head,
block of value features) walks the chunks in order, carrying the state in registers.

For a chunk with state S0 (dk, dv) at its start, Tinv = (I + A)^-1 (ut_inverse.py),
gamma the cumulative log decay and gamma_C its value at the chunk's end:

    U  = Tinv (beta * V)                     new values, as if S0 were 0
    W  = Tinv (beta * exp(gamma) * K)        how much of S0 each update reads
    Vn = U - W S0                            the delta rule's corrections
    P  = (Q K^T) * exp(gamma_i - gamma_j), j <= i
    O  = (exp(gamma) * Q) S0 + P Vn
    S_C = exp(gamma_C) S0 + (exp(gamma_C - gamma) * K)^T Vn

Columns of S (value features) never mix, so value-feature blocks run as separate
programs.  Each chunk's S0 is written out for the backward, which walks the chunks
the other way (backward.py).
"""

import triton
import triton.language as tl

from slothkit_kernels.delta_rule.chunk import chunk_decays, load_rows


@triton.jit
def delta_rule_forward_kernel(
    Q,  # pointer to queries (B, T, HK, DK), normalised and scaled
    K,  # pointer to keys (B, T, HK, DK)
    V,  # pointer to values (B, T, HV, DV)
    G,  # pointer to log decays (B, T, HV)
    BETA,  # pointer to betas (B, T, HV)
    TINV,  # pointer to each chunk's (I + A)^-1, (B, HV, NC, C, C) fp32
    H0,  # pointer to the initial state (B, HV, DK, DV), read if HAS_H0
    O,  # pointer to the output (B, T, HV, DV) fp32
    STATES,  # pointer to each chunk's starting state, output (B, HV, NC, DK, DV) fp32
    HT,  # pointer to the final state, output (B, HV, DK, DV) fp32
    T,  # sequence length
    HK,  # query/key heads
    HV,  # value heads
    DK,  # key head dim
    DV,  # value head dim
    GROUP,  # HV // HK
    NC,  # chunks
    HAS_H0: tl.constexpr,  # whether H0 holds an initial state (else zeros)
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
    state_offs = offs_k[:, None] * DV + offs_v[None, :]
    state_ok = k_ok[:, None] & v_ok[None, :]
    if HAS_H0:
        s = tl.load(H0 + bh * DK * DV + state_offs, mask=state_ok, other=0.0).to(tl.float32)
    else:
        s = tl.zeros((BK, BV), dtype=tl.float32)

    for chunk in range(0, NC):
        t_idx = chunk * C + offs_c
        t_ok = t_idx < T
        q = load_rows(Q, qk_base, t_idx, t_ok, HK * DK, offs_k, k_ok)  # (C, BK)
        k = load_rows(K, qk_base, t_idx, t_ok, HK * DK, offs_k, k_ok)  # (C, BK)
        v = load_rows(V, v_base, t_idx, t_ok, HV * DV, offs_v, v_ok)  # (C, BV)
        g = tl.load(G + b * T * HV + hv + t_idx * HV, mask=t_ok, other=0.0).to(tl.float32)
        beta = tl.load(BETA + b * T * HV + hv + t_idx * HV, mask=t_ok, other=0.0).to(tl.float32)
        gamma, gamma_last, decay = chunk_decays(g, offs_c, C)
        tinv = tl.load(TINV + (bh * NC + chunk) * C * C + offs_c[:, None] * C + offs_c[None, :])

        tl.store(STATES + (bh * NC + chunk) * DK * DV + state_offs, s, mask=state_ok)
        u = tl.dot(tinv, v * beta[:, None], input_precision=PRECISION)  # (C, BV)
        w = tl.dot(tinv, k * (beta * tl.exp(gamma))[:, None], input_precision=PRECISION)  # (C, BK)
        v_new = u - tl.dot(w, s, input_precision=PRECISION)  # (C, BV)
        p = tl.dot(q, tl.trans(k), input_precision=PRECISION) * decay  # (C, C)
        o = tl.dot(q * tl.exp(gamma)[:, None], s, input_precision=PRECISION) + tl.dot(
            p, v_new, input_precision=PRECISION
        )
        tl.store(
            O + v_base + t_idx[:, None] * (HV * DV) + offs_v[None, :], o, mask=t_ok[:, None] & v_ok[None, :]
        )
        k_to_end = k * tl.exp(gamma_last - gamma)[:, None]
        s = tl.exp(gamma_last) * s + tl.dot(tl.trans(k_to_end), v_new, input_precision=PRECISION)

    tl.store(HT + bh * DK * DV + state_offs, s, mask=state_ok)
