"""RoPE and the key/value cache write of one decode step, in one launch.

A decode step rotates q and k, then stores k and v in a preallocated cache at the step's
slots: three launches per layer when done as ``rope`` and two ``index_copy_``, each
moving a few kilobytes, so that their cost is the launch, not the bytes.  Here one
program per token

    rotates the token's q heads in place,
    rotates its k heads into ``keys[b, :, slots[t]]``,
    copies its v heads into ``values[b, :, slots[t]]``,

with ``rope``'s arithmetic and rounding (kernel.py; k in the cache holds exactly the
values ``rope`` would have left in k).  ``slots`` is a device tensor, so a CUDA graph
captured once writes where each replay's step is.

Layouts: q (B, Hq, T, D), k and v (B, Hkv, T, D), views with a contiguous last
dimension (``view(B, T, H, D).transpose(1, 2)`` as an attention layer makes them);
keys and values (B, Hkv, S, D) with a contiguous last dimension, of k's and v's dtype;
cos and sin (B, T, D), (1, T, D) or (T, D) as the rotary embedding returns them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slothkit_kernels.rope.checks import _check_rotatable
from slothkit_kernels.rope.kernel import MAX_TILE, NUM_WARPS, _rotate_token
from slothkit_kernels.rope.ops import rope_reference
from slothkit_kernels.utils import use_triton, warn_reference_once


@triton.jit
def _copy_heads(
    X_IN,  # pointer to this token's head 0 in the tensor read
    X_OUT,  # pointer to this token's head 0 in the tensor written
    in_stride_h,
    out_stride_h,
    n_heads,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,  # power of two >= D
):
    offs_d = tl.arange(0, BLOCK_D)
    for h0 in range(0, n_heads, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        mask = (offs_h < n_heads)[:, None] & (offs_d < HEAD_DIM)[None, :]
        heads = offs_h.to(tl.int64)[:, None]
        x = tl.load(X_IN + heads * in_stride_h + offs_d[None, :], mask=mask)
        tl.store(X_OUT + heads * out_stride_h + offs_d[None, :], x, mask=mask)


@triton.jit
def _rope_cache_kernel(
    Q,  # (B, Hq, T, D), rotated in place
    K,  # (B, Hkv, T, D), read
    V,  # (B, Hkv, T, D), read
    KEYS,  # (B, Hkv, S, D), rotated k written at the slots
    VALUES,  # (B, Hkv, S, D), v written at the slots; same strides as KEYS
    COS,  # (Bc, T, D), last dim contiguous
    SIN,  # same shape and strides as COS
    SLOTS,  # (T,) ints: the cache slot of each token
    q_stride_b,
    q_stride_h,
    q_stride_t,
    k_stride_b,
    k_stride_h,
    k_stride_t,
    v_stride_b,
    v_stride_h,
    v_stride_t,
    cache_stride_b,
    cache_stride_h,
    cache_stride_s,
    cos_stride_b,  # 0 when the tables are shared by the batch
    cos_stride_t,
    seq_len,  # T
    n_q_heads,
    n_kv_heads,
    HALF_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    b = pid // seq_len
    t = pid % seq_len
    slot = tl.load(SLOTS + t).to(tl.int64)
    cs_row = b * cos_stride_b + t * cos_stride_t
    q_row = Q + b * q_stride_b + t * q_stride_t
    cache_row = b * cache_stride_b + slot * cache_stride_s
    _rotate_token(
        q_row,
        q_row,
        q_stride_h,
        q_stride_h,
        n_q_heads,
        K + b * k_stride_b + t * k_stride_t,
        KEYS + cache_row,
        k_stride_h,
        cache_stride_h,
        n_kv_heads,
        COS + cs_row,
        SIN + cs_row,
        HALF_DIM,
        False,
        BLOCK_H,
        BLOCK_HALF,
    )
    _copy_heads(
        V + b * v_stride_b + t * v_stride_t,
        VALUES + cache_row,
        v_stride_h,
        cache_stride_h,
        n_kv_heads,
        2 * HALF_DIM,
        BLOCK_H,
        BLOCK_D,
    )


def _tables(cos: torch.Tensor, sin: torch.Tensor, batch: int, tokens: int, head_dim: int):
    """cos and sin as (Bc, T, D) with a contiguous last dimension, Bc 1 or B."""
    if cos.shape != sin.shape:
        raise ValueError(f"rope_into_cache: cos has shape {tuple(cos.shape)}, sin {tuple(sin.shape)}")
    if cos.dim() == 2:
        cos, sin = cos[None], sin[None]
    if cos.dim() != 3 or cos.shape[0] not in (1, batch) or cos.shape[1:] != (tokens, head_dim):
        raise ValueError(
            f"rope_into_cache: cos/sin have shape {tuple(cos.shape)}; expected ({batch} or 1, "
            f"{tokens}, {head_dim}) or ({tokens}, {head_dim})"
        )
    if cos.stride(-1) != 1 or sin.stride(-1) != 1 or cos.stride() != sin.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    return cos, sin


def _check(q, k, v, keys, values, slots) -> None:
    _check_rotatable("q", q)
    batch, _, tokens, head_dim = q.shape
    if head_dim % 2:
        raise ValueError(f"rope_into_cache: head_dim {head_dim} is odd; RoPE pairs its halves")
    for name, x in (("k", k), ("v", v)):
        if x.dim() != 4 or x.shape[0] != batch or x.shape[2:] != (tokens, head_dim) or x.stride(-1) != 1:
            raise ValueError(
                f"rope_into_cache: {name} has shape {tuple(x.shape)} (last stride {x.stride(-1)}); "
                f"expected ({batch}, kv heads, {tokens}, {head_dim}) with a contiguous last dimension"
            )
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(
            f"rope_into_cache: q, k and v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    if v.shape != k.shape:
        raise ValueError(f"rope_into_cache: v has shape {tuple(v.shape)} but k {tuple(k.shape)}")
    for name, cache, x in (("keys", keys, k), ("values", values, v)):
        if cache.dim() != 4 or cache.shape[:2] != x.shape[:2] or cache.shape[3] != head_dim:
            raise ValueError(
                f"rope_into_cache: {name} has shape {tuple(cache.shape)}; expected "
                f"({batch}, {x.shape[1]}, slots, {head_dim})"
            )
        if cache.dtype != x.dtype:
            raise ValueError(
                f"rope_into_cache: {name} is {cache.dtype} but the {name[0]} written is {x.dtype}; "
                f"the cache must hold the activations' dtype"
            )
        if cache.stride(-1) != 1:
            raise ValueError(f"rope_into_cache: {name} needs a contiguous last dimension")
    if keys.stride() != values.stride():
        raise ValueError("rope_into_cache: keys and values must have the same strides")
    if slots.dim() != 1 or slots.numel() != tokens or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"rope_into_cache: slots must be {tokens} integer slot indices, one per token; got "
            f"shape {tuple(slots.shape)} {slots.dtype}"
        )
    devices = {x.device for x in (q, k, v, keys, values, slots)}
    if len(devices) != 1:
        raise ValueError(f"rope_into_cache: tensors on several devices: {sorted(map(str, devices))}")


def rope_into_cache_reference(q, k, v, cos, sin, keys, values, slots) -> torch.Tensor:
    """The same in plain torch: ``rope``'s rotation, then ``index_copy_`` into the cache."""
    q_rot, k_rot = rope_reference(q, k, cos, sin)
    q.copy_(q_rot)
    keys.index_copy_(2, slots, k_rot)
    values.index_copy_(2, slots, v)
    return q


