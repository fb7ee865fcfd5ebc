"""Tiny random checkpoints of the mixture-of-experts families that train on slothkit's generic
path (Qwen3-MoE, gpt-oss): the tiny shapes of slothkit.models.generic_shapes with a tiny
tokenizer, written as a Hub checkpoint is, so that a notebook of Qwen3-30B-A3B or gpt-oss-20b
runs end to end offline on a CPU.

    path = tiny_expert_model_path("gpt_oss")   # built once per process, then cached

The weights are transformers' own initialisation (normal, std initializer_range) from a fixed
seed. The tokenizers are slothkit.testing's: Qwen3-MoE gets Qwen3's (its chat template in
the qwen3 format, with the think tokens); gpt-oss gets Qwen's byte-level one without BOS,
as gpt-oss's is, and no harmony tokens, so that get_chat_template(tokenizer, "gpt-oss",
model=model) adds them and grows the embeddings, as on any tokenizer without them.
"""

from __future__ import annotations

import functools
import pathlib
import tempfile

import torch

from slothkit.models.generic_shapes import GENERIC_SHAPES

# model_type -> (tokenizer flavour, the record whose chat template and special tokens it carries)
TOKENIZERS = {"qwen3_moe": ("qwen", "qwen3"), "gpt_oss": ("qwen", "qwen2")}


def tiny_expert_shape_name(model_type: str) -> str:
    """The name of the tiny generic shape of `model_type` ("tiny-gpt-oss" for "gpt_oss")."""
    names = [
        name
        for name, shape in GENERIC_SHAPES.items()
        if name.startswith("tiny-") and shape.model_type == model_type and shape.experts() is not None
    ]
    if model_type not in TOKENIZERS or not names:
        known = sorted(TOKENIZERS)
        raise ValueError(
            f"no tiny mixture-of-experts checkpoint for model_type {model_type!r}; built for: "
            f"{', '.join(known)} (a tiny-* shape in slothkit/models/generic_shapes.py and a "
            "tokenizer in slothkit.testing.tiny_expert_models.TOKENIZERS)"
        )
    return names[0]


def build_tiny_expert_model(model_type: str, path: str | pathlib.Path, seed: int = 0) -> pathlib.Path:
    """Write the tiny checkpoint of `model_type` ("qwen3_moe", "gpt_oss") with its tokenizer
    into `path`; return the folder. The vocabulary is the tokenizer's, rounded up to a
    multiple of 256 rows."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from slothkit.testing.tiny_tokenizers import build_tiny_tokenizer

    shape = GENERIC_SHAPES[tiny_expert_shape_name(model_type)]
    flavour, chat_of = TOKENIZERS[model_type]
    path = pathlib.Path(path)
    build_tiny_tokenizer(flavour, path, arch=chat_of, model_max_length=shape.max_position_embeddings)
    tokenizer = AutoTokenizer.from_pretrained(path)
    config = shape.config()
    config.vocab_size = -(-len(tokenizer) // 256) * 256
    config.pad_token_id = tokenizer.pad_token_id
    config.eos_token_id = tokenizer.eos_token_id
    config.bos_token_id = tokenizer.bos_token_id
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


@functools.cache
def tiny_expert_model_path(model_type: str) -> pathlib.Path:
    """Like build_tiny_expert_model(model_type, ...), in a folder of this process's own that
    is removed when it exits; treat it as read-only."""
    return build_tiny_expert_model(model_type, pathlib.Path(_cache_dir().name) / model_type)


@functools.cache
def _cache_dir() -> tempfile.TemporaryDirectory:
    return tempfile.TemporaryDirectory(prefix="slothkit-tiny-expert-models-")
