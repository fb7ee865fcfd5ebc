"""Two processes under DistributedDataParallel or FSDP2 (torchrun, gloo, CPU) train a tiny
FastModel exactly as one process does with the same global batch: the loss of every step
and the final LoRA adapters agree to 1e-5 (fp32; the adapters also to 0.1% of their size,
see _assert_same_training).  slothkit.testing.distributed_parity
holds the runs.

Each test starts torchrun once (about half a minute on a 2-core CPU, mostly imports) and
runs the single-process reference in the test's own process.  On a machine with a GPU the
processes would not run on the CPU alone; the GPU runs are docs/multi-gpu.md's commands.
"""

import pytest
import torch

pytest.importorskip("trl")

from slothkit.testing import tiny_model_path
from slothkit.testing.distributed_parity import (
    FSDP_RUNS,
    GLOBAL_BATCH,
    LOOP_SETTINGS,
    STEPS,
    loop_run,
    run_processes,
    sft_run,
)

pytestmark = [
    pytest.mark.usefixtures("quiet_training"),  # tests/slothkit/conftest.py
    pytest.mark.skipif(torch.cuda.is_available(), reason="compares gloo processes on the CPU"),
]
TOLERANCE = 1e-5


def _assert_same_training(ddp: dict, single: dict) -> None:
    assert len(single["losses"]) == STEPS
    torch.testing.assert_close(
        torch.tensor(ddp["losses"]), torch.tensor(single["losses"]), rtol=0, atol=TOLERANCE
    )
    assert ddp["lora"].keys() == single["lora"].keys()
    # Adam's step is lr * m / (sqrt(v) + eps): about +-lr whatever the gradient's size, so
    # an element whose gradient sits near zero turns the two runs' different summation
    # orders (gradients averaged across processes against one batch's sum, ~1e-7) into a
    # step difference of ~1e-5 on a weight of ~0.04 (measured: one of 1,536 elements,
    # 1.2e-5, 3e-4 of its value).  So the weights may also differ by 0.1% of their size.
    for name, weight in ddp["lora"].items():
        torch.testing.assert_close(weight, single["lora"][name], rtol=1e-3, atol=TOLERANCE, msg=name)
    # B starts at zero: the adapters moved far beyond the tolerance (a few steps of a
    # learning rate of about 1e-3 for Adam, farther for SGD's 0.5).
    moved = max(w.abs().max().item() for n, w in single["lora"].items() if "lora_B" in n)
    assert moved > 100 * TOLERANCE


def test_plain_loop_under_ddp_matches_one_process(reference_kernels, tmp_path):
    """torch's DDP around the PeftModel, offloaded checkpointing: 2 processes x batch 2
    against 1 x batch 4; also with the layer graphs' replay (run on the CPU), whose
    gradients must reach DDP's reducer too."""
    model = str(tiny_model_path("llama"))
    processes = run_processes("loop", model, tmp_path)
    single = loop_run(model, "offload")  # here: no launcher, the whole batch of GLOBAL_BATCH rows
    assert GLOBAL_BATCH == 4
    for result in processes:
        for setting in LOOP_SETTINGS:
            _assert_same_training(result[setting], single)
        assert result["offload-graphs"]["graphs"] > 0  # replayed: their gradients were all-reduced


def test_fsdp2_matches_one_process_and_ddp(reference_kernels, tmp_path):
    """FSDP2 (fully_shard on each decoder layer, then the model) with offloaded
    checkpointing: in fp32 as one process trains, with the layer graphs off for the
    sharded layers (their gathered weights move); on bf16 base weights exactly as DDP
    trains (splitting the batch changes bf16's rounding; sharding must change nothing)."""
    model = str(tiny_model_path("llama"))
    processes = run_processes("fsdp", model, tmp_path)
    single = loop_run(model, "offload")
    assert set(FSDP_RUNS) == {"fsdp-fp32", "fsdp-bf16", "ddp-bf16"}
    for result in processes:
        _assert_same_training(result["fsdp-fp32"], single)
        assert result["fsdp-fp32"]["graphs"] == 0  # asked for, refused for sharded layers
        sharded, replicated = result["fsdp-bf16"], result["ddp-bf16"]
        assert sharded["losses"] == replicated["losses"]
        for name, weight in sharded["lora"].items():
            torch.testing.assert_close(weight, replicated["lora"][name], rtol=0, atol=1e-6, msg=name)
        assert sharded["losses"] != single["losses"]  # bf16 weights: a different run


def test_sft_trainer_under_ddp_matches_one_process(reference_kernels, tmp_path):
    """slothkit.trl's SFTTrainer under torchrun (the Trainer wraps the model
    in DDP itself), offloaded checkpointing, per-device batch 2 x 2 processes against one
    process with batch 4: the same samples in the same order, losses and adapters equal."""
    model = str(tiny_model_path("llama"))
    processes = run_processes("sft", model, tmp_path)
    single = sft_run(model, str(tmp_path / "single"))
    assert single["ddp_find_unused_parameters"] is None  # one process: no DDP settings
    for result in processes:
        # Set by sft_config: the Trainer's default (True for a PeftModel) stops DDP with
        # offloaded checkpointing at the first step.
        assert result["ddp_find_unused_parameters"] is False
        _assert_same_training(result, single)
