"""The context-length bisection, with a fake probe whose memory limit is known."""

import argparse

import pytest

from slothkit.bench.context import longest_sequence


def _args(**overrides):
    base = dict(
        model="tiny-llama",
        mode="qlora",
        dtype="bf16",
        memory_gib=24.0,
        min_seq=4096,
        max_seq=131072,
        granularity=4096,
        rank=16,
        impl="hf",
    )
    return argparse.Namespace(**{**base, **overrides})


def _probe_with_limit(limit):
    seen = []

    def probe(impl, args):
        seen.append(args.seq)
        assert args.batch == 1 and args.steps == 1
        if args.seq <= limit:
            return {"status": "ok", "peak_allocated_gib": args.seq / 4096}
        return {"status": "out of memory", "error": "CUDA out of memory"}

    return probe, seen


@pytest.mark.parametrize("limit", [4096, 8192, 49152, 61440, 131072])
def test_bisection_finds_the_boundary(limit):
    probe, seen = _probe_with_limit(limit)
    row = longest_sequence("hf", _args(), probe=probe)
    assert row["longest_seq"] == limit
    expected_failing = limit + 4096 if limit < 131072 else None
    assert row["first_failing_seq"] == expected_failing
    assert len(seen) <= 7  # log2(32) + 2 probes, not a linear scan


def test_nothing_fits():
    probe, _ = _probe_with_limit(0)
    row = longest_sequence("hf", _args(), probe=probe)
    assert row["longest_seq"] is None and row["first_failing_seq"] == 4096


def test_missing_peer_is_skipped_not_faked():
    row = longest_sequence(
        "unsloth", _args(), probe=lambda impl, args: {"status": "skipped", "error": "not importable"}
    )
    assert row["status"] == "skipped" and "not importable" in row["error"]
