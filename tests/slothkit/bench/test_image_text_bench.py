"""`slothkit bench` on image-text shapes, on CPU: the real shapes' sizes and image layout
(on the meta device), the random batches as the processor lays them out, and tiny
shapes trained and decoded end to end by slothkit and by HF + PEFT."""

import json

import numpy as np
import pytest
import torch

from slothkit.bench.image_text_batch import generation_prompts, image_block, image_pixels, training_batch
from slothkit.bench.model_setup import build_model
from slothkit.cli import main
from slothkit.models import IMAGE_TEXT_SHAPES, SHAPES, language_shape_by_name

pytest.importorskip("peft")

TINY = ["tiny-gemma3-vision", "tiny-qwen2.5-vl"]


def _on_meta(name):
    from accelerate import init_empty_weights
    from transformers import AutoModelForImageTextToText

    with init_empty_weights(include_buffers=False):
        model = AutoModelForImageTextToText.from_config(IMAGE_TEXT_SHAPES[name].config())
    model.tie_weights()  # as build_model ties them (Gemma 3's head is its embeddings)
    return model


@pytest.mark.parametrize(
    ("name", "text_shape", "parameters"),
    # The published parameter counts: Gemma 3 4B 4.30B, Qwen2.5-VL 7B 8.29B.
    [("gemma-3-4b-vision", "gemma-3-4b", 4.30e9), ("qwen2.5-vl-7b", "qwen2.5-7b", 8.29e9)],
)
def test_real_shapes_build_with_their_language_model(name, text_shape, parameters):
    model = _on_meta(name)
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(parameters, rel=0.005)
    text, expected = model.config.get_text_config(), SHAPES[text_shape]
    for field in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_key_value_heads",
        "vocab_size",
    ):
        assert getattr(text, field) == getattr(expected, field), field
    assert language_shape_by_name(name).hidden_size == expected.hidden_size
    assert IMAGE_TEXT_SHAPES[name].image_tokens() == 256


def test_gemma3_vision_tower_gives_256_tokens_an_image():
    model = _on_meta("gemma-3-4b-vision")
    shape = IMAGE_TEXT_SHAPES["gemma-3-4b-vision"]
    pixels = image_pixels(shape, 2, torch.Generator().manual_seed(0))["pixel_values"]
    assert pixels.shape == (2, 3, 896, 896)
    features = model.model.get_image_features(pixel_values=pixels.to("meta")).pooler_output
    assert features.shape == (2, 256, 2560)  # 256 tokens an image, of the language model's width


def test_qwen_pixels_match_its_image_processor_and_merge_to_256_tokens():
    from PIL import Image
    from transformers import Qwen2VLImageProcessor

    shape = IMAGE_TEXT_SHAPES["qwen2.5-vl-7b"]
    image = Image.fromarray(np.random.RandomState(0).randint(0, 255, (448, 448, 3), dtype=np.uint8))
    processed = Qwen2VLImageProcessor()(images=[image], return_tensors="pt")  # its default resolution range
    ours = image_pixels(shape, 1, torch.Generator().manual_seed(0))
    assert ours["pixel_values"].shape == processed["pixel_values"].shape == (1024, 1176)
    assert ours["image_grid_thw"].tolist() == processed["image_grid_thw"].tolist() == [[1, 32, 32]]
    merger = _on_meta("qwen2.5-vl-7b").model.visual.merger
    assert merger(torch.empty(1024, 1280, device="meta")).shape == (256, 3584)


@pytest.mark.parametrize("name", [*TINY, "gemma-3-4b-vision", "qwen2.5-vl-7b"])
def test_training_batch_lays_out_one_image_a_row(name):
    shape = IMAGE_TEXT_SHAPES[name]
    seq = shape.image_tokens() + 16
    batch = training_batch(shape, 2, seq, torch.Generator().manual_seed(0))
    ids, labels = batch["input_ids"], batch["labels"]
    start, placeholder, end = shape.image_markers()
    assert ids.shape == labels.shape == (2, seq)
    assert ((ids == placeholder).sum(dim=1) == shape.image_tokens()).all()
    assert ((ids == start).sum(dim=1) == 1).all() and ((ids == end).sum(dim=1) == 1).all()
    in_image = torch.isin(ids, torch.tensor([start, placeholder, end]))
    assert (labels[in_image] == -100).all() and (labels[~in_image] == ids[~in_image]).all()
    types = batch.get("token_type_ids", batch.get("mm_token_type_ids"))
    assert torch.equal(types, (ids == placeholder).long())
    with pytest.raises(ValueError, match="no room"):
        training_batch(shape, 1, len(image_block(shape)), torch.Generator())


