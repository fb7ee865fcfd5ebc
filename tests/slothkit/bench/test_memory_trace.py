"""Reading an allocator trace: the allocated and reserved peaks and each pool's state,
on a trace written out by hand in the snapshot's format (the GPU run is
scripts/memory_peak.py)."""

from slothkit.bench.memory_trace import allocated_peak, owner, pools, reserved_peak

MIB = 2**20


def _frames(*names):
    return [{"filename": f"/site/slothkit/engine/{name}.py", "line": 7, "name": name} for name in names]


def _trace():
    """Two layers' work: a 4 MiB and a 2 MiB tensor, the 4 MiB freed, a 6 MiB tensor (the
    peak, 8 MiB live), everything freed; the allocator takes a 20 MiB segment for the
    first tensor, a 64 MiB one for the graph's working set and gives the first back."""
    return [
        {"action": "segment_alloc", "addr": 1000, "size": 20 * MIB, "frames": _frames("first")},
        {"action": "alloc", "addr": 1000, "size": 4 * MIB, "frames": _frames("first")},
        {"action": "alloc", "addr": 1100, "size": 2 * MIB, "frames": _frames("second")},
        {"action": "free_requested", "addr": 1000, "size": 4 * MIB},
        {"action": "free_completed", "addr": 1000, "size": 4 * MIB},
        {"action": "segment_alloc", "addr": 5000, "size": 64 * MIB, "frames": _frames("graph")},
        {"action": "alloc", "addr": 5000, "size": 6 * MIB, "frames": _frames("graph", "capture")},
        {"action": "free_requested", "addr": 5000, "size": 6 * MIB},
        {"action": "free_requested", "addr": 1100, "size": 2 * MIB},
        {"action": "segment_free", "addr": 1000, "size": 20 * MIB},
        {"action": "free_requested", "addr": 9999, "size": 1 * MIB},  # made before recording
    ]


def _segments():
    return [
        {
            "address": 5000,
            "total_size": 64 * MIB,
            "allocated_size": 10 * MIB,
            "segment_pool_id": (1, 3),
            "blocks": [
                {"address": 5000, "size": 10 * MIB, "state": "active_allocated", "frames": _frames("kept")},
                {"address": 5000 + 10 * MIB, "size": 30 * MIB, "state": "inactive"},
                {"address": 5000 + 40 * MIB, "size": 24 * MIB, "state": "inactive"},
            ],
        },
        {
            "address": 7000,
            "total_size": 2 * MIB,
            "allocated_size": 0,
            "segment_pool_id": (0, 0),
            "blocks": [{"address": 7000, "size": 2 * MIB, "state": "inactive"}],
        },
    ]


def test_owner_names_the_two_innermost_frames_of_our_code():
    frames = [
        {"filename": "/site/torch/nn/functional.py", "line": 1, "name": "linear"},
        *_frames("decoder_layer", "decoder", "fast_model"),
    ]
    assert owner(frames) == "engine/decoder_layer.py:7 decoder_layer < engine/decoder.py:7 decoder"
    assert owner([{"filename": "/site/transformers/x.py", "line": 1, "name": "f"}]).startswith("other")


def test_the_allocated_peak_and_what_was_live_then():
    peak = allocated_peak(_trace())
    assert peak.bytes == 8 * MIB and peak.index == 6
    assert peak.made_by == "engine/graph.py:7 graph < engine/capture.py:7 capture"
    assert [(size, count) for _, size, count in peak.groups] == [(6 * MIB, 1), (2 * MIB, 1)]


def test_the_reserved_peak_by_pool_and_the_allocation_that_took_each_segment():
    peak = reserved_peak(_trace(), _segments())
    assert peak.bytes == 84 * MIB and peak.index == 5
    assert peak.groups == [
        ("private pool (1, 3): engine/graph.py:7 graph", 64 * MIB, 1),
        ("released before the snapshot: engine/first.py:7 first", 20 * MIB, 1),
    ]


def test_each_pools_state_at_the_snapshot():
    states = pools(_segments())
    assert list(states) == ["ordinary pool", "private pool (1, 3)"]
    graph = states["private pool (1, 3)"]
    assert (graph.reserved, graph.allocated, graph.cached) == (64 * MIB, 10 * MIB, 54 * MIB)
    assert graph.largest_cached == 30 * MIB and graph.segments == 1
    assert graph.live == [("engine/kept.py:7 kept", 10 * MIB, 1)]
    ordinary = states["ordinary pool"]
    assert (ordinary.reserved, ordinary.cached, ordinary.live) == (2 * MIB, 2 * MIB, [])
