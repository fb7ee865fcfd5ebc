"""Quantise a stack of expert weights to NF4Experts, in plain torch, as bitsandbytes does.

Per expert, with its (rows, cols) matrix flattened row-major (bitsandbytes 0.50's CPU
backend, ``quantize_4bit(..., quant_type="nf4", compress_statistics=True)``):

  1. blocks of ``blocksize`` elements get their absmax a_b = max |w|; a full block's
     values are scaled by the fp32 reciprocal, clamp(w * fp32(1 / a_b), -1, 1), a short
     last block's by division, clamp(w / a_b, -1, 1);
  2. each scaled value gets the NF4 level of its interval between the fp32 midpoints of
     adjacent levels, a value on a midpoint the lower one;
  3. the offset is the fp32 mean of the a_b; the centred scales a_b - offset are cut
     into groups of 256, each with its absmax g, and each becomes the code of the
     dynamic map nearest to fp32((a_b - offset) / g), the lower one on a tie.

Steps 1 and 2, the offset and the group scales are bitsandbytes' exactly.  The codes of
step 3 are the nearest; bitsandbytes' CPU backend finds them with a compiled approximate
binary search that, for about 0.2% of blocks of random weights, returns a code one to four
places from the nearest, so there those blocks' scales differ (ours the nearer to a_b).

The weights are read one expert at a time (in fp32, one expert's worth), so quantising a
parameter in place of its 16-bit storage needs no second copy of it.
"""

from __future__ import annotations

import torch

from slothkit_kernels.moe.nf4_experts import NF4Experts

# The 16 levels of the NF4 data type (Dettmers et al., QLoRA, 2023, appendix E): quantiles
# of a standard normal scaled to [-1, 1], with an exact zero.
NF4_LEVELS = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)  # fmt: skip

VALID_BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)
NESTED_BLOCKSIZE = 256  # block scales per fp32 scale of their codes, as bitsandbytes groups them


def nf4_levels(device: torch.device | str = "cpu") -> torch.Tensor:
    """The 16 NF4 levels, fp32, ascending."""
    return torch.tensor(NF4_LEVELS, dtype=torch.float32, device=device)


def dynamic_map(device: torch.device | str = "cpu") -> torch.Tensor:
    """The 256 levels of the signed 8-bit dynamic data type (Dettmers, "8-Bit Approximations
    for Parallelism in Deep Learning", 2016), fp32, ascending: for exponent i = 0 .. 6, the
    2^i midpoints of 2^i + 1 points evenly spaced over [0.1, 1], times 10^(i - 6), with
    both signs, then 0 and 1.  The midpoints are formed in fp32 and scaled in fp32, so the
    table is the one bitsandbytes builds, value for value."""
    values = []
    for i in range(7):
        bounds = torch.linspace(0.1, 1, 2**i + 1, dtype=torch.float32)
        means = (bounds[:-1] + bounds[1:]) / 2.0
        values += ((10 ** (i - 6)) * means).tolist()
        values += (-(10 ** (i - 6)) * means).tolist()
    values += [0.0, 1.0]
    values.sort()
    return torch.tensor(values, dtype=torch.float32, device=device)


