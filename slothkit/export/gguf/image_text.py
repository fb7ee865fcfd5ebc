"""An image-text model as two GGUF files: its language model, written as the text family's
GGUF, and llama.cpp's projector file (slothkit.export.gguf.mmproj) for its vision tower and
projector.

    gemma3       Gemma3ForCausalLM on the gemma3_text config: llama.cpp's gemma3 graph
    qwen2_5_vl   Qwen2ForCausalLM on the qwen2_5_vl_text config: the same layers, whose
                 plain RoPE is M-RoPE with every axis at the token's position, as in a text
                 prompt; written by the qwen2_5_vl_text record as llama.cpp's qwen2vl graph
                 (M-RoPE, rope.dimension_sections), which libmtmd gives the image tokens'
                 (time, height, width) positions

    text, tokenizer = language_model_of(merged), text_tokenizer(processor)
"""

from __future__ import annotations

import torch

from slothkit.core.inspection import text_tokenizer
from slothkit.models.image_text import is_image_text_config

__all__ = ["is_image_text_model", "language_model_of", "text_tokenizer"]

# The text model class of each written family's language model.
LANGUAGE_MODELS = {"gemma3": "Gemma3ForCausalLM", "qwen2_5_vl": "Qwen2ForCausalLM"}


def is_image_text_model(model) -> bool:
    return is_image_text_config(getattr(model, "config", None))


def language_model_of(model):
    """The language model of a merged image-text model as a text model of its own
    (LANGUAGE_MODELS, built from text_config), sharing the merged weights (no copy)."""
    import transformers

    family = model.config.model_type
    if family not in LANGUAGE_MODELS:
        raise NotImplementedError(f"no text model class known for the language model of {family!r}")
    text_config = model.config.text_config
    with torch.device("meta"):
        text = getattr(transformers, LANGUAGE_MODELS[family])(text_config)
    state = {f"model.{name}": tensor for name, tensor in model.model.language_model.state_dict().items()}
    state["lm_head.weight"] = model.lm_head.weight
    text.load_state_dict(state, assign=True, strict=True)
    embed = model.model.language_model.embed_tokens.weight
    tied = getattr(text_config, "tie_word_embeddings", False)
    if tied or model.lm_head.weight.data_ptr() == embed.data_ptr():
        text.lm_head.weight = text.model.embed_tokens.weight  # Gemma 3's head is its embeddings
    # The rotary frequencies are buffers outside the state dict: the language model's own.
    source = model.model.language_model
    for name, _ in list(text.model.named_buffers()):
        owner, _, leaf = name.rpartition(".")
        text.model.get_submodule(owner)._buffers[leaf] = source.get_buffer(name)
    text.generation_config = model.generation_config
    text.config._name_or_path = model.config._name_or_path
    return text.eval()