@pytest.mark.parametrize("name", TINY)
def test_tiny_model_reads_the_images(name):
    """The batch's pixels reach the loss: the layout is one the model accepts, and other
    images give another loss."""
    model = build_model(name, torch.float32, "cpu", seed=0)
    shape = IMAGE_TEXT_SHAPES[name]
    batch = training_batch(shape, 2, 24, torch.Generator().manual_seed(0))
    other = {**batch, **image_pixels(shape, 2, torch.Generator().manual_seed(1))}
    with torch.no_grad():
        first, second = model(**batch).loss, model(**other).loss
    assert torch.isfinite(first) and abs(first - second) > 1e-6


@pytest.mark.parametrize("name", TINY)
def test_hf_adapts_the_layers_slothkit_adapts(name):
    from slothkit.bench.image_text_setup import adapted_layers, prepare_image_text

    layers = {
        impl: adapted_layers(
            prepare_image_text(impl, build_model(name, torch.float32, "cpu", seed=0), rank=4, seq=32)
        )
        for impl in ("slothkit", "hf")
    }
    assert layers["slothkit"] == layers["hf"]
    assert len(layers["hf"]) == 7 * IMAGE_TEXT_SHAPES[name].text.num_hidden_layers
    assert all(".language_model." in path for path in layers["hf"])


def _worker_result(capsys, worker, argv) -> dict:
    """A bench worker's result, run in this process (the CLI's subprocesses are tested by
    the text shapes' tests)."""
    from slothkit.bench.train_worker import RESULT_TAG

    capsys.readouterr()
    assert worker.main(argv) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith(RESULT_TAG)]
    return json.loads(lines[-1][len(RESULT_TAG) :])


@pytest.mark.parametrize("name", TINY)
def test_tiny_image_text_run_trains_slothkit_and_hf_alike(name, capsys):
    from slothkit.bench import train_worker

    results = {
        impl: _worker_result(
            capsys,
            train_worker,
            [
                "--impl",
                impl,
                "--model",
                name,
                "--dtype",
                "fp32",
                "--batch",
                "2",
                "--seq",
                "24",
                "--steps",
                "2",
                "--warmup",
                "1",
                "--hf-checkpointing",
                "on",
            ],
        )  # fmt: skip
        for impl in ("slothkit", "hf")
    }
    for impl, result in results.items():
        assert result["status"] == "ok", (impl, result)
    slothkit, hf = results["slothkit"]["losses"], results["hf"]["losses"]
    assert len(slothkit) == 3 and np.isfinite(slothkit + hf).all()
    # Both start from the same weights and batch with adapters that add nothing yet.
    assert slothkit[0] == pytest.approx(hf[0], rel=1e-5)
    assert slothkit[-1] < slothkit[0] and hf[-1] < hf[0]
    assert results["slothkit"]["trainable_parameters"] == results["hf"]["trainable_parameters"]


def test_image_text_record_through_the_cli(tmp_path, monkeypatch):
    """`slothkit bench train` takes an image-text shape's name and writes its record."""
    import slothkit.bench.train as train

    calls = []

    def fake_worker(impl, args, extra_env=None):  # the parent's logic only: no subprocess
        calls.append((impl, args.model, args.seq))
        return {"status": "ok", "step_s": 0.5, "losses": [2.0], "final_loss": 2.0}

    monkeypatch.setattr(train, "run_worker", fake_worker)
    output = tmp_path / "record.json"
    code = main(
        ["bench", "train", "--model", "tiny-qwen2.5-vl", "--dtype", "fp32", "--seq", "24",
         "--impl", "slothkit,hf", "--output", str(output)]
    )  # fmt: skip
    assert code == 0
    record = json.loads(output.read_text())
    assert record["model"] == "tiny-qwen2.5-vl" and [row["status"] for row in record["rows"]] == ["ok", "ok"]
    assert calls == [("slothkit", "tiny-qwen2.5-vl", 24), ("hf", "tiny-qwen2.5-vl", 24)]


