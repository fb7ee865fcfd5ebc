"""What every delta-rule kernel does to one chunk of C positions: load its rows and
build its decays.

Within a chunk, gamma_i = g_1 + ... + g_i is the cumulative log decay up to position i
(inclusive), so exp(gamma_i - gamma_j) for j <= i is the decay the state accumulates
between positions j and i.  Positions past the sequence load as zeros (k = v = 0,
beta = 0, g = 0): they leave the state and the decay of the chunk's end unchanged.
"""

import triton
import triton.language as tl


@triton.jit
def load_rows(
    PTR,  # pointer to a (B, T, H, D) tensor
    base,  # offset of (b, t=0, h, d=0)
    t_idx,  # (C,) positions of the chunk
    t_ok,  # (C,) positions inside the sequence
    row_stride,  # H * D, elements between consecutive positions
    offs_d,  # (BD,) feature indices
    d_ok,  # (BD,) features inside D
):
    ptrs = PTR + base + t_idx[:, None] * row_stride + offs_d[None, :]
    return tl.load(ptrs, mask=t_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)


@triton.jit
def chunk_decays(
    g,  # (C,) log decays of the chunk's positions
    offs_c,  # (C,) 0..C-1
    C: tl.constexpr,  # chunk length
):
    """gamma (C,), gamma at the chunk's end, and decay[i, j] = exp(gamma_i - gamma_j) for
    j <= i, 0 above the diagonal (masked before exp: gamma_i - gamma_j > 0 there)."""
    gamma = tl.cumsum(g, axis=0)
    gamma_last = tl.sum(tl.where(offs_c == C - 1, gamma, 0.0), axis=0)
    causal = offs_c[:, None] >= offs_c[None, :]
    decay = tl.where(causal, tl.exp(tl.where(causal, gamma[:, None] - gamma[None, :], 0.0)), 0.0)
    return gamma, gamma_last, decay
