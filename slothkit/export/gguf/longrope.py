"""LongRoPE ("longrope", formerly "su"; Phi-3-mini-128k, Phi-3-medium-128k, Phi-3.5-mini) as
a GGUF file states it and as llama.cpp computes it.

Hugging Face (transformers' _compute_longrope_parameters and longrope_frequency_update):
each rotated pair i turns at base^(-2i/d) / factor_i, with short_factor while the sequence
(largest position + 1) is at most original_max_position_embeddings and long_factor beyond,
for every position of that forward pass; cos and sin are multiplied by the attention factor

    attention_factor   if the config sets it, else
    sqrt(1 + ln(s) / ln(original))   with s = factor, or max_position_embeddings / original,
                                     and 1 when s <= 1.

The file (as llama.cpp's converter, Phi3MiniModel, writes it): both factor lists as the F32
tensors rope_factors_long.weight and rope_factors_short.weight (rope dimensions / 2 values),
rope.scaling.original_context_length = original_max_position_embeddings,
rope.scaling.attn_factor = the attention factor, context_length = max_position_embeddings.

llama.cpp (src/models/phi3.cpp: ggml_rope_ext with the factors as freq_factors, which divide
each pair's frequency, and attn_factor, which multiplies cos and sin, as in HF) chooses the
factors in llama_model::get_rope_factors (src/llama-model.cpp). In the llama.cpp that
llama-cpp-python 0.3.36 ships, by the context it was started with, once: long factors when
the context per sequence (n_ctx_seq) exceeds original_context_length, short ones otherwise,
for every position whatever the sequence's length; and the context asked for is first
rounded up to a multiple of 256 (llama_context's constructor, src/llama-context.cpp). So
the two agree
    - in a context of at most original_context_length (after rounding): short factors on
      both sides, for every sequence that fits;
    - in a larger context on sequences longer than original_context_length: long on both;
and differ on shorter sequences in a larger context, where llama.cpp rotates with the long
factors and HF with the short ones. For Phi-3-mini-128k (original 4096): `-c 4096` runs
the short factors, any larger context the long ones, from the first token. (llama.cpp at
upstream commit 358a4a01 chooses per batch by its largest position instead, pos_max >=
original_context_length, which is HF's rule.)
"""

from __future__ import annotations

import dataclasses
import math

import torch

from slothkit.models import RECORDS, Architecture


@dataclasses.dataclass(frozen=True)
class LongRope:
    long_factors: tuple[float, ...]  # per rotated pair, beyond the original context
    short_factors: tuple[float, ...]  # per rotated pair, within it
    original_context: int  # original_max_position_embeddings
    attention_factor: float  # multiplies cos and sin

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        """The file's two factor tensors, F32, in llama.cpp's names."""
        return [
            ("rope_factors_long.weight", torch.tensor(self.long_factors, dtype=torch.float32)),
            ("rope_factors_short.weight", torch.tensor(self.short_factors, dtype=torch.float32)),
        ]


def longrope(config, rope: dict, rope_dims: int, arch: Architecture) -> LongRope:
    """The longrope scaling of a model, checked against what llama.cpp reads.

    Args:
        config: the model's transformers config.
        rope: its rope parameters (attention.rope_parameters), of rope type "longrope".
        rope_dims: the rotated part of each head (head_dim x partial_rotary_factor).
        arch: the model's record; its GGUF layout says whether llama.cpp's graph reads the factors.
    """
    if not arch.gguf.rope_factors:
        graphs = " and ".join(repr(record.gguf.arch) for record in RECORDS if record.gguf.rope_factors)
        raise NotImplementedError(
            f"'longrope' rope scaling is exported for llama.cpp's {graphs} graph only, which reads the "
            f"rope_factors tensors; this model's GGUF architecture is {arch.gguf.arch!r}"
        )
    # HF's Phi-3 config keeps the original length beside rope_scaling, and that one wins.
    original = getattr(config, "original_max_position_embeddings", None) or rope.get(
        "original_max_position_embeddings"
    )
    if not original:
        raise ValueError(
            "'longrope' rope scaling needs original_max_position_embeddings (the pre-training context, "
            "where short factors give way to long ones); this config has none"
        )
    factors = {kind: rope.get(f"{kind}_factor") for kind in ("long", "short")}
    for kind, values in factors.items():
        if values is None or len(values) != rope_dims // 2:
            raise ValueError(
                f"'longrope' needs {kind}_factor with one value per rotated pair ({rope_dims // 2} for "
                f"{rope_dims} rotated dimensions); this config's has "
                f"{'none' if values is None else len(values)}"
            )
    return LongRope(
        long_factors=tuple(float(v) for v in factors["long"]),
        short_factors=tuple(float(v) for v in factors["short"]),
        original_context=int(original),
        attention_factor=attention_factor(config, rope, int(original)),
    )


def attention_factor(config, rope: dict, original: int) -> float:
    """HF's multiplier of cos and sin (see the module docstring)."""
    if rope.get("attention_factor") is not None:
        return float(rope["attention_factor"])
    scale = rope.get("factor") or config.max_position_embeddings / original
    if scale <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(scale) / math.log(original))


# llama.cpp rounds the context it is asked for up to a multiple of this (llama_context's
# constructor, src/llama-context.cpp: GGML_PAD(n_ctx, 256), and n_ctx_seq likewise).
LLAMA_CPP_CONTEXT_STEP = 256


def llama_cpp_context(requested: int) -> int:
    """The context llama.cpp runs when asked for `requested` tokens (one sequence)."""
    return -(-requested // LLAMA_CPP_CONTEXT_STEP) * LLAMA_CPP_CONTEXT_STEP


def llama_cpp_uses_long_factors(requested_context: int, original_context: int) -> bool:
    """Whether llama.cpp (as llama-cpp-python 0.3.36 ships it), started with a context of
    `requested_context` tokens for one sequence, rotates with the long factors: by its
    context once rounded up (llama_cpp_context), not by the sequence."""
    return llama_cpp_context(requested_context) > original_context


def largest_short_context(original_context: int) -> int | None:
    """The largest context llama.cpp can be asked for and still rotate with the short
    factors, or None when every context it runs exceeds the original one (below 256)."""
    context = original_context // LLAMA_CPP_CONTEXT_STEP * LLAMA_CPP_CONTEXT_STEP
    return context or None


def hf_uses_long_factors(sequence_length: int, original_context: int) -> bool:
    """Whether HF rotates a forward pass over `sequence_length` tokens with the long factors."""
    return sequence_length > original_context
