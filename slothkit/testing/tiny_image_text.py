"""Tiny image-text Gemma 3 and Gemma 4 checkpoints (Gemma3ForConditionalGeneration,
Gemma4ForConditionalGeneration), offline: a tiny text checkpoint of the family as the
language model, under a one-layer vision tower, saved as transformers saves such models
(the published layouts), with the text checkpoint's tokenizer. They stand in for Gemma 3
4B-27B and Gemma 4 E2B-31B, which FastModel loads as their text model alone
(slothkit.loading.text_tower)."""

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
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text_path = pathlib.Path(text_path) if text_path is not None else tiny_model_path("gemma3")
    text_model = _text_model(text_path)
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
    return _with_tokenizer(pathlib.Path(path), text_path)


def build_tiny_image_text_gemma4(
    path: str | pathlib.Path, text_path: str | pathlib.Path | None = None
) -> pathlib.Path:
    """Write the checkpoint to `path` and return it; its language model's weights and its
    tokenizer are those of the Gemma 4 text checkpoint at `text_path` (default the tiny
    gemma4_text checkpoint of slothkit.testing.tiny_generic_models: per-layer embeddings,
    shared keys and values). No audio tower: the E2B and E4B checkpoints have one, which
    FastModel leaves on disk as it does the vision tower."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    from slothkit.testing.tiny_generic_models import tiny_generic_model_path

    text_path = pathlib.Path(text_path) if text_path is not None else tiny_generic_model_path("gemma4_text")
    text_model = _text_model(text_path)
    vocab = text_model.config.vocab_size
    config = Gemma4Config(
        text_config=text_model.config.to_dict(),
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                       "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16,
                       "patch_size": 14, "position_embedding_size": 64},
        audio_config=None,
        # The last ids of the tiny vocabulary, which its tokenizer never produces.
        image_token_id=vocab - 1, boi_token_id=vocab - 2, eoi_token_id=vocab - 3, video_token_id=vocab - 4,
        audio_token_id=vocab - 5, boa_token_id=vocab - 6, eoa_token_index=vocab - 7,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Gemma4ForConditionalGeneration(config)
    loaded = model.model.language_model.load_state_dict(text_model.model.state_dict())
    assert not loaded.missing_keys and not loaded.unexpected_keys, loaded
    model.lm_head.weight = model.model.language_model.embed_tokens.weight  # tied, as Gemma 4's
    model.save_pretrained(path)
    return _with_tokenizer(pathlib.Path(path), text_path)


def _text_model(text_path: pathlib.Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(text_path, dtype=torch.float32)


def _with_tokenizer(path: pathlib.Path, text_path: pathlib.Path) -> pathlib.Path:
    """`path` with the text checkpoint's tokenizer files copied in."""
    for name in (p.name for p in text_path.iterdir()):
        if name not in ("config.json", "generation_config.json") and not name.endswith(".safetensors"):
            shutil.copy(text_path / name, path / name)
    return path


@functools.cache
def tiny_image_text_gemma3_path() -> pathlib.Path:
    """build_tiny_image_text_gemma3 once per process, into a temporary folder removed at
    exit. Treat it as read-only."""
    return build_tiny_image_text_gemma3(pathlib.Path(_folder().name) / "gemma3-image-text")


@functools.cache
def tiny_image_text_gemma4_path() -> pathlib.Path:
    """build_tiny_image_text_gemma4 once per process, into a temporary folder removed at
    exit. Treat it as read-only."""
    return build_tiny_image_text_gemma4(pathlib.Path(_folder().name) / "gemma4-image-text")


@functools.cache
def _folder() -> tempfile.TemporaryDirectory:
    return tempfile.TemporaryDirectory(prefix="slothkit-tiny-image-text-")
