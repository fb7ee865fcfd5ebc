"""Reading the CUDA caching allocator's trace (``torch.cuda.memory._snapshot()`` after
``_record_memory_history``): what was live at the allocated peak, and what the allocator
had reserved at the reserved peak, by the code that made it and the pool it sits in.

Allocated memory is what tensors hold; reserved memory is what the allocator took from
the device in segments (``cudaMalloc``, or mapped pages of an expandable segment), and
is what an out-of-memory error and nvidia-smi are about.  The two differ by the blocks
the allocator keeps cached between uses, and by the private pools of CUDA graphs, whose
blocks a replay writes to and so stay reserved while the graph lives.

Trace events (``snapshot["device_traces"][device]``) come in order; each has an
``action``: ``alloc`` / ``free_requested`` move the allocated counter (a block used on
another stream completes its free later, but no longer counts as allocated);
``segment_alloc`` / ``segment_free`` (``segment_map`` / ``segment_unmap`` for
expandable segments) move the reserved one, and their ``frames`` are the Python stack of
the allocation that made the allocator grow.  The snapshot's ``segments`` are the
segments held when it was taken, each with its ``segment_pool_id`` ((0, 0) is the
ordinary pool) and its ``blocks``.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

# Where a stack frame is "ours": the innermost two such frames name an allocation.
OWN_CODE = ("slothkit", "scripts/", "torch/optim")  # "slothkit" covers slothkit_kernels

_GROWS = ("segment_alloc", "segment_map")
_SHRINKS = ("segment_free", "segment_unmap")


def owner(frames: list[dict], own_code: tuple[str, ...] = OWN_CODE) -> str:
    """The two innermost frames in slothkit, its kernels, a script or the optimizer
    (frames come innermost first), as 'file:line name < caller file:line name'."""
    ours = []
    for frame in frames:
        name = frame.get("filename", "")
        if any(part in name for part in own_code):
            short = name.split("/slothkit/")[-1].split("/slothkit_kernels/")[-1].split("/torch/")[-1]
            short = short.split("/scripts/")[-1]
            ours.append(f"{short}:{frame.get('line')} {frame.get('name')}")
            if len(ours) == 2:
                break
    return " < ".join(ours) or "other (no slothkit frame)"


@dataclass
class Peak:
    """A counter's highest point in a trace: ``bytes`` above where the trace began, the
    index of the event that reached it, what was live then grouped as (group, bytes,
    count) largest first, and the owner of the event that made the peak."""

    bytes: int
    index: int
    groups: list[tuple[str, int, int]]
    made_by: str


def _ranked(live: dict[int, tuple[int, str]]) -> list[tuple[str, int, int]]:
    groups: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for size, group in live.values():
        groups[group][0] += size
        groups[group][1] += 1
    return sorted(((group, b, n) for group, (b, n) in groups.items()), key=lambda g: -g[1])


def _peak(events: list[dict], grows: tuple[str, ...], shrinks: tuple[str, ...], group_of) -> Peak:
    live: dict[int, tuple[int, str]] = {}
    total = peak = 0
    peak_index = -1
    peak_live: dict[int, tuple[int, str]] = {}
    for index, event in enumerate(events):
        action = event.get("action")
        if action in grows:
            live[event["addr"]] = (event["size"], group_of(event))
            total += event["size"]
            if total > peak:
                peak, peak_index, peak_live = total, index, dict(live)
        elif action in shrinks:
            # Memory taken before recording began is not in `live`: the event's own size.
            size, _ = live.pop(event["addr"], (event.get("size", 0), ""))
            total -= size
    made_by = owner(events[peak_index].get("frames", [])) if peak_index >= 0 else "-"
    return Peak(peak, peak_index, _ranked(peak_live), made_by)


def allocated_peak(events: list[dict]) -> Peak:
    """The allocated counter's peak, and the blocks live then by the code that made them."""
    return _peak(events, ("alloc",), ("free_requested",), lambda e: owner(e.get("frames", [])))


def pool_name(pool_id) -> str:
    return "ordinary pool" if tuple(pool_id) == (0, 0) else f"private pool {tuple(pool_id)}"


def reserved_peak(events: list[dict], segments: list[dict]) -> Peak:
    """The reserved counter's peak, and the segments held then, grouped by the pool they
    belong to (known for segments still held at the snapshot) and the code whose
    allocation made the allocator take each one."""
    pools = {segment["address"]: pool_name(segment["segment_pool_id"]) for segment in segments}

    def group_of(event):
        pool = pools.get(event["addr"], "released before the snapshot")
        return f"{pool}: {owner(event.get('frames', []))}"

    return _peak(events, _GROWS, _SHRINKS, group_of)


@dataclass
class PoolState:
    """One pool's segments at the snapshot: reserved and allocated bytes, the cached
    (inactive) bytes, the largest cached block (an allocation larger than it needs a new
    segment however much is cached), and the live blocks by the code that made them."""

    reserved: int
    allocated: int
    cached: int
    largest_cached: int
    segments: int
    live: list[tuple[str, int, int]]


def pools(segments: list[dict]) -> dict[str, PoolState]:
    """Each pool's state at the snapshot, ordinary pool first."""
    by_pool: dict[str, list[dict]] = collections.defaultdict(list)
    for segment in segments:
        by_pool[pool_name(segment["segment_pool_id"])].append(segment)
    states = {}
    for name in sorted(by_pool, key=lambda n: (n != "ordinary pool", n)):
        held = by_pool[name]
        blocks = [block for segment in held for block in segment.get("blocks", [])]
        cached = [block["size"] for block in blocks if block.get("state") == "inactive"]
        live = {
            block["address"]: (block["size"], owner(block.get("frames", [])))
            for block in blocks
            if block.get("state") != "inactive"
        }
        states[name] = PoolState(
            reserved=sum(segment["total_size"] for segment in held),
            allocated=sum(segment["allocated_size"] for segment in held),
            cached=sum(cached),
            largest_cached=max(cached, default=0),
            segments=len(held),
            live=_ranked(live),
        )
    return states
