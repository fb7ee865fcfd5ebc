"""Image-text models through FastVisionModel against Hugging Face + PEFT, on the tiny Gemma 3
and Qwen2.5-VL checkpoints in float32, with the language model on Hugging Face's layers
(fused=False) and on slothkit's fused layers and loss (fused=True, the kernels' torch
references): the same losses and adapters over 8 steps (with and without vision LoRA,
16-bit and 4-bit), the same greedy generation with an image, and a merged 16-bit save that
keeps the vision tower and the processor and reloads in plain transformers with the
adapter model's logits."""

import copy
import os
import warnings

import pytest
import torch

from slothkit import FastVisionModel
from slothkit.core.inspection import causal_lm_of
from slothkit.core.model_state import patched_module, state_of
from slothkit.testing import IMAGE_TEXT_FAMILIES
from slothkit.testing.image_text_parity import (
    adapted_layers,
    load_for_training,
    lora_weights,
    on_device,
    random_batch,
    train,
)
from slothkit.testing.tiny_image_text import image_text_processor_loads, tiny_image_text_path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
STEPS = 8
VISION_PARTS = ("vision_tower", "visual", "vision_model")
# The record whose fused layers run each family's language model (Mllama's, with its
# cross-attention layers, has none: it keeps HF's layers and fused=True is refused).
LANGUAGE_RECORDS = {"gemma3": "gemma3", "qwen2_5_vl": "qwen2"}
# The fused runs' adapters, norm-wise, as a fraction of the distance they moved: their
# gradients agree with HF's to float32 rounding (about 1e-6 relative), which Adam turns
# into a fraction of the learning rate in an element whose gradient is near zero
# (measured: at most 8e-5 over these runs, 2.4e-4 in the worst element).
# On a GPU the Triton kernels' float32 sums round differently again (measured on an H100:
# 1.8e-4, Qwen2.5-VL in 4 bits with vision LoRA).
FUSED_ADAPTER_TOLERANCE = 4e-4 if torch.cuda.is_available() else 2e-4


@pytest.fixture(params=[False, True], ids=["hf-layers", "fused-language"])
def fused(request):
    """from_pretrained's fused: False, or True with the kernels' torch references (the
    Triton interpreter takes minutes here; tests/slothkit/loading/test_vision_fused.py
    runs the Triton kernels on an image batch)."""
    if request.param:
        request.getfixturevalue("reference_kernels")
    return request.param


