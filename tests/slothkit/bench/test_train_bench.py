"""`slothkit bench train` on CPU at tiny shapes: its logic and record, not its speed."""

import json

import pytest
import torch

from slothkit.bench.shapes import SHAPES, shape_by_name
from slothkit.bench.train_worker import build_model
from slothkit.cli import main


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-mistral", "tiny-gemma"])
def test_build_model_keeps_buffers_and_gives_finite_loss(name):
    from transformers import AutoModelForCausalLM

    model = build_model(name, torch.float32, "cpu", seed=0)
    reference = AutoModelForCausalLM.from_config(shape_by_name(name).config())
    expected = dict(reference.named_buffers())
    for buffer_name, buffer in model.named_buffers():  # rotary inv_freq, Gemma's embed_scale
        torch.testing.assert_close(buffer, expected[buffer_name].to(buffer.dtype), msg=buffer_name)
    ids = torch.randint(0, model.config.vocab_size, (1, 16))
    assert torch.isfinite(model(input_ids=ids, labels=ids).loss)


def test_unknown_shape_lists_the_known_ones():
    with pytest.raises(ValueError, match="llama-3-8b.*gemma-7b"):
        shape_by_name("llama-9")


def test_flops_counted_from_real_shapes():
    # Llama-3-8B: 6.98e9 in the projections plus 0.53e9 in the head, so about
    # 45 GFLOP per trained token (6 x), as shared/GPU.md's floor estimate says.
    assert 7.4e9 < SHAPES["llama-3-8b"].matmul_parameters() < 7.6e9


def test_tiny_run_writes_a_record(tmp_path, capsys):
    output = tmp_path / "record.json"
    code = main(["bench", "train", "--model", "tiny-llama", "--dtype", "fp32", "--seq", "32",
                 "--steps", "2", "--warmup", "1", "--impl", "slothkit,hf,unsloth",
                 "--output", str(output)])
    assert code == 0
    record = json.loads(output.read_text())
    rows = {row["impl"]: row for row in record["rows"]}
    assert rows["slothkit"]["status"] == "ok" and rows["hf"]["status"] == "ok"
    assert rows["hf"]["vs_hf"] == pytest.approx(1.0)
    for impl in ("slothkit", "hf"):
        assert rows[impl]["tokens_per_s"] > 0
        assert len(rows[impl]["losses"]) == 3
        assert all(torch.isfinite(torch.tensor(rows[impl]["losses"])))
    # Same model, data and LoRA init: the first losses agree.
    assert rows["slothkit"]["losses"][0] == pytest.approx(rows["hf"]["losses"][0], rel=1e-4)
    # A peer that is not installed is reported, never faked.
    assert rows["unsloth"]["status"] in ("skipped", "error")
    assert record["versions"]["torch"] and record["command"].startswith("slothkit")
    table = capsys.readouterr().out
    assert "| slothkit | ok |" in table and "unsloth" in table


def test_real_shape_without_gpu_says_so():
    if torch.cuda.is_available():
        pytest.skip("checks the message shown without a GPU")
    with pytest.raises(SystemExit, match="no CUDA GPU.*tiny-llama"):
        main(["bench", "train", "--model", "llama-3-8b", "--impl", "hf"])


def test_unknown_implementation_is_refused():
    with pytest.raises(ValueError, match="known: slothkit, hf, liger, unsloth"):
        main(["bench", "train", "--model", "tiny-llama", "--impl", "deepspeed"])