def _decode(impl, name, batch, pixels_seed=1, new_tokens=6):
    """(new tokens, model) of the generate worker's model for ``impl`` on its prompts,
    slothkit's fast loop on the CPU."""
    import argparse

    from slothkit.bench import generate_worker

    args = argparse.Namespace(
        model=name,
        mode="lora",
        dtype="fp32",
        batch=batch,
        prompt_len=6,
        new_tokens=new_tokens,
        rank=4,
        seed=0,
    )
    model = generate_worker.prepare(impl, args, torch.float32, "cpu", fast_decode=True)
    inputs = generate_worker.prompts_for(args, 512, torch.Generator().manual_seed(1), "cpu")
    shape = IMAGE_TEXT_SHAPES[name]
    inputs.update(image_pixels(shape, batch, torch.Generator().manual_seed(pixels_seed)))
    ids, mask = inputs.pop("input_ids"), inputs.pop("attention_mask")
    out = generate_worker._generate(model, ids, mask, new_tokens, **inputs)
    assert out.shape == (batch, ids.shape[1] + new_tokens)
    return out[:, ids.shape[1] :], model


@pytest.mark.parametrize("name", TINY)
@pytest.mark.parametrize("batch", [1, 3])
def test_slothkit_fast_loop_decodes_image_prompts_as_hf_does(name, batch):
    from slothkit.core.inspection import causal_lm_of
    from slothkit.core.model_state import state_of

    fast, model = _decode("slothkit", name, batch)
    assert state_of(causal_lm_of(model)).fast_decoder is not None  # slothkit's loop, not HF's generate
    plain, _ = _decode("hf", name, batch)
    assert torch.equal(fast, plain)
    merged, _ = _decode("slothkit-merged", name, batch)
    assert torch.equal(merged, plain)


@pytest.mark.parametrize("name", TINY)
def test_image_prompts_decode_by_their_images(name):
    """Other pixels, other tokens: the prompts' images reach the fast loop's prefill."""
    first, _ = _decode("slothkit", name, 3, pixels_seed=1)
    second, _ = _decode("slothkit", name, 3, pixels_seed=2)
    assert not torch.equal(first, second)


@pytest.mark.parametrize("name", TINY)
def test_generation_prompts_are_left_padded_around_one_image(name):
    shape = IMAGE_TEXT_SHAPES[name]
    prompts = generation_prompts(shape, 4, 8, torch.Generator().manual_seed(0))
    ids, mask = prompts["input_ids"], prompts["attention_mask"]
    assert ids.shape == (4, 8 + len(image_block(shape)))
    assert ((ids == shape.image_markers()[1]).sum(dim=1) == shape.image_tokens()).all()
    padding = (mask == 0).sum(dim=1)
    assert padding.tolist() == [0, 1, 2, 3]  # r * 8 // (2 * 4) text tokens fewer
    for row, pad in enumerate(padding.tolist()):  # padding on the left only, id 0
        assert (mask[row, pad:] == 1).all() and (ids[row, :pad] == 0).all()


@pytest.mark.parametrize("name", TINY)
def test_saved_checkpoint_with_processor_loads_as_built(name, tmp_path):
    """What the Unsloth rows load: the built model saved with write_processor's files
    loads back (processor and all, where transformers builds it here) to the same model."""
    from transformers import AutoModelForImageTextToText, AutoProcessor, AutoTokenizer

    from slothkit.bench.image_text_setup import write_processor
    from slothkit.testing.tiny_image_text import GEMMA3_IMAGE_TOKENS, QWEN_VISION_TOKENS

    shape = IMAGE_TEXT_SHAPES[name]
    built = build_model(name, torch.float32, "cpu", seed=0)
    built.save_pretrained(tmp_path)
    write_processor(str(tmp_path), name)
    tokens = AutoTokenizer.from_pretrained(tmp_path).get_vocab()
    markers = GEMMA3_IMAGE_TOKENS.values() if shape.model_type == "gemma3" else QWEN_VISION_TOKENS
    assert all(marker in tokens for marker in markers)
    try:
        processor = AutoProcessor.from_pretrained(tmp_path)
    except ImportError:  # Qwen-VL's processor needs torchvision to be built
        assert shape.model_type == "qwen2_5_vl"
    else:
        assert hasattr(processor, "image_processor")
    loaded = AutoModelForImageTextToText.from_pretrained(tmp_path, dtype=torch.float32)
    batch = training_batch(shape, 2, 24, torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded(**batch).logits, built(**batch).logits)
