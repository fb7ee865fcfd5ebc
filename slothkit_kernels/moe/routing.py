"""Routing: which sorted row belongs to which token and expert, and the tile schedule.

A token's top_k assignments are flattened to M = T * top_k rows, row t * top_k + j
going to expert ``expert_ids[t, j]``.  A stable sort by expert groups each expert's
rows together: sorted row i reads token ``tokens[i]``; the rows of expert e are
``offsets[e] .. offsets[e + 1] - 1``.  An id outside [0, E) (Qwen3-MoE and Mixtral
skip the id E, the slot an expert-parallel split leaves to another rank) goes to no
expert: it sorts last, past ``offsets[E]``, and contributes nothing.

The grouped kernels run on tiles of ``block_m`` rows of one expert.  Their number
depends on the routing, so the grid is launched at its upper bound,
ceil(M / block_m) + E tiles (each expert wastes at most one partial tile), and a tile
past the last real one has expert -1 and returns at once.  Everything here is torch
on the device and reads nothing back to the host: no synchronisation in a training
step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton


@dataclass
class ExpertRouting:
    num_experts: int  # E
    top_k: int
    block_m: int  # rows per tile of the grouped kernels
    tokens: torch.Tensor  # (M,) int32: the token (row of x) each sorted row reads
    order: torch.Tensor  # (M,) int64: the flat assignment t * top_k + j of each sorted row
    row_expert: torch.Tensor  # (M,) int32: the expert of each sorted row (E when none)
    inverse: torch.Tensor  # (M,) int32: the sorted row of each flat assignment, -1 when none
    offsets: torch.Tensor  # (E + 1,) int32: expert e's rows start at offsets[e]
    tile_expert: torch.Tensor  # (tiles,) int32: expert of each tile, -1 past the last
    tile_row: torch.Tensor  # (tiles,) int32: first sorted row of each tile

    @property
    def num_rows(self) -> int:
        return self.tokens.shape[0]

    @property
    def num_tiles(self) -> int:
        return self.tile_expert.shape[0]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (
            self.tokens,
            self.order,
            self.row_expert,
            self.inverse,
            self.offsets,
            self.tile_expert,
            self.tile_row,
        )

    def with_tensors(self, tensors) -> ExpertRouting:
        return ExpertRouting(self.num_experts, self.top_k, self.block_m, *tensors)


def route_to_experts(expert_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertRouting:
    """Sort the (T, top_k) assignments by expert and build the tile schedule (module docstring)."""
    if expert_ids.dim() != 2:
        raise ValueError(f"expert_ids must be (tokens, top_k), got shape {tuple(expert_ids.shape)}")
    if expert_ids.dtype.is_floating_point or expert_ids.dtype == torch.bool:
        raise TypeError(f"expert_ids must be an integer tensor, got {expert_ids.dtype}")
    top_k = expert_ids.shape[1]
    device = expert_ids.device
    flat = expert_ids.reshape(-1).long()
    valid = (flat >= 0) & (flat < num_experts)
    keys = torch.where(valid, flat, num_experts)  # (M,), E = no expert
    row_expert, order = torch.sort(keys, stable=True)
    m = flat.shape[0]
    tokens = (order // top_k).to(torch.int32)
    inverse = torch.empty(m, dtype=torch.int64, device=device)
    inverse[order] = torch.arange(m, device=device)
    inverse = torch.where(valid, inverse, -1).to(torch.int32)

    # scatter_add rather than bincount: bincount reads the largest id back to the host.
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, keys, torch.ones_like(keys))
    counts = counts[:num_experts]
    offsets = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    torch.cumsum(counts, 0, out=offsets[1:])

    tiles_per_expert = (counts + block_m - 1) // block_m
    tile_end = torch.cumsum(tiles_per_expert, 0)  # (E,)
    max_tiles = triton.cdiv(m, block_m) + num_experts
    tile = torch.arange(max_tiles, device=device)
    expert = torch.searchsorted(tile_end, tile, right=True)  # (tiles,), E past the last tile
    clamped = expert.clamp(max=num_experts - 1)
    first_tile = tile_end[clamped] - tiles_per_expert[clamped]
    tile_row = offsets[clamped] + (tile - first_tile) * block_m
    tile_expert = torch.where(expert < num_experts, expert, -1)
    return ExpertRouting(
        num_experts=num_experts,
        top_k=top_k,
        block_m=block_m,
        tokens=tokens,
        order=order,
        row_expert=row_expert.to(torch.int32),
        inverse=inverse,
        offsets=offsets.to(torch.int32),
        tile_expert=tile_expert.to(torch.int32),
        tile_row=tile_row.to(torch.int32),
    )
