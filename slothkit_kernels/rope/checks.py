"""What ``rope`` and ``rotate`` accept, checked before anything is written: q and k
(B, heads, T, D) that can be rotated in place, and cos/sin either gathered per token or a
table with position_ids; the tables are returned in the kernel's layout.
"""

from __future__ import annotations

import torch

from slothkit_kernels.utils import check_float_dtype, check_not_empty, check_same_device


def _check_rotatable(name: str, x: torch.Tensor) -> None:
    if x.dim() != 4:
        raise ValueError(f"rope: {name} has shape {tuple(x.shape)}; expected (B, heads, T, D)")
    check_float_dtype(f"rope: {name}", x)
    check_not_empty(f"rope: {name}", x)
    if x.stride(-1) != 1:
        raise ValueError(
            f"rope: {name} has stride {x.stride(-1)} along its last dimension (head_dim); "
            f"rope writes in place and needs it contiguous (stride 1); call .contiguous() first"
        )
    if any(stride == 0 and size > 1 for size, stride in zip(x.shape, x.stride())):
        raise ValueError(
            f"rope: {name} has a stride of 0 (shape {tuple(x.shape)}, strides {x.stride()}), "
            f"so its elements share memory and cannot be rotated in place; pass a copy"
        )
    if torch.is_grad_enabled() and x.requires_grad and x.is_leaf:
        raise ValueError(
            f"rope: {name} is a leaf tensor that requires grad; rope rotates in place, which "
            f"autograd forbids on leaves; pass a non-leaf such as {name}.clone()"
        )


def _normalise_tables(q, k, cos, sin, position_ids):
    """Check shapes and return (cos, sin, position_ids) in the kernel's layout:
    gathered (Bc, T, D) or a (max_positions, D) table, contiguous."""
    batch, _, seq_len, head_dim = q.shape
    for name, t in (("cos", cos), ("sin", sin)):
        check_float_dtype(f"rope: {name}", t)
        if t.requires_grad:
            raise ValueError(
                f"rope: {name} requires grad, but rope does not differentiate with respect to "
                f"cos/sin; pass {name}.detach()"
            )
    if cos.shape != sin.shape:
        raise ValueError(
            f"rope: cos has shape {tuple(cos.shape)} but sin has {tuple(sin.shape)}; they must match"
        )
    if cos.shape[-1] != head_dim:
        raise ValueError(
            f"rope: cos/sin have last dimension {cos.shape[-1]} but q and k have head_dim "
            f"{head_dim}; they must match"
        )

    if position_ids is None:
        if cos.dim() == 2:  # (T, D)
            cos, sin = cos[None], sin[None]
        if cos.dim() != 3:
            raise ValueError(
                f"rope: cos/sin have shape {tuple(cos.shape)}; without position_ids expected "
                f"(B, T, D), (1, T, D) or (T, D) with B={batch}, T={seq_len}, D={head_dim}"
            )
        if cos.shape[1] != seq_len:
            raise ValueError(f"rope: cos/sin cover {cos.shape[1]} tokens but q and k have T={seq_len}")
        if cos.shape[0] not in (1, batch):
            raise ValueError(
                f"rope: cos/sin have batch size {cos.shape[0]} but q and k have B={batch}; "
                f"expected {batch} or 1"
            )
        if cos.shape[0] > 1 and cos.stride(0) == 0 and sin.stride(0) == 0:
            cos, sin = cos[:1], sin[:1]  # an expanded (1, T, D): read it once per batch row
        return cos.contiguous(), sin.contiguous(), None

    if cos.dim() != 2:
        raise ValueError(
            f"rope: with position_ids, cos/sin must be a (max_positions, D) table; "
            f"got shape {tuple(cos.shape)}"
        )
    if (
        position_ids.dtype.is_floating_point
        or position_ids.dtype.is_complex
        or (position_ids.dtype == torch.bool)
    ):
        raise TypeError(f"rope: position_ids has dtype {position_ids.dtype}; expected an integer dtype")
    if (
        position_ids.dim() != 2
        or position_ids.shape[1] != seq_len
        or (position_ids.shape[0] not in (1, batch))
    ):
        raise ValueError(
            f"rope: position_ids has shape {tuple(position_ids.shape)}; expected "
            f"({batch}, {seq_len}) or (1, {seq_len})"
        )
    return cos.contiguous(), sin.contiguous(), position_ids


def _check_positions_in_table(position_ids: torch.Tensor, n_positions: int) -> None:
    low, high = torch.stack(torch.aminmax(position_ids)).tolist()  # one device sync
    if low < 0 or high >= n_positions:
        raise ValueError(
            f"rope: position_ids range over [{low}, {high}] but the cos/sin table has "
            f"{n_positions} rows (valid positions 0..{n_positions - 1})"
        )


def _checked_tables(q, k, cos, sin, position_ids, check_positions: bool):
    """Check that q and k can be rotated together with these tables, and return the
    tables in the kernel's layout (shared by ``rope`` and ``rotate``)."""
    check_same_device(q=q, k=k, cos=cos, sin=sin, position_ids=position_ids)
    if k.dtype != q.dtype:
        raise TypeError(f"rope: k has dtype {k.dtype} but q has {q.dtype}; they must match")
    if k.shape[0] != q.shape[0] or k.shape[2:] != q.shape[2:]:
        raise ValueError(
            f"rope: q has shape {tuple(q.shape)} and k {tuple(k.shape)}; batch, tokens and "
            f"head_dim must match (B, heads, T, D)"
        )
    if q.shape[-1] % 2:
        raise ValueError(f"rope: head_dim {q.shape[-1]} is odd; rotate_half needs an even head_dim")
    if q.data_ptr() == k.data_ptr():
        raise ValueError("rope: q and k are the same memory; it would be rotated twice")
    cos, sin, position_ids = _normalise_tables(q, k, cos, sin, position_ids)
    if position_ids is not None and check_positions:
        _check_positions_in_table(position_ids, cos.shape[0])
    return cos, sin, position_ids
