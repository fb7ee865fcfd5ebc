"""`slothkit bench generate`'s host-side logic: batch parsing, rows against HF, the table.
(The GPU run itself is scripts/gpu_bench.sh on the H200.)"""

import pytest

from slothkit.bench.generate import _batches, format_table, summarise


def test_batches_are_positive_integers():
    assert _batches("1,8") == [1, 8]
    for bad in ("", "0", "1,x", "-2"):
        with pytest.raises(ValueError, match="--batch"):
            _batches(bad)


def test_rows_compare_speed_time_to_first_token_and_tokens_with_hf():
    results = {
        (1, "hf"): {"status": "ok", "tokens_per_s": 30.0, "ttft_s": 0.2, "first_tokens": [[5, 6, 7]]},
        (1, "slothkit"): {"status": "ok", "tokens_per_s": 75.0, "ttft_s": 0.1, "first_tokens": [[5, 6, 7]]},
        (8, "hf"): {"status": "ok", "tokens_per_s": 200.0, "first_tokens": [[1], [2], [3]]},
        (8, "slothkit"): {"status": "ok", "tokens_per_s": 500.0, "first_tokens": [[1], [9], [3]]},
        (8, "unsloth"): {"status": "skipped", "error": "not importable"},
    }
    rows = {(r["batch"], r["impl"]): r for r in summarise(results)}
    assert rows[(1, "slothkit")]["vs_hf"] == pytest.approx(2.5)
    assert rows[(1, "slothkit")]["ttft_vs_hf"] == pytest.approx(0.5)
    assert rows[(8, "slothkit")]["rows_equal_hf"] == "2/3"
    assert rows[(8, "unsloth")]["status"] == "skipped"
    table = format_table(summarise(results)).splitlines()
    assert table[0].startswith("| impl |") and len(table) == 2 + len(results)
    assert "| slothkit | 8 | 500.0 | 2.50 |" in "\n".join(table)
