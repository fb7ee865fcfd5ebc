"""A multimodal Gemma 3 checkpoint (Gemma 3 4B/12B/27B: vision tower + Gemma 3 text model)
loads as its text model alone, which the fused path patches, and saves as that; a Gemma 4
one (E2B/E4B/31B: vision and audio towers + Gemma 4 text model) likewise, on the generic
path."""

import logging
import os
import shutil
import warnings

import pytest
import torch

from slothkit import FastModel
from slothkit.testing import tiny_image_text_gemma3_path, tiny_image_text_gemma4_path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def multimodal_gemma3():
    """The tiny image-text Gemma 3 checkpoint and the model transformers loads from it."""
    from transformers import Gemma3ForConditionalGeneration

    path = tiny_image_text_gemma3_path()
    return path, Gemma3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()


def _load(path, **kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, tokenizer = FastModel.from_pretrained(
            str(path), load_in_4bit=False, dtype=torch.float32, max_seq_length=64, **kwargs
        )
    return model, tokenizer, [str(w.message) for w in caught]


@pytest.mark.parametrize("fused", [None, True])
def test_loads_the_text_model_with_the_multimodal_models_numbers(multimodal_gemma3, fused):
    from slothkit.core.model_state import state_of

    path, reference = multimodal_gemma3
    model, tokenizer, said = _load(path, fused=fused)
    assert type(model).__name__ == "Gemma3ForCausalLM"
    assert model.config.model_type == "gemma3_text"
    assert not any("vision" in name for name, _ in model.named_parameters())
    assert sum("multimodal gemma3 checkpoint" in message for message in said) <= 1
    if fused:
        assert state_of(model).architecture == "gemma3"

    ids = torch.randint(3, 400, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(input_ids=ids).logits
        got = model(input_ids=ids).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    with torch.no_grad():  # the training loss: the fused linear cross-entropy when fused
        model.train()
        loss = model(input_ids=ids, labels=ids).loss
        expected_loss = reference(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-5)


def test_one_notice_names_what_is_not_loaded_and_no_report_lists_it(multimodal_gemma3):
    """transformers' load report would list every vision weight as unexpected."""
    from slothkit.core.notices import say_once

    reported = []
    handler = logging.Handler()
    handler.emit = lambda record: reported.append(record.getMessage())
    report_logger = logging.getLogger("transformers.modeling_utils")
    report_logger.addHandler(handler)
    say_once.cache_clear()
    try:
        _, _, said = _load(multimodal_gemma3[0])
    finally:
        report_logger.removeHandler(handler)
    (notice,) = [message for message in said if "multimodal" in message]
    assert "vision tower is not loaded" in notice and "gemma3_text" in notice
    assert not any("vision_tower" in message for message in reported), reported


def test_transformers_newer_layout_loads_too(multimodal_gemma3, tmp_path):
    """Checkpoints re-saved by transformers 4.52-4.57 name the language model
    model.language_model.* and the head lm_head.*."""
    from safetensors.torch import load_file, save_file

    path, reference = multimodal_gemma3
    shutil.copytree(path, tmp_path / "newer")
    weights = load_file(path / "model.safetensors")
    renamed = {
        name.replace("language_model.model.", "model.language_model.").replace("language_model.lm_head.", "lm_head."): t
        for name, t in weights.items()
    }  # fmt: skip
    assert renamed.keys() != weights.keys()
    save_file(renamed, tmp_path / "newer" / "model.safetensors", metadata={"format": "pt"})
    model, _, _ = _load(tmp_path / "newer")
    ids = torch.randint(3, 400, (1, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(
            model(input_ids=ids).logits, reference(input_ids=ids).logits, rtol=0, atol=1e-5
        )


def test_adapter_and_merged_saves_are_of_the_text_model(multimodal_gemma3, tmp_path):
    from transformers import AutoModelForCausalLM

    path, _ = multimodal_gemma3
    model, tokenizer, _ = _load(path)
    model = FastModel.get_peft_model(model, r=8, lora_alpha=16, init_lora_weights=False, random_state=5)
    model.eval()
    ids = torch.randint(3, 400, (1, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        trained = model(input_ids=ids).logits

    model.save_pretrained(tmp_path / "adapter")
    reloaded, _, _ = _load(tmp_path / "adapter")
    reloaded.eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, trained, rtol=0, atol=1e-5)

    model.save_pretrained_merged(tmp_path / "merged", tokenizer, save_method="merged_16bit")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    assert type(merged).__name__ == "Gemma3ForCausalLM"
    with torch.no_grad():  # the merged save is bf16: within bf16's rounding of the weights
        torch.testing.assert_close(merged(input_ids=ids).logits, trained, rtol=0, atol=0.05)


@pytest.fixture(scope="module")
def multimodal_gemma4():
    """The tiny image-text Gemma 4 checkpoint and the model transformers loads from it."""
    from transformers import Gemma4ForConditionalGeneration

    path = tiny_image_text_gemma4_path()
    return path, Gemma4ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()


def test_gemma_4_loads_its_text_model_with_the_multimodal_models_numbers(multimodal_gemma4):
    """Per-layer embeddings and shared keys and values included; the notice is said once."""
    from slothkit.core.notices import say_once

    path, reference = multimodal_gemma4
    say_once.cache_clear()
    model, tokenizer, said = _load(path)
    assert type(model).__name__ == "Gemma4ForCausalLM"
    assert model.config.model_type == "gemma4_text"
    assert not any("vision" in name or "audio" in name for name, _ in model.named_parameters())
    (notice,) = [message for message in said if "multimodal gemma4 checkpoint" in message]
    assert "vision tower is not loaded" in notice and "gemma4_text" in notice
    assert isinstance(tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}]), str)

    ids = torch.randint(3, len(tokenizer), (2, 24), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(
            model(input_ids=ids).logits, reference(input_ids=ids).logits, rtol=0, atol=1e-5
        )
        model.train()
        loss = model(input_ids=ids, labels=ids).loss
        expected_loss = reference(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-5)


def test_gemma_4_adapter_and_merged_saves_are_of_the_text_model(multimodal_gemma4, tmp_path):
    from transformers import AutoModelForCausalLM

    path, _ = multimodal_gemma4
    model, tokenizer, _ = _load(path)
    model = FastModel.get_peft_model(model, r=8, lora_alpha=16, init_lora_weights=False, random_state=5)
    model.eval()
    ids = torch.randint(3, len(tokenizer), (1, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        trained = model(input_ids=ids).logits

    model.save_pretrained(tmp_path / "adapter")
    reloaded, _, _ = _load(tmp_path / "adapter")
    reloaded.eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, trained, rtol=0, atol=1e-5)

    model.save_pretrained_merged(tmp_path / "merged", tokenizer, save_method="merged_16bit")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    assert type(merged).__name__ == "Gemma4ForCausalLM"
    with torch.no_grad():  # the merged save is bf16: within bf16's rounding of the weights
        torch.testing.assert_close(merged(input_ids=ids).logits, trained, rtol=0, atol=0.05)
