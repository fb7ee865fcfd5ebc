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
    gguf_refusal("qwen2_5_vl")  # why a family's two files are not written; None: they are
"""

from __future__ import annotations

import types

import torch

from slothkit.core.inspection import text_tokenizer
from slothkit.export.gguf import mmproj
from slothkit.models.image_text import is_image_text_config

__all__ = ["gguf_refusal", "is_image_text_model", "language_model_of", "text_tokenizer", "writes_gguf"]

# The text model class of each written family's language model.
LANGUAGE_MODELS = {"gemma3": "Gemma3ForCausalLM", "qwen2_5_vl": "Qwen2ForCausalLM"}


def is_image_text_model(model) -> bool:
    return is_image_text_config(getattr(model, "config", None))


def gguf_refusal(family: str) -> str | None:
    """Why slothkit writes no GGUF for the image-text family `family` (the image-text config's
    model_type: "qwen2_5_vl"), in save_pretrained_gguf's words; None where it writes both
    files: the language model's GGUF (a text model class in LANGUAGE_MODELS) and the projector
    file (a projector type in mmproj.PROJECTOR_TYPES).  The vision notebooks read it
    (slothkit.notebook): SAVE_GGUF is on by default, and the save cell writes GGUF, only
    where this is None; elsewhere the save cell prints it."""
    try:
        mmproj.check_projector_family(types.SimpleNamespace(model_type=family))
    except mmproj.UnsupportedImageTextModel as refused:
        return str(refused)
    if family not in LANGUAGE_MODELS:
        return (
            f"GGUF export of the image-text model {family!r} is refused: slothkit knows no text model "
            f"class for its language model (written: {', '.join(LANGUAGE_MODELS)})"
        )
    return None


def writes_gguf(family: str) -> bool:
    """Whether save_pretrained_gguf writes the image-text family `family` (gguf_refusal)."""
    return gguf_refusal(family) is None


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
