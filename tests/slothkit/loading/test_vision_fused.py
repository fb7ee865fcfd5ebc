"""The language model of an image-text model on the fused path (slothkit.loading.vision_fused):
which record runs it, the Triton kernels (under the interpreter here) on a batch with an
image against Hugging Face's modules, Qwen2.5-VL's M-RoPE positions included, and what
the load notice says. Training parity with HF + PEFT is tests/slothkit/test_vision_training.py."""

import os
import warnings

import pytest
import torch

from slothkit.core.inspection import causal_lm_of
from slothkit.core.model_state import patched_module, state_of
from slothkit.core.notices import say_once
from slothkit.loading.load_model import LoadOptions
from slothkit.loading.vision_model import load_vision_model
from slothkit.models import language_model_architecture
from slothkit.testing import IMAGE_TEXT_FAMILIES
from slothkit.testing.image_text_parity import on_device, random_batch
from slothkit.testing.tiny_image_text import tiny_image_text_path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
LANGUAGE_RECORDS = {"gemma3": "gemma3", "qwen2_5_vl": "qwen2"}


@pytest.mark.parametrize(
    "config_class, record",
    [("Gemma3Config", "gemma3"), ("Qwen2_5_VLConfig", "qwen2"), ("Gemma4Config", None)],
)
def test_the_language_model_runs_its_family_record(config_class, record):
    import transformers

    arch = language_model_architecture(getattr(transformers, config_class)())
    assert (arch.name if arch is not None else None) == record


def _load(family, fused):
    """The model and the load notice (shown again: another test may have shown it)."""
    say_once.cache_clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = load_vision_model(
            str(tiny_image_text_path(family)),
            LoadOptions(load_in_4bit=False, dtype=torch.float32, max_seq_length=128, fused=fused),
        )
    notices = [str(w.message) for w in caught if "is an image-text" in str(w.message)]
    return model, notices


@pytest.mark.parametrize("family", sorted(LANGUAGE_RECORDS))
def test_fused_layers_compute_hf_logits_and_loss_on_a_batch_with_an_image(family):
    """Under the Triton interpreter: the fused layers' logits (eval) and the fused linear
    cross-entropy's loss (training, with labels) against the model's own modules. Qwen2.5-VL's
    image tokens take M-RoPE positions whose height and width sections differ from the
    temporal one, so its tables are not those of plain RoPE."""
    from transformers import AutoModelForImageTextToText

    fused, notices = _load(family, fused=True)
    causal_lm = causal_lm_of(fused)
    assert state_of(causal_lm).architecture == LANGUAGE_RECORDS[family]
    assert patched_module(causal_lm) is not None  # the head's fused linear cross-entropy
    assert any(f"fused {LANGUAGE_RECORDS[family]} layers" in notice for notice in notices), notices
    device = next(fused.parameters()).device
    plain = AutoModelForImageTextToText.from_pretrained(
        tiny_image_text_path(family), dtype=torch.float32, attn_implementation="sdpa", device_map=device
    )
    batch = on_device(random_batch(family, seed=5, rows=1, text_tokens=8), device)
    labels = batch.pop("labels")
    with torch.no_grad():
        got = fused.eval()(**batch).logits
        expected = plain.eval()(**batch).logits
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
        fused_loss = fused.train()(**batch, labels=labels)
        plain_loss = plain.train()(**batch, labels=labels).loss
    assert fused_loss.logits is None  # the fused loss ran: no logits were built
    torch.testing.assert_close(fused_loss.loss, plain_loss, rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", sorted(set(IMAGE_TEXT_FAMILIES) - set(LANGUAGE_RECORDS)))
def test_fused_true_is_refused_for_a_language_model_without_a_record(family):
    """Mllama's language model (self- and cross-attention layers) has no record: fused=True
    is refused with the reason, and the default keeps Hugging Face's layers."""
    with pytest.raises(ValueError, match="fused=True"):
        _load(family, fused=True)
    model, notices = _load(family, fused=None)
    assert state_of(causal_lm_of(model)).architecture is None
    assert any("language model on Hugging Face's modules" in notice for notice in notices), notices


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="FastVisionModel places the model on the GPU, where Triton runs"
)
def test_on_a_cpu_without_triton_the_language_model_keeps_hf_modules(reference_kernels):
    model, notices = _load("gemma3", fused=None)
    state = state_of(causal_lm_of(model))
    assert state.architecture is None and patched_module(causal_lm_of(model)) is None
    assert any("language model on Hugging Face's modules" in notice for notice in notices), notices


def test_fused_false_keeps_hf_modules_where_triton_runs():
    model, notices = _load("qwen2_5_vl", fused=False)
    assert state_of(causal_lm_of(model)).architecture is None
    assert any("language model on Hugging Face's modules" in notice for notice in notices), notices


def test_per_section_m_rope_tables_keep_hf_layers_and_refuse_fused_true():
    """A rotary module that returns one table per M-RoPE section, (3, B, T, D), as older
    transformers' Qwen2-VL did, is one the fused RoPE cannot read: HF's layers stay (the
    reason given), and fused=True is refused naming it."""
    import types

    from transformers import AutoModelForImageTextToText

    from slothkit.core.inspection import language_model_of
    from slothkit.loading.vision_fused import fuse_language_model

    model = AutoModelForImageTextToText.from_pretrained(
        tiny_image_text_path("qwen2_5_vl"), dtype=torch.float32
    ).to("cuda" if torch.cuda.is_available() else "cpu")  # where Triton runs (the interpreter on a CPU)
    rotary = language_model_of(model).rotary_emb

    def per_section_tables(self, x, position_ids):
        freqs = position_ids[..., None].float() * self.inv_freq  # (3, B, T, D / 2)
        angles = torch.cat((freqs, freqs), dim=-1)  # (3, B, T, D)
        return angles.cos().to(x.dtype), angles.sin().to(x.dtype)

    rotary.forward = types.MethodType(per_section_tables, rotary)
    what_runs = fuse_language_model(model, fused=None)
    assert what_runs.startswith("Hugging Face's modules") and "(3, 1, 4, " in what_runs, what_runs
    assert state_of(model) is None or state_of(model).architecture is None
    with pytest.raises(ValueError, match="one per section"):
        fuse_language_model(model, fused=True)
