"""Kernel launches per decoder layer per training step, counted on the CPU.

Part of a training step on a fast GPU is bound by the CPU, which pays for every launch;
this holds the fused path to well under the plain HF + PEFT path's count in the same
run (145 against 314 per Llama layer when written), so that a change that adds launches
per layer shows up here rather than only as a slower step on the GPU.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "count_launches.py"


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-gemma"])
def test_fused_path_launches_well_under_hf_per_layer(model):
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--model", model, "--json"], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-2000:]
    counts = json.loads(result.stdout.strip().splitlines()[-1])["launches_per_layer"]
    assert counts["hf"] > 100  # the count works at all
    assert counts["slothkit"] <= 0.6 * counts["hf"], counts