def _block_absmax(flat: torch.Tensor, blocksize: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(absmax of every block, the values scaled by it) of a flat fp32 tensor (step 1)."""
    n = flat.numel()
    full = n - n % blocksize
    whole = flat[:full].reshape(-1, blocksize)
    absmax = whole.abs().amax(dim=1)
    scaled = torch.clamp(whole * (1.0 / absmax.clamp(min=1e-38))[:, None], -1, 1).reshape(-1)
    if full < n:
        last = flat[full:].abs().amax().clamp(min=1e-38)
        absmax = torch.cat((absmax, last[None]))
        scaled = torch.cat((scaled, torch.clamp(flat[full:] / last, -1, 1)))
    return absmax, scaled


def _nearest_level(values: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """The index of the level nearest each value, the lower one on a tie (step 3): the
    largest level <= the value, or the next one where it is strictly nearer."""
    left = (torch.searchsorted(levels, values, right=True) - 1).clamp(0, levels.numel() - 2)
    nearer_right = (values - levels[left + 1]).abs() < (values - levels[left]).abs()
    return (left + nearer_right.long()).to(torch.uint8)


def _quantize_scales(absmax: torch.Tensor, table: torch.Tensor):
    """(uint8 codes, fp32 group scales, fp32 offset) of one expert's block scales (step 3)."""
    offset = absmax.mean()
    centred = absmax - offset
    n = centred.numel()
    groups = -(-n // NESTED_BLOCKSIZE)
    padded = torch.nn.functional.pad(centred, (0, groups * NESTED_BLOCKSIZE - n))
    group_max = padded.reshape(groups, NESTED_BLOCKSIZE).abs().amax(dim=1)  # padding is 0
    scale = group_max.repeat_interleave(NESTED_BLOCKSIZE)[:n]
    # A group of equal scales (all at the offset) dequantises to the offset with any code.
    normed = torch.where(scale > 0, centred / scale.clamp(min=1e-38), 0.0)
    return _nearest_level(normed, table), group_max, offset


def quantize_nf4_experts(weight: torch.Tensor, blocksize: int = 64) -> NF4Experts:
    """NF4Experts of a (E, rows, cols) float tensor, each expert's matrix quantised as
    bitsandbytes quantises a Linear4bit weight with double quantisation (module docstring).

    The record is made on ``weight``'s device and dequantises to ``weight.dtype``; the
    weight itself is left as it is (the caller frees it).
    """
    if not isinstance(weight, torch.Tensor) or weight.dim() != 3:
        got = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ValueError(f"quantize_nf4_experts: weight must be a (experts, rows, cols) tensor, got {got}")
    if weight.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(
            f"quantize_nf4_experts: weight has dtype {weight.dtype}; supported: float32, float16, bfloat16"
        )
    if blocksize not in VALID_BLOCKSIZES:
        raise ValueError(f"quantize_nf4_experts: blocksize is {blocksize}; supported: {VALID_BLOCKSIZES}")
    if weight.numel() == 0:
        raise ValueError(f"quantize_nf4_experts: weight of shape {tuple(weight.shape)} is empty")
    experts, rows, cols = weight.shape
    numel = rows * cols
    blocks = -(-numel // blocksize)
    device = weight.device
    levels, table = nf4_levels(device), dynamic_map(device)
    midpoints = (levels[:-1] + levels[1:]) / 2
    packed = torch.empty((experts, (numel + 1) // 2), dtype=torch.uint8, device=device)
    codes = torch.empty((experts, blocks), dtype=torch.uint8, device=device)
    nested = torch.empty((experts, -(-blocks // NESTED_BLOCKSIZE)), dtype=torch.float32, device=device)
    offset = torch.empty((experts,), dtype=torch.float32, device=device)
    for e in range(experts):
        absmax, scaled = _block_absmax(weight[e].reshape(-1).float(), blocksize)
        if numel % 2:  # the unused last nibble holds the code of 0, as bitsandbytes fills it
            scaled = torch.nn.functional.pad(scaled, (0, 1))
        # A value on a midpoint takes the lower level (bucketize's right=False).
        q = torch.bucketize(scaled, midpoints).to(torch.uint8)
        packed[e] = (q[0::2] << 4) | q[1::2]
        codes[e], nested[e], offset[e] = _quantize_scales(absmax, table)
    return NF4Experts(
        packed=packed,
        absmax=codes,
        nested_absmax=nested,
        offset=offset,
        code=levels,
        nested_code=table,
        stored_shape=torch.Size((experts, rows, cols)),
        dtype=weight.dtype,
        blocksize=blocksize,
        nested_blocksize=NESTED_BLOCKSIZE,
    )
