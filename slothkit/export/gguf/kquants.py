"""GGUF K-quants (Q4_K, Q5_K, Q6_K) in vectorised torch: the encoder llama.cpp uses, on the GPU.

Each weight row is cut into super-blocks of 256 values; the byte layout of one block is
ggml's (ggml-common.h), so `gguf.quants.dequantize` and llama.cpp read what this writes.

    Q4_K (144 bytes): d, dmin (fp16) | 12 bytes of 6-bit scales and mins | 128 bytes of 4-bit q
    Q5_K (176 bytes): d, dmin (fp16) | 12 bytes of 6-bit scales and mins | 32 bytes of 5th bits | 128 of 4-bit q
    Q6_K (210 bytes): 128 bytes of low 4 bits | 64 bytes of high 2 bits | 16 int8 scales | d (fp16)

Q4_K and Q5_K are asymmetric: the super-block splits into 8 sub-blocks of 32 and value i of
sub-block j decodes as  d * sc_j * q_i - dmin * m_j,  q in [0, 2^b - 1], sc_j and m_j 6-bit.
Q6_K is symmetric: 16 sub-blocks of 16,  d * sc_j * (q_i - 32),  q in [0, 63], sc_j int8.

The encoder is the one llama.cpp runs without an importance matrix (quantize_row_q{4,5,6}_K_ref
in ggml-quants.c), rewritten over all sub-blocks at once instead of one at a time:

  Q4_K/Q5_K, per sub-block (make_qkx2_quants): weights w_i = rms(x) + |x_i|; start from the
  range grid (min(x, 0), max x); then nstep + 1 times round x on a slightly stretched grid
  (nmax + rmin + rdelta * step levels over [min, max], min being the best fit's so far) and
  solve the weighted least squares for (scale, min) of that rounding in closed form:
      D = Sw*Sll - Sl^2,  scale = (Sw*Sxl - Sx*Sl) / D,  min = (Sll*Sx - Sl*Sxl) / D
  (min clamped to <= 0, then scale = Sxl/Sll); keep the fit with the smallest weighted squared
  error. Then the 8 scales and 8 mins are themselves quantised to 6 bits against their maxima
  (d = max scale / 63, dmin = max min / 63, in fp16) and every value is re-rounded against the
  quantised scale and min.

  Q6_K, per sub-block (make_qx_quants, rmse_type 1): scale from the largest-magnitude value,
  then 18 nearby grids, keeping the one maximising (sum w x l)^2 / (sum w l^2) with w = x^2
  (the weighted least-squares fit); the 16 scales go to int8 against the largest one.

Rounding is round-half-to-even, as ggml's nearest_int; the grid constants are computed in
float32 as in C. Sums run in a different order than ggml's sequential loops (and a fit's error
is computed from the sums instead of a second pass), so where two grids fit almost equally well
a sub-block can pick the other one: most blocks come out byte-identical to llama.cpp's (about
98% for Q4_K and 96% for Q6_K, 80-85% for Q5_K on Gaussian data) and the reconstruction error
of a tensor is the same to within 0.1% (tests/slothkit/export/gguf/test_kquants.py).
"""

from __future__ import annotations

import numpy as np
import torch

QK_K = 256  # values per super-block
BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
_GROUP_MAX_EPS = 1e-15  # ggml: a sub-block whose largest |x| is below this is all zero
# Super-blocks encoded per step. The scale search makes ~20 passes over each chunk's
# temporaries: on a GPU a big chunk keeps launches few (temporaries ~100 MB); on a CPU a
# chunk whose temporaries stay in cache (2 MB each) is about 5x faster than that.
_CHUNK_BLOCKS = {"cuda": 1 << 15, "cpu": 1 << 11}


# ---------------------------------------------------------------------------------------
# Public encoders / decoders
# ---------------------------------------------------------------------------------------


