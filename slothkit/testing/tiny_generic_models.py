"""Tiny random checkpoints of the families that train on slothkit's generic path (Qwen3-MoE,
gpt-oss, Qwen3.5, Gemma 4): the tiny shapes of slothkit.models.generic_shapes with a tiny
tokenizer, written as a Hub checkpoint is, so that a notebook of Qwen3-30B-A3B, gpt-oss-20b,
Qwen3.5-9B or Gemma 4 E4B runs end to end offline on a CPU.

    path = tiny_generic_model_path("gpt_oss")   # built once per process, then cached

The weights are transformers' own initialisation (normal, std initializer_range) from a fixed
seed. The tokenizers are slothkit.testing's, each with the chat format its family's
notebook installs (TINY_TOKENIZERS):

    model_type     tokenizer flavour     chat format and its markers
    qwen3_moe      qwen (Qwen3's)        qwen3, with the think tokens
    qwen3_5_text   qwen (Qwen3's)        qwen3.5, with the think tokens
    gemma4_text    sentencepiece         gemma-4: <|turn>, <turn|> and the thinking
                   (Gemma's)             tokens added as special tokens, as Gemma 4's hold them
    gpt_oss        qwen, no BOS (as      gpt-oss: harmony's markers added as special tokens
                   gpt-oss's)            and its chat template (reasoning_effort included),
                                         as gpt-oss-20b's tokenizer ships them
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import tempfile

import torch

from slothkit.models.generic_shapes import GENERIC_SHAPES


@dataclasses.dataclass(frozen=True)
class TinyTokenizer:
    flavour: str  # slothkit.testing.tiny_tokenizers' flavour
    record: str  # the architecture record whose tiny chat template and markers it is built with
    chat_format: str | None = None  # installed over the record's, its missing markers added as tokens


TINY_TOKENIZERS = {
    "qwen3_moe": TinyTokenizer("qwen", "qwen3"),
    "qwen3_5_text": TinyTokenizer("qwen", "qwen3", chat_format="qwen3.5"),
    "gemma4_text": TinyTokenizer("sentencepiece", "gemma3", chat_format="gemma-4"),
    "gpt_oss": TinyTokenizer("qwen", "qwen2", chat_format="gpt-oss"),
}


def tiny_generic_shape_name(model_type: str) -> str:
    """The name of the tiny generic shape of `model_type` ("tiny-gpt-oss" for "gpt_oss")."""
    names = [
        name
        for name, shape in GENERIC_SHAPES.items()
        if name.startswith("tiny-") and shape.model_type == model_type
    ]
    if model_type not in TINY_TOKENIZERS or not names:
        raise ValueError(
            f"no tiny generic-path checkpoint for model_type {model_type!r}; built for: "
            f"{', '.join(sorted(TINY_TOKENIZERS))} (a tiny-* shape in slothkit/models/generic_shapes.py "
            "and a tokenizer in slothkit.testing.tiny_generic_models.TINY_TOKENIZERS)"
        )
    return names[0]


def build_tiny_generic_model(model_type: str, path: str | pathlib.Path, seed: int = 0) -> pathlib.Path:
    """Write the tiny checkpoint of `model_type` ("qwen3_moe", "gpt_oss", "qwen3_5_text",
    "gemma4_text") with its tokenizer into `path`; return the folder. The vocabulary is the
    tokenizer's, rounded up to a multiple of 256 rows."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from slothkit.testing.tiny_tokenizers import build_tiny_tokenizer

    shape = GENERIC_SHAPES[tiny_generic_shape_name(model_type)]
    spec = TINY_TOKENIZERS[model_type]
    path = pathlib.Path(path)
    build_tiny_tokenizer(spec.flavour, path, arch=spec.record, model_max_length=shape.max_position_embeddings)
    tokenizer = AutoTokenizer.from_pretrained(path)
    if spec.chat_format is not None:
        _install_chat_format(tokenizer, spec.chat_format)
        # tokenizer_config.json now names the special tokens (the EOS the format ends turns
        # with); the tiny tokenizer's own special_tokens_map.json would override it at load.
        (path / "special_tokens_map.json").unlink(missing_ok=True)
        tokenizer.save_pretrained(path)
    config = shape.config()
    config.vocab_size = -(-len(tokenizer) // 256) * 256
    if hasattr(config, "vocab_size_per_layer_input"):  # Gemma 4: a per-layer row for every token
        config.vocab_size_per_layer_input = config.vocab_size
    config.pad_token_id = tokenizer.pad_token_id
    config.eos_token_id = tokenizer.eos_token_id
    config.bos_token_id = tokenizer.bos_token_id
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def _install_chat_format(tokenizer, name: str) -> None:
    """`tokenizer` with the chat format `name`, each of its markers a special token of the
    tokenizer's (added before the model exists, so no embeddings to grow)."""
    import warnings

    from slothkit.data import FORMATS, get_chat_template

    missing = [token for token in FORMATS[name].special_tokens if token not in tokenizer.get_vocab()]
    if missing:
        tokenizer.add_special_tokens(
            {"additional_special_tokens": missing}, replace_extra_special_tokens=False
        )
    with warnings.catch_warnings():
        # "pass model=": the model is made after this, its vocabulary and EOS from the tokenizer
        warnings.simplefilter("ignore")
        get_chat_template(tokenizer, name)


@functools.cache
def tiny_generic_model_path(model_type: str) -> pathlib.Path:
    """Like build_tiny_generic_model(model_type, ...), in a folder of this process's own that
    is removed when it exits; treat it as read-only."""
    return build_tiny_generic_model(model_type, pathlib.Path(_cache_dir().name) / model_type)


@functools.cache
def _cache_dir() -> tempfile.TemporaryDirectory:
    return tempfile.TemporaryDirectory(prefix="slothkit-tiny-generic-models-")