@torch.no_grad()
def rope_into_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """Rotate q in place; write k rotated into ``keys`` and v into ``values`` at ``slots``
    (token t of every row to slot ``slots[t]``); returns q.  Inference only (no autograd):
    k itself is left as it was.  Shapes in the module's docstring."""
    _check(q, k, v, keys, values, slots)
    batch, n_q_heads, tokens, head_dim = q.shape
    cos, sin = _tables(cos, sin, batch, tokens, head_dim)
    if not use_triton(q):
        warn_reference_once("rope_into_cache", q.device.type)
        return rope_into_cache_reference(q, k, v, cos, sin, keys, values, slots)
    n_kv_heads = k.shape[1]
    block_half = triton.next_power_of_2(head_dim // 2)
    block_h = min(triton.next_power_of_2(max(n_q_heads, n_kv_heads)), max(1, MAX_TILE // block_half))
    _rope_cache_kernel[(batch * tokens,)](
        q,
        k,
        v,
        keys,
        values,
        cos,
        sin,
        slots,
        *(q.stride(0), q.stride(1), q.stride(2)),
        *(k.stride(0), k.stride(1), k.stride(2)),
        *(v.stride(0), v.stride(1), v.stride(2)),
        *(keys.stride(0), keys.stride(1), keys.stride(2)),
        0 if cos.shape[0] == 1 else cos.stride(0),
        cos.stride(1),
        tokens,
        n_q_heads,
        n_kv_heads,
        HALF_DIM=head_dim // 2,
        BLOCK_H=block_h,
        BLOCK_HALF=block_half,
        BLOCK_D=2 * block_half,
        num_warps=NUM_WARPS,
    )
    return q