def quantize_q4_k(weight: torch.Tensor) -> torch.Tensor:
    """(..., n) float, n a multiple of 256 -> (..., n / 256 * 144) uint8 Q4_K blocks."""
    return _quantize(weight, "Q4_K", _encode_q4_k)


def quantize_q5_k(weight: torch.Tensor) -> torch.Tensor:
    """(..., n) float, n a multiple of 256 -> (..., n / 256 * 176) uint8 Q5_K blocks."""
    return _quantize(weight, "Q5_K", _encode_q5_k)


def quantize_q6_k(weight: torch.Tensor) -> torch.Tensor:
    """(..., n) float, n a multiple of 256 -> (..., n / 256 * 210) uint8 Q6_K blocks."""
    return _quantize(weight, "Q6_K", _encode_q6_k)


def dequantize_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    """Inverse of quantize_q4_k: (..., k * 144) uint8 -> (..., k * 256) float32."""
    return _dequantize(blocks, "Q4_K", _decode_q4_k)


def dequantize_q5_k(blocks: torch.Tensor) -> torch.Tensor:
    """Inverse of quantize_q5_k: (..., k * 176) uint8 -> (..., k * 256) float32."""
    return _dequantize(blocks, "Q5_K", _decode_q5_k)


def dequantize_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    """Inverse of quantize_q6_k: (..., k * 210) uint8 -> (..., k * 256) float32."""
    return _dequantize(blocks, "Q6_K", _decode_q6_k)


QUANTIZERS = {"Q4_K": quantize_q4_k, "Q5_K": quantize_q5_k, "Q6_K": quantize_q6_k}
DEQUANTIZERS = {"Q4_K": dequantize_q4_k, "Q5_K": dequantize_q5_k, "Q6_K": dequantize_q6_k}


def _quantize(weight: torch.Tensor, name: str, encode) -> torch.Tensor:
    if weight.shape[-1] % QK_K:
        raise ValueError(
            f"{name} needs rows whose length is a multiple of {QK_K}; got shape {tuple(weight.shape)}"
        )
    lead = weight.shape[:-1]
    blocks = weight.detach().reshape(-1, QK_K).float()  # (n_blocks, 256)
    out = torch.empty(blocks.shape[0], BLOCK_BYTES[name], dtype=torch.uint8, device=blocks.device)
    chunk = _CHUNK_BLOCKS.get(blocks.device.type, _CHUNK_BLOCKS["cuda"])
    for start in range(0, blocks.shape[0], chunk):
        out[start : start + chunk] = encode(blocks[start : start + chunk])
    return out.reshape(*lead, -1)


def _dequantize(blocks: torch.Tensor, name: str, decode) -> torch.Tensor:
    size = BLOCK_BYTES[name]
    if blocks.dtype != torch.uint8 or blocks.shape[-1] % size:
        raise ValueError(f"{name} data must be uint8 with a last dimension that is a multiple of {size}")
    lead = blocks.shape[:-1]
    return decode(blocks.reshape(-1, size)).reshape(*lead, -1)


# ---------------------------------------------------------------------------------------
# Shared pieces
# ---------------------------------------------------------------------------------------


def _f32(value: float) -> float:
    """A grid constant as C computes it in float32 (e.g. 0.1f * 7 is not 0.7)."""
    return float(np.float32(value))


