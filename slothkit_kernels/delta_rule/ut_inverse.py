"""The UT transform of each chunk: Tinv = (I + A)^-1 with A strictly lower triangular,

    A[i, j] = beta_i (k_i . k_j) exp(gamma_i - gamma_j)    for j < i.

Unrolling the chunk's delta updates gives (I + A) U = beta * V and (I + A) W =
beta * exp(gamma) * K for the chunk's new values U and decayed transformed keys W
(forward.py); both kernels that walk the chunks read Tinv from here.

Each program inverts one chunk by forward substitution, row i of Tinv being
e_i - sum_{j<i} A[i, j] Tinv[j, :]: the order transformers' solve_triangular takes, and
stable where a power series in A would cancel (A's powers grow for similar keys).
Chunks are independent, so the sequential substitution runs for all of them at once.
"""

import triton
import triton.language as tl

from slothkit_kernels.delta_rule.chunk import chunk_decays, load_rows


@triton.jit
def ut_inverse_kernel(
    K,  # pointer to keys (B, T, HK, DK), l2-normalised if asked
    G,  # pointer to log decays (B, T, HV)
    BETA,  # pointer to betas (B, T, HV)
    TINV,  # pointer to the output (B, HV, NC, C, C) fp32
    T,  # sequence length
    HK,  # query/key heads
    HV,  # value heads
    DK,  # key head dim
    GROUP,  # HV // HK, value heads per key head
    NC,  # chunks, cdiv(T, C)
    C: tl.constexpr,  # chunk length
    BK: tl.constexpr,  # DK rounded up to a power of two
):
    chunk = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // HV
    hv = bh % HV
    hk = hv // GROUP
    offs_c = tl.arange(0, C)
    t_idx = chunk * C + offs_c
    t_ok = t_idx < T
    offs_k = tl.arange(0, BK)
    k = load_rows(K, (b * T * HK + hk) * DK, t_idx, t_ok, HK * DK, offs_k, offs_k < DK)  # (C, BK)
    g = tl.load(G + b * T * HV + hv + t_idx * HV, mask=t_ok, other=0.0).to(tl.float32)
    beta = tl.load(BETA + b * T * HV + hv + t_idx * HV, mask=t_ok, other=0.0).to(tl.float32)
    gamma, gamma_last, decay = chunk_decays(g, offs_c, C)

    strict = offs_c[:, None] > offs_c[None, :]
    kk = tl.dot(k, tl.trans(k), input_precision="ieee")  # (C, C)
    a = tl.where(strict, beta[:, None] * kk * decay, 0.0)
    tinv = tl.where(offs_c[:, None] == offs_c[None, :], 1.0, 0.0)
    for i in range(1, C):
        a_i = tl.sum(tl.where(offs_c[:, None] == i, a, 0.0), axis=0)  # row i of A, (C,)
        row = tl.sum(a_i[:, None] * tinv, axis=0)  # sum_j A[i, j] Tinv[j, :]
        unit = tl.where(offs_c == i, 1.0, 0.0)
        tinv = tl.where(offs_c[:, None] == i, (unit - row)[None, :], tinv)
    out = TINV + (bh * NC + chunk) * C * C + offs_c[:, None] * C + offs_c[None, :]
    tl.store(out, tinv)
