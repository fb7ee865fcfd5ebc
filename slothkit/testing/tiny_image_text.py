"""A tiny image-text Gemma 3 checkpoint (Gemma3ForConditionalGeneration), offline: the tiny
Gemma 3 text checkpoint as its language model, under a one-layer vision tower, saved as
transformers saves such models (the published layout, language_model.model.*), with the
text checkpoint's tokenizer. It stands in for Gemma 3 4B-27B, which FastModel loads as
their text model alone (slothkit.loading.text_tower)."""

from __future__ import annotations

import functools
import pathlib
import shutil
import tempfile

import torch

from slothkit.testing.tiny_models import tiny_model_path


def build_tiny_image_text_gemma3(
    path: str | pathlib.Path, text_path: str | pathlib.Path | None = None
) -> pathlib.Path:
    """Write the checkpoint to `path` and return it; its language model's weights and its
    tokenizer are those of the Gemma 3 text checkpoint at `text_path` (default
    tiny_model_path("gemma3"); the real Gemma 3 270M makes a real-weights stand-in)."""
    from transformers import AutoModelForCausalLM, Gemma3Config, Gemma3ForConditionalGeneration

    path = pathlib.Path(path)
    text_path = pathlib.Path(text_path) if text_path is not None else tiny_model_path("gemma3")
    text_model = AutoModelForCausalLM.from_pretrained(text_path, dtype=torch.float32)
    vocab = text_model.config.vocab_size
    config = Gemma3Config(
        text_config=text_model.config.to_dict(),
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                       "num_attention_heads": 2, "image_size": 28, "patch_size": 14},
        mm_tokens_per_image=4,
        # The last ids of the tiny vocabulary, which its tokenizer never produces.
        image_token_index=vocab - 1, boi_token_index=vocab - 2, eoi_token_index=vocab - 3,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config)
    loaded = model.model.language_model.load_state_dict(text_model.model.state_dict())
    assert not loaded.missing_keys and not loaded.unexpected_keys, loaded
    model.lm_head.weight = model.model.language_model.embed_tokens.weight  # tied, as Gemma 3's
    model.save_pretrained(path)
    for name in (p.name for p in text_path.iterdir()):
        if name not in ("config.json", "generation_config.json") and not name.endswith(".safetensors"):
            shutil.copy(text_path / name, path / name)  # the tokenizer's files
    return path


@functools.cache
def tiny_image_text_gemma3_path() -> pathlib.Path:
    """build_tiny_image_text_gemma3 once per process, into a temporary folder removed at
    exit. Treat it as read-only."""
    return build_tiny_image_text_gemma3(pathlib.Path(_folder().name) / "gemma3-image-text")


@functools.cache
def _folder() -> tempfile.TemporaryDirectory:
    return tempfile.TemporaryDirectory(prefix="slothkit-tiny-image-text-")