def _fp16_round(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> fp16 -> fp32, as GGML_FP32_TO_FP16 then back (round to nearest even)."""
    return x.half().float()


def _fp16_bytes(x: torch.Tensor) -> torch.Tensor:
    """(B,) float -> (B, 2) little-endian fp16 bytes."""
    return x.half().contiguous().view(torch.uint8).reshape(-1, 2)


def _fit_scale_min(x: torch.Tensor, nmax: int, rmin: float, rdelta: float, nstep: int):
    """make_qkx2_quants for every row of x (S, 32) at once.

    Returns (scale (S,), neg_min (S,) >= 0, L (S, 32) levels in [0, nmax]) so that
    x ~ scale * L - neg_min, fitted by weighted least squares with w = rms(x) + |x|.

    The weighted error of a fit (s, m) comes from the same sums as the fit itself,
        sum w (s L + m - x)^2 = s^2 Sll + 2 s m Sl - 2 s Sxl + m^2 Sw - 2 m Sx + Sxx,
    so each candidate grid costs one rounding and three weighted sums over the values.
    """
    weights = (x.square().mean(-1, keepdim=True)).sqrt() + x.abs()
    xmin = x.amin(-1).clamp(max=0.0)  # the grid always contains 0
    xmax = x.amax(-1)
    flat = xmax == xmin  # nothing to fit: all levels 0, value = xmin
    weighted_x = weights * x
    sum_w = weights.sum(-1)
    sum_x = weighted_x.sum(-1)
    sum_xx = (weighted_x * x).sum(-1)

    def levels(iscale: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
        return torch.round(iscale[:, None] * (x - low[:, None])).clamp_(0, nmax)

    def sums(candidate: torch.Tensor):
        weighted_l = weights * candidate
        return weighted_l.sum(-1), (weighted_l * candidate).sum(-1), (weighted_x * candidate).sum(-1)

    def error(s, m, sum_l, sum_l2, sum_xl):
        return s * s * sum_l2 + 2 * s * m * sum_l - 2 * s * sum_xl + m * m * sum_w - 2 * m * sum_x + sum_xx

    def span(low: torch.Tensor) -> torch.Tensor:
        gap = xmax - low
        return torch.where(gap > 0, gap, torch.ones_like(gap))

    scale = 1.0 / (nmax / span(xmin))
    offset = xmin.clone()  # the (negative) min of the best fit so far
    best_levels = levels(nmax / span(xmin), xmin)
    best_error = error(scale, offset, *sums(best_levels))
    for step in range(nstep + 1):
        # As in ggml, each grid starts from the best min found so far, so the search walks.
        stretch = _f32(np.float32(rmin) + np.float32(rdelta) * np.float32(step) + np.float32(nmax))
        candidate = levels(stretch / span(offset), offset)
        sum_l, sum_l2, sum_xl = sums(candidate)
        det = sum_w * sum_l2 - sum_l.square()
        safe_det = torch.where(det > 0, det, torch.ones_like(det))
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / safe_det
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / safe_det
        positive_min = this_min > 0  # a positive min cannot be stored: refit the scale alone
        this_scale = torch.where(positive_min, sum_xl / torch.where(sum_l2 > 0, sum_l2, 1.0), this_scale)
        this_min = torch.where(positive_min, torch.zeros_like(this_min), this_min)
        this_error = error(this_scale, this_min, sum_l, sum_l2, sum_xl)
        better = (det > 0) & (this_error < best_error)
        best_levels = torch.where(better[:, None], candidate, best_levels)
        best_error = torch.where(better, this_error, best_error)
        scale = torch.where(better, this_scale, scale)
        offset = torch.where(better, this_min, offset)
    scale = torch.where(flat, torch.zeros_like(scale), scale)
    best_levels = torch.where(flat[:, None], torch.zeros_like(best_levels), best_levels)
    return scale, -offset, best_levels


def _super_block_scale_min(x: torch.Tensor, nmax: int, rmin: float, rdelta: float, nstep: int):
    """The Q4_K/Q5_K body shared by both: x (B, 256) -> d, dmin (B,) fp16-rounded,
    ls, lm (B, 8) 6-bit scale and min codes, L (B, 256) levels in [0, nmax]."""
    n_blocks = x.shape[0]
    sub = x.reshape(n_blocks * 8, 32)
    scales, mins, levels = _fit_scale_min(sub, nmax, rmin, rdelta, nstep)
    scales, mins, levels = (
        scales.reshape(n_blocks, 8),
        mins.reshape(n_blocks, 8),
        levels.reshape(n_blocks, 8, 32),
    )

    max_scale = scales.amax(-1).clamp(min=0.0)
    max_min = mins.amax(-1).clamp(min=0.0)
    inv_scale = torch.where(max_scale > 0, 63.0 / torch.where(max_scale > 0, max_scale, 1.0), 0.0)
    inv_min = torch.where(max_min > 0, 63.0 / torch.where(max_min > 0, max_min, 1.0), 0.0)
    ls = torch.round(inv_scale[:, None] * scales).clamp_(0, 63)
    lm = torch.round(inv_min[:, None] * mins).clamp_(0, 63)
    d = _fp16_round(max_scale / 63.0)
    dmin = _fp16_round(max_min / 63.0)

    # Re-round every value against the scale and min it will actually be decoded with.
    sub_d = d[:, None] * ls  # (B, 8)
    sub_m = dmin[:, None] * lm
    nonzero = sub_d != 0  # ggml keeps the fitted levels where the stored scale is 0
    requant = torch.round(
        (x.reshape(n_blocks, 8, 32) + sub_m[..., None]) / torch.where(nonzero, sub_d, 1.0)[..., None]
    )
    levels = torch.where(nonzero[..., None], requant.clamp_(0, nmax), levels)
    return d, dmin, ls.to(torch.uint8), lm.to(torch.uint8), levels.to(torch.uint8).reshape(n_blocks, QK_K)


def _pack_scale_min(ls: torch.Tensor, lm: torch.Tensor) -> torch.Tensor:
    """8 six-bit scales and 8 six-bit mins -> 12 bytes (ggml's get_scale_min_k4 layout):
    bytes 0-3: scale 0-3 | (high 2 bits of scale 4-7) << 6
    bytes 4-7: min 0-3   | (high 2 bits of min 4-7) << 6
    bytes 8-11: low 4 bits of scale 4-7 | (low 4 bits of min 4-7) << 4"""
    low_s, high_s = ls[:, :4], ls[:, 4:]
    low_m, high_m = lm[:, :4], lm[:, 4:]
    return torch.cat(
        [
            low_s | ((high_s >> 4) << 6),
            low_m | ((high_m >> 4) << 6),
            (high_s & 0xF) | ((high_m & 0xF) << 4),
        ],
        dim=1,
    )


def _unpack_scale_min(packed: torch.Tensor):
    """12 bytes -> (scales (B, 8), mins (B, 8)) as float32."""
    p = packed.to(torch.int32)
    a, b, c = p[:, 0:4], p[:, 4:8], p[:, 8:12]
    scales = torch.cat([a & 63, (c & 0xF) | ((a >> 6) << 4)], dim=1)
    mins = torch.cat([b & 63, (c >> 4) | ((b >> 6) << 4)], dim=1)
    return scales.float(), mins.float()


def _low_nibbles(levels: torch.Tensor) -> torch.Tensor:
    """(B, 256) levels -> (B, 128) bytes: in each 64-value chunk, byte l holds value l in its
    low nibble and value l + 32 in its high nibble."""
    chunks = (levels & 0xF).reshape(-1, 4, 2, 32)
    return (chunks[:, :, 0] | (chunks[:, :, 1] << 4)).reshape(-1, 128)


def _split_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Inverse of _low_nibbles: (B, 128) bytes -> (B, 256) values 0..15 (int32)."""
    q = qs.to(torch.int32).reshape(-1, 4, 1, 32)
    return torch.cat([q & 0xF, q >> 4], dim=2).reshape(-1, QK_K)


# ---------------------------------------------------------------------------------------
# Q4_K
# ---------------------------------------------------------------------------------------


def _encode_q4_k(x: torch.Tensor) -> torch.Tensor:
    d, dmin, ls, lm, levels = _super_block_scale_min(x, nmax=15, rmin=-1.0, rdelta=0.1, nstep=20)
    return torch.cat(
        [_fp16_bytes(d), _fp16_bytes(dmin), _pack_scale_min(ls, lm), _low_nibbles(levels)], dim=1
    )


def _decode_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    d = blocks[:, 0:2].contiguous().view(torch.float16).float()  # (B, 1)
    dmin = blocks[:, 2:4].contiguous().view(torch.float16).float()
    scales, mins = _unpack_scale_min(blocks[:, 4:16])
    q = _split_nibbles(blocks[:, 16:144]).reshape(-1, 8, 32).float()
    return ((d * scales)[..., None] * q - (dmin * mins)[..., None]).reshape(-1, QK_K)


# ---------------------------------------------------------------------------------------
# Q5_K
# ---------------------------------------------------------------------------------------


def _encode_q5_k(x: torch.Tensor) -> torch.Tensor:
    d, dmin, ls, lm, levels = _super_block_scale_min(x, nmax=31, rmin=-0.5, rdelta=0.1, nstep=15)
    # 5th bits: byte l of qh holds, at bit 2c + h, the high bit of value 64c + 32h + l.
    high = (levels >> 4).reshape(-1, 8, 32).to(torch.int32)  # (B, 8 = 2c + h, 32)
    shifts = torch.arange(8, device=x.device, dtype=torch.int32)[None, :, None]
    qh = (high << shifts).sum(1).to(torch.uint8)  # (B, 32)
    return torch.cat(
        [_fp16_bytes(d), _fp16_bytes(dmin), _pack_scale_min(ls, lm), qh, _low_nibbles(levels)], dim=1
    )


def _decode_q5_k(blocks: torch.Tensor) -> torch.Tensor:
    d = blocks[:, 0:2].contiguous().view(torch.float16).float()
    dmin = blocks[:, 2:4].contiguous().view(torch.float16).float()
    scales, mins = _unpack_scale_min(blocks[:, 4:16])
    qh = blocks[:, 16:48].to(torch.int32)[:, None, :]  # (B, 1, 32)
    shifts = torch.arange(8, device=blocks.device, dtype=torch.int32)[None, :, None]
    high = ((qh >> shifts) & 1).reshape(-1, QK_K)  # value 64c + 32h + l at bit 2c + h
    q = (_split_nibbles(blocks[:, 48:176]) | (high << 4)).reshape(-1, 8, 32).float()
    return ((d * scales)[..., None] * q - (dmin * mins)[..., None]).reshape(-1, QK_K)


# ---------------------------------------------------------------------------------------
# Q6_K
# ---------------------------------------------------------------------------------------


def _fit_symmetric_scale(x: torch.Tensor, nmax: int):
    """make_qx_quants (rmse_type 1) for every row of x (S, 16).

    Returns (scale (S,), L (S, 16) levels in [0, 2 * nmax - 1]) with x ~ scale * (L - nmax)."""
    amax, where_max = x.abs().max(-1)  # first occurrence on ties, as ggml's strict '>'
    signed_max = x.gather(-1, where_max[:, None]).squeeze(-1)
    zero = amax < _GROUP_MAX_EPS
    signed_max = torch.where(zero, torch.ones_like(signed_max), signed_max)
    weights = x.square()
    weighted_x = weights * x

    def fit(iscale: torch.Tensor):
        levels = torch.round(iscale[:, None] * x).clamp_(-nmax, nmax - 1)
        return levels, (weighted_x * levels).sum(-1), (weights * levels.square()).sum(-1)

    best_iscale = -nmax / signed_max
    levels, sum_lx, sum_l2 = fit(best_iscale)
    scale = torch.where(sum_l2 > 0, sum_lx / torch.where(sum_l2 > 0, sum_l2, 1.0), 0.0)
    best = scale * sum_lx
    for step in range(-9, 10):
        if step == 0:
            continue
        iscale = -_f32(np.float32(nmax) + np.float32(0.1) * np.float32(step)) / signed_max
        _, sum_lx, sum_l2 = fit(iscale)
        # maximise (sum w x l)^2 / sum w l^2, i.e. minimise the weighted squared error
        better = (sum_l2 > 0) & (sum_lx * sum_lx > best * sum_l2)
        new_scale = sum_lx / torch.where(sum_l2 > 0, sum_l2, 1.0)
        scale = torch.where(better, new_scale, scale)
        best = torch.where(better, new_scale * sum_lx, best)
        best_iscale = torch.where(better, iscale, best_iscale)
    levels = fit(best_iscale)[0] + nmax
    scale = torch.where(zero, torch.zeros_like(scale), scale)
    levels = torch.where(zero[:, None], torch.zeros_like(levels), levels)
    return scale, levels


def _encode_q6_k(x: torch.Tensor) -> torch.Tensor:
    n_blocks = x.shape[0]
    sub = x.reshape(n_blocks * 16, 16)
    scales, levels = _fit_symmetric_scale(sub, nmax=32)
    scales, levels = scales.reshape(n_blocks, 16), levels.reshape(n_blocks, 16, 16)

    max_abs, where_max = scales.abs().max(-1)
    max_scale = scales.gather(-1, where_max[:, None]).squeeze(-1)
    empty = max_abs < _GROUP_MAX_EPS  # ggml writes an all-zero block
    iscale = -128.0 / torch.where(empty, torch.ones_like(max_scale), max_scale)
    d = _fp16_round(1.0 / iscale)
    codes = torch.round(iscale[:, None] * scales).clamp_(max=127)  # in [-128, 127]

    sub_d = d[:, None] * codes  # (B, 16)
    nonzero = sub_d != 0
    requant = torch.round(x.reshape(n_blocks, 16, 16) / torch.where(nonzero, sub_d, 1.0)[..., None])
    levels = torch.where(nonzero[..., None], requant.clamp_(-32, 31) + 32, levels)
    levels = levels.to(torch.int32).reshape(n_blocks, 2, 4, 32)  # (B, half, quarter, l)

    # Per 128-value half: ql byte l holds quarters 0 | 2 << 4, byte l + 32 quarters 1 | 3 << 4;
    # qh byte l holds the high 2 bits of quarter k at bits 2k.
    low = levels & 0xF
    ql = torch.cat([low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], dim=2)
    shifts = torch.tensor([0, 2, 4, 6], device=x.device, dtype=torch.int32)[None, None, :, None]
    qh = ((levels >> 4) << shifts).sum(2)  # (B, 2, 32)
    block = torch.cat(
        [
            ql.reshape(n_blocks, 128).to(torch.uint8),
            qh.reshape(n_blocks, 64).to(torch.uint8),
            codes.to(torch.int8).view(torch.uint8),
            _fp16_bytes(d),
        ],
        dim=1,
    )
    return torch.where(empty[:, None], torch.zeros_like(block), block)


def _decode_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    ql = blocks[:, 0:128].to(torch.int32).reshape(-1, 2, 2, 32)  # (B, half, byte group, l)
    qh = blocks[:, 128:192].to(torch.int32).reshape(-1, 2, 1, 32)
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float()  # (B, 16)
    d = blocks[:, 208:210].contiguous().view(torch.float16).float()  # (B, 1)
    low = torch.stack([ql[:, :, 0] & 0xF, ql[:, :, 1] & 0xF, ql[:, :, 0] >> 4, ql[:, :, 1] >> 4], dim=2)
    shifts = torch.tensor([0, 2, 4, 6], device=blocks.device, dtype=torch.int32)[None, None, :, None]
    high = (qh >> shifts) & 3  # (B, 2, 4, 32)
    q = ((low | (high << 4)) - 32).reshape(-1, 16, 16).float()
    return ((d * scales)[..., None] * q).reshape(-1, QK_K)