def _pair(family, vision, load_in_4bit=False, fused=False):
    if fused and family not in LANGUAGE_RECORDS:
        pytest.skip(
            f"{family}'s language model has no fused record (tests/slothkit/loading/test_vision_fused.py)"
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fast = load_for_training("slothkit", family, vision, load_in_4bit, fused=fused)
        plain = load_for_training("hf", family, vision, load_in_4bit, targets=adapted_layers(fast))
    return fast, plain


def _language_path(model) -> tuple[str | None, bool]:
    """(the record whose fused layers the language model runs, or None; whether the loss
    is the fused linear cross-entropy's)."""
    causal_lm = causal_lm_of(model)
    state = state_of(causal_lm)
    return (state.architecture if state is not None else None), patched_module(causal_lm) is not None


@pytest.mark.parametrize("family", IMAGE_TEXT_FAMILIES)
@pytest.mark.parametrize("vision", [True, False], ids=["vision-lora", "language-lora"])
@pytest.mark.parametrize("load_in_4bit", [False, True], ids=["16bit", "4bit"])
def test_training_matches_hf_and_peft(family, vision, load_in_4bit, fused):
    if load_in_4bit:
        pytest.importorskip("bitsandbytes")
    fast, plain = _pair(family, vision, load_in_4bit, fused)
    assert _language_path(fast) == ((LANGUAGE_RECORDS[family], True) if fused else (None, False))
    initial = lora_weights(plain)
    assert lora_weights(fast).keys() == initial.keys()
    assert any(part in name for name in initial for part in VISION_PARTS) == vision
    batches = [random_batch(family, seed) for seed in range(STEPS)]
    fast_losses, plain_losses = train(fast, batches), train(plain, batches)
    assert fast_losses == pytest.approx(plain_losses, abs=1e-5, rel=0)
    fast_weights, plain_weights = lora_weights(fast), lora_weights(plain)
    for name, weight in plain_weights.items():
        assert not torch.equal(weight, initial[name]), f"{name} did not train"
        if fused:
            moved = (weight - initial[name]).norm()
            assert (fast_weights[name] - weight).norm() <= FUSED_ADAPTER_TOLERANCE * moved, name
        else:
            torch.testing.assert_close(fast_weights[name], weight, rtol=0, atol=1e-5, msg=name)


@pytest.mark.parametrize("family", IMAGE_TEXT_FAMILIES)
def test_greedy_generation_with_an_image_matches_hf(family, fused):
    fast, plain = _pair(family, vision=True, fused=fused)
    batches = [random_batch(family, seed) for seed in range(2)]
    train(fast, batches), train(plain, batches)  # adapters away from B = 0
    prompt = random_batch(family, seed=100, rows=1, text_tokens=8)
    prompt.pop("labels")
    prompt.pop("token_type_ids", None)  # generation reads the image tokens from the ids
    prompt = on_device(prompt, next(fast.parameters()).device)
    FastVisionModel.for_inference(fast)
    plain.eval()
    with torch.no_grad():
        expected = plain.generate(**prompt, max_new_tokens=8, do_sample=False)
        got = fast.generate(**prompt, max_new_tokens=8, do_sample=False)
    assert got.shape[1] == prompt["input_ids"].shape[1] + 8
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("family", IMAGE_TEXT_FAMILIES)
def test_merged_16bit_keeps_the_vision_tower_and_the_processor(family, fused, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    fast, _ = _pair(family, vision=True, fused=fused)
    train(fast, [random_batch(family, seed) for seed in range(2)])
    fast.eval()
    processor_loads = image_text_processor_loads(family) is None
    # Without its processor (Qwen-VL's needs torchvision) the model was loaded alone: the
    # tokenizer is passed as a text model's would be.
    tokenizer = None if processor_loads else AutoTokenizer.from_pretrained(tiny_image_text_path(family))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = fast.save_pretrained_merged(str(tmp_path / "merged"), tokenizer)
    folder = tmp_path / "merged"
    if processor_loads:
        assert {"processor_config.json", "chat_template.jinja"} <= set(result.files)

    # Every tensor is the adapters folded into the base in float32, rounded once to 16 bits.
    reference = copy.deepcopy(fast).merge_and_unload().state_dict()
    saved = load_file(str(folder / "model.safetensors"))
    assert any(part in name for name in saved for part in VISION_PARTS)
    for name, tensor in saved.items():
        assert tensor.dtype == torch.bfloat16, name
        expected = reference[name].to("cpu", torch.bfloat16)  # the reference lives on the model's device
        torch.testing.assert_close(tensor, expected, rtol=0, atol=0, msg=name)

    merged, info = AutoModelForImageTextToText.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    if processor_loads:
        from transformers import AutoProcessor

        assert type(AutoProcessor.from_pretrained(folder)).__name__.endswith("Processor")
    # Its logits are the adapter model's with the weights rounded to 16 bits.
    rounded = copy.deepcopy(fast).merge_and_unload()
    with torch.no_grad():
        for parameter in rounded.parameters():
            parameter.copy_(parameter.to(torch.bfloat16).float())
    batch = random_batch(family, seed=77)
    batch.pop("labels")
    device = next(fast.parameters()).device
    batch = on_device(batch, device)
    with torch.no_grad():
        got = merged.float().to(device).eval()(**batch).logits
        expected = rounded.eval()(**batch).logits
        adapter = fast(**batch).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    assert (adapter - got).abs().max() < 0.05 * adapter.abs().max()  # what 16-bit rounding moves


@pytest.mark.cuda
@pytest.mark.parametrize("family", IMAGE_TEXT_FAMILIES)
@pytest.mark.parametrize("load_in_4bit", [False, True], ids=["16bit", "4bit"])
def test_bf16_training_on_the_gpu_follows_hf_and_peft(family, load_in_4bit):
    """On a GPU in bfloat16 (QLoRA: NF4 language layers), with the language model on the
    fused path (from_pretrained's default there) and its layers' inputs offloaded: the
    losses follow HF + PEFT's to bfloat16's rounding, and every adapter trains to finite
    values."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fast = load_for_training("slothkit", family, True, load_in_4bit, dtype=torch.bfloat16)
        plain = load_for_training(
            "hf", family, True, load_in_4bit, targets=adapted_layers(fast), dtype=torch.bfloat16
        )
    assert next(fast.parameters()).is_cuda
    record = LANGUAGE_RECORDS.get(family)
    assert _language_path(fast) == (record, record is not None)
    batches = [random_batch(family, seed) for seed in range(STEPS)]
    fast_losses, plain_losses = train(fast, batches), train(plain, batches)
    assert fast_losses == pytest.approx(plain_losses, rel=2e-2)
    for name, weight in lora_weights(fast).items():
        assert torch.isfinite(weight).all(), name


@pytest.mark.parametrize("family", IMAGE_TEXT_FAMILIES)
def test_merged_16bit_of_a_4bit_model_folds_the_adapters_into_the_original_weights(
    family, tmp_path, reference_kernels
):
    """A model trained on NF4 language layers (on the fused path) merges into the checkpoint's own 16-bit
    weights, whose names transformers renamed as it loaded them (an image-text checkpoint's
    language_model.* and vision_tower.* are model.language_model.* and model.vision_tower.*
    in the model): every saved tensor is the 16-bit model with the same adapters, merged."""
    pytest.importorskip("bitsandbytes")
    from peft import get_peft_model_state_dict, set_peft_model_state_dict
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    fast, _ = _pair(family, vision=True, load_in_4bit=True, fused=family in LANGUAGE_RECORDS)
    train(fast, [random_batch(family, seed) for seed in range(2)])
    fast.eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_image_text_path(family))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fast.save_pretrained_merged(str(tmp_path / "merged"), tokenizer)
        plain = load_for_training("hf", family, True, False, targets=adapted_layers(fast))
    set_peft_model_state_dict(plain, get_peft_model_state_dict(fast))
    reference = plain.merge_and_unload().state_dict()
    saved = load_file(str(tmp_path / "merged" / "model.safetensors"))
    assert any(part in name for name in saved for part in VISION_PARTS)
    assert set(saved) <= set(reference)
    for name, tensor in saved.items():
        torch.testing.assert_close(
            tensor,
            reference[name].to("cpu", tensor.dtype),
            rtol=0,
            atol=0,
            msg=lambda text, name=name: f"{name}: {text}",
        )
