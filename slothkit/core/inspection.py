"""What slothkit asks of a loaded model: the transformers model inside a PeftModel,
whether its weights are 4-bit, and which dtypes it stores and computes in.

Light on imports (torch only), so that the data, export and trainer modules can use
it without loading the kernels.
"""

from __future__ import annotations

import torch
from torch import nn


def causal_lm_of(model: nn.Module) -> nn.Module:
    """The transformers *ForCausalLM (or *ForSequenceClassification) inside a PeftModel,
    or ``model`` itself."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def language_model_of(causal_lm: nn.Module) -> nn.Module | None:
    """The module that runs the decoder layers: the causal LM's base model, or, in an
    image-text model (Gemma 3's, Qwen2.5-VL's *ForConditionalGeneration), its base model's
    `language_model`, which receives the image features as input embeddings."""
    decoder = getattr(causal_lm, "base_model", None) or getattr(causal_lm, "model", None)
    language_model = getattr(decoder, "language_model", None)
    return language_model if isinstance(language_model, nn.Module) else decoder


def text_tokenizer(tokenizer):
    """The tokenizer itself, or the one inside a processor (an image-text model's: its
    image processor beside a tokenizer).  Judged by the image processor, since some
    tokenizers (mistral-common's) keep another object under ``.tokenizer``."""
    if hasattr(tokenizer, "image_processor") and getattr(tokenizer, "tokenizer", None) is not None:
        return tokenizer.tokenizer
    return tokenizer


def is_sequence_classifier(model: nn.Module) -> bool:
    """Whether ``model`` (or the model inside a PeftModel) is a transformers
    *ForSequenceClassification: a decoder with a score head in place of the LM head."""
    return type(causal_lm_of(model)).__name__.endswith("ForSequenceClassification")


def is_4bit_parameter(param) -> bool:
    """Whether ``param`` is a quantised bitsandbytes 4-bit weight (a ``Params4bit`` with
    its ``quant_state``; one not yet quantised still holds its 16-bit values)."""
    return getattr(param, "quant_state", None) is not None


def nf4_experts_of(param):
    """The NF4 record (slothkit_kernels.moe.NF4Experts) that a mixture-of-experts parameter
    quantised by slothkit stands for (slothkit.engine.experts_nf4), or None."""
    return getattr(param, "nf4_experts", None)


def is_4bit_model(model: nn.Module) -> bool:
    """Whether any weight of ``model`` (or of the model inside a PeftModel) is 4-bit.
    Judged by the weights, not by transformers' ``is_loaded_in_4bit`` flag: a model
    quantised after loading (bitsandbytes layers swapped in) has no flag."""
    return any(is_4bit_parameter(param) for param in causal_lm_of(model).parameters())


def weights_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of the model's unquantised floating-point weights (its input
    embeddings; a 4-bit model keeps them in 16 bits)."""
    embeddings = causal_lm_of(model).get_input_embeddings()
    weight = getattr(embeddings, "weight", None)
    if weight is None and hasattr(embeddings, "get_base_layer"):  # modules_to_save wrapper
        weight = embeddings.get_base_layer().weight
    return weight.dtype


def compute_dtype(model: nn.Module) -> torch.dtype:
    """The dtype the model computes in: a 4-bit model's ``bnb_4bit_compute_dtype``,
    else the dtype of its weights."""
    quantization = getattr(causal_lm_of(model).config, "quantization_config", None)
    if quantization is not None:
        dtype = getattr(quantization, "bnb_4bit_compute_dtype", None)
        if dtype is None and isinstance(quantization, dict):
            dtype = quantization.get("bnb_4bit_compute_dtype")
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype.removeprefix("torch."))
        if isinstance(dtype, torch.dtype):
            return dtype
    return weights_dtype(model)


def attention_window(attention: nn.Module) -> int | None:
    """The sliding window of one attention module (None: full attention). Qwen2/Qwen3 give
    each module its own (None on full-attention layers); Mistral's comes from the config."""
    if hasattr(attention, "sliding_window"):
        return attention.sliding_window
    return getattr(attention.config, "sliding_window", None)
