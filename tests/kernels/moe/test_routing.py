"""route_to_experts: the sort by expert and the tile schedule the grouped kernels walk."""

import pytest
import torch

from slothkit_kernels.moe.routing import route_to_experts


@pytest.mark.parametrize(
    "tokens,top_k,experts,block_m",
    [(13, 2, 5, 16), (40, 3, 4, 16), (7, 1, 9, 4), (33, 2, 3, 8)],
)
def test_routing_sorts_rows_and_tiles_cover_each_row_once(tokens, top_k, experts, block_m):
    gen = torch.Generator().manual_seed(tokens * top_k)
    ids = torch.randint(0, experts + 1, (tokens, top_k), generator=gen)  # E: no expert
    ids[0, 0] = -1  # negative: no expert either
    routing = route_to_experts(ids, experts, block_m)
    flat = ids.reshape(-1)
    valid = (flat >= 0) & (flat < experts)

    # Sorted rows: expert by expert, each expert's rows in token order (stable sort).
    offsets = routing.offsets.tolist()
    assert offsets[0] == 0 and offsets[-1] == int(valid.sum())
    for e in range(experts):
        rows = routing.order[offsets[e] : offsets[e + 1]]
        assert (flat[rows] == e).all()
        assert (rows.diff() > 0).all()
        assert offsets[e + 1] - offsets[e] == int((flat == e).sum())
    assert torch.equal(routing.tokens.long(), routing.order // top_k)
    # inverse: the sorted row of each assignment, -1 for none.
    inverse = routing.inverse.long()
    assert (inverse[~valid] == -1).all()
    assert torch.equal(routing.order[inverse[valid]], torch.arange(flat.numel())[valid])

    # Tiles: at most ceil(M / block_m) + E of them; the live ones cover every row of
    # every expert exactly once, within that expert.
    assert routing.num_tiles == -(-flat.numel() // block_m) + experts
    covered = torch.zeros(flat.numel(), dtype=torch.long)
    for e, start in zip(routing.tile_expert.tolist(), routing.tile_row.tolist()):
        if e < 0:
            continue
        assert offsets[e] <= start < offsets[e + 1]
        covered[start : min(start + block_m, offsets[e + 1])] += 1
    assert (covered[: offsets[-1]] == 1).all() and (covered[offsets[-1] :] == 0).all()
    # Dead tiles come last.
    live = routing.tile_expert >= 0
    assert not live[int(live.sum()) :].any()


def test_routing_refuses_non_integer_ids():
    with pytest.raises(TypeError, match="integer"):
        route_to_experts(torch.zeros(3, 2), 4, 16)
    with pytest.raises(ValueError, match=r"\(tokens, top_k\)"):
        route_to_experts(torch.zeros(3, dtype=torch.long), 4, 16)
