"""The model's hyperparameters as GGUF metadata: what llama.cpp reads to build its graph.

Context length, embedding length, block count, feed-forward length, head counts, key/value
length (head_dim), rope dimension count (head_dim x partial_rotary_factor: the rotated part of
each head) and base, RMS epsilon, the sliding window where the family has one, rope scaling,
file type and quantization version; for a mixture-of-experts layer the expert count, how many
run per token and an expert's width (expert_feed_forward_length). Rope scaling as llama.cpp's converter writes it:

    linear     rope.scaling.type and rope.scaling.factor
    llama3     the rope_freqs tensor of per-frequency divisors (llama graph)
    longrope   the rope_factors_long and rope_factors_short tensors (F32, one divisor per
               rotated pair: rope dimensions / 2), rope.scaling.original_context_length and
               rope.scaling.attn_factor (phi3 graph; see slothkit.export.gguf.longrope)
    yarn       rope.scaling.type yarn, rope.scaling.factor, original_context_length and the
               two betas (gpt-oss graph; see slothkit.export.gguf.yarn)

Layers that slide, and their rope base, come from slothkit.export.gguf.attention, as do the
checks that let Gemma 2's attention and output soft-caps be written.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from gguf import GGML_QUANT_VERSION, GGUFWriter, RopeScalingType

from slothkit.export.gguf import attention, deltanet, gemma4, longrope
from slothkit.export.gguf.layout import head_counts
from slothkit.export.gguf.yarn import Yarn, yarn_scaling
from slothkit.models import Architecture


@dataclasses.dataclass(frozen=True)
class HyperParameters:
    vocab_size: int
    hidden: int
    intermediate: (
        int | tuple[int, ...] | None
    )  # one per layer where they differ (Gemma 4); None: no dense MLP
    n_layers: int
    n_heads: int
    n_kv_heads: int | tuple[int, ...]  # one per layer where they differ (Gemma 4)
    head_dim: int
    rope_dims: int  # the rotated part of each head: head_dim x partial_rotary_factor
    rms_eps: float
    context: int
    rope_theta: float
    rope_type: str
    rope: dict
    sliding_window: int | None
    sliding_layers: tuple[bool, ...] | None  # per layer, True: within the window (windowed_layers)
    rope_theta_sliding: float | None  # the sliding layers' rope base (windowed_layers)
    attn_softcap: float | None = None  # attention-score soft-cap (logit_softcapping)
    final_softcap: float | None = None  # output-logit soft-cap (logit_softcapping)
    longrope: longrope.LongRope | None = None  # rope type "longrope": its factors and lengths
    experts: tuple[int, int, int] | None = None  # (count, used per token, width); None: dense MLP
    yarn: Yarn | None = None  # rope type "yarn": its factor, original context and betas
    deltanet: deltanet.DeltaNetShape | None = None  # DeltaNet layers (Qwen3.5): their shape and pattern
    rope_sections: tuple[int, ...] | None = (
        None  # multi-axis rope's pairs per position axis (Qwen3.5, Qwen2.5-VL)
    )
    gemma4: gemma4.Gemma4Layers | None = None  # Gemma 4's per-layer shapes and keys
    shared_expert_width: int | None = None  # a shared expert beside the routed ones (Qwen3.5 MoE)


def hyperparameters(config, arch: Architecture) -> HyperParameters:
    if arch.gguf.gemma4:
        return _gemma4_hyperparameters(config)
    n_heads, n_kv_heads = head_counts(config)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_heads
    rope, sliding_rope = attention.rope_parameters(config)
    rope_type = rope["rope_type"]
    if rope_type not in ("default", "linear", "llama3", "longrope", "yarn"):
        raise NotImplementedError(
            "GGUF export supports the rope types 'default', 'linear', 'llama3', 'longrope' and 'yarn'; "
            f"this model uses {rope_type!r}"
        )
    # transformers 5 keeps partial_rotary_factor in rope_parameters, transformers 4 in the config.
    partial = rope.get("partial_rotary_factor") or getattr(config, "partial_rotary_factor", None) or 1.0
    rope_dims = int(head_dim * float(partial))
    scaling = longrope.longrope(config, rope, rope_dims, arch) if rope_type == "longrope" else None
    sliding_layers, rope_theta_sliding = None, None
    if arch.gguf.windowed_layers:
        attention.check_windowed_attention(config, arch, head_dim, sliding_rope)
        sliding_layers = attention.sliding_layers(config)
        rope_theta_sliding = sliding_rope["rope_theta"] if sliding_rope else rope["rope_theta"]
    return HyperParameters(
        vocab_size=config.vocab_size,
        hidden=config.hidden_size,
        # none where every layer's MLP is experts (Qwen3.5's MoE sizes)
        intermediate=getattr(config, "intermediate_size", None),
        n_layers=config.num_hidden_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        rope_dims=rope_dims,
        rms_eps=config.rms_norm_eps,
        context=config.max_position_embeddings,
        rope_theta=rope["rope_theta"],
        rope_type=rope_type,
        rope=rope,
        sliding_window=attention.sliding_window(config, arch),
        sliding_layers=sliding_layers,
        rope_theta_sliding=rope_theta_sliding,
        attn_softcap=config.attn_logit_softcapping if arch.gguf.logit_softcapping else None,
        final_softcap=config.final_logit_softcapping if arch.gguf.logit_softcapping else None,
        longrope=scaling,
        experts=_experts(config, arch),
        yarn=yarn_scaling(config, rope, arch) if rope_type == "yarn" else None,
        deltanet=deltanet.deltanet_shape(config) if arch.gguf.deltanet else None,
        rope_sections=_rope_sections(rope, rope_dims, arch),
        shared_expert_width=_shared_expert_width(config, arch),
    )


def _gemma4_hyperparameters(config) -> HyperParameters:
    """Gemma 4's: the full layers' head size and rope (slothkit.export.gguf.gemma4), a number
    per layer where the layers differ; its window and the rest are gemma4.write_metadata's."""
    layers = gemma4.gemma4_layers(config)

    def one_or_each(values: tuple[int, ...]):
        return values[0] if len(set(values)) == 1 else values

    return HyperParameters(
        vocab_size=config.vocab_size,
        hidden=config.hidden_size,
        intermediate=one_or_each(layers.widths),
        n_layers=config.num_hidden_layers,
        n_heads=config.num_attention_heads,
        n_kv_heads=one_or_each(layers.kv_heads),
        head_dim=layers.full_head_dim,
        rope_dims=layers.full_head_dim,  # the whole head, rope_freqs leaving the unrotated pairs still
        rms_eps=config.rms_norm_eps,
        context=config.max_position_embeddings,
        rope_theta=layers.rope_theta,
        rope_type="default",
        rope={},
        sliding_window=None,
        sliding_layers=None,
        rope_theta_sliding=None,
        experts=layers.experts,
        gemma4=layers,
    )


def _rope_sections(rope: dict, rope_dims: int, arch: Architecture) -> tuple[int, ...] | None:
    """rope.dimension_sections (four entries) where llama.cpp's graph reads them: Qwen3.5's
    interleaved split (deltanet.rope_sections), or M-RoPE's contiguous runs of rotated pairs
    per axis (qwen2vl), which are transformers' mrope_section as it is, padded with zeros."""
    if arch.gguf.deltanet:
        return deltanet.rope_sections(rope, rope_dims)
    if not arch.gguf.mrope_sections:
        return None
    sections = [int(n) for n in rope.get("mrope_section") or ()]
    if not sections or sum(sections) != rope_dims // 2 or len(sections) > 4:
        raise ValueError(
            f"M-RoPE's mrope_section {sections} must split the {rope_dims // 2} rotated pairs of a head "
            f"among at most four position axes"
        )
    return tuple(sections + [0] * (4 - len(sections)))


def _shared_expert_width(config, arch: Architecture) -> int | None:
    key = arch.gguf.experts.shared_width_key if arch.gguf.experts else None
    return int(getattr(config, key)) if key else None


def _experts(config, arch: Architecture) -> tuple[int, int, int] | None:
    fields = arch.gguf.experts
    if fields is None:
        return None
    return tuple(
        int(getattr(config, key)) for key in (fields.count_key, fields.used_count_key, fields.width_key)
    )


def write_metadata(writer: GGUFWriter, hp: HyperParameters, method, name: str) -> None:
    writer.add_name(name)
    writer.add_file_type(int(method.file_type))
    writer.add_quantization_version(GGML_QUANT_VERSION)
    writer.add_context_length(hp.context)
    writer.add_embedding_length(hp.hidden)
    writer.add_block_count(hp.n_layers)
    if hp.intermediate is not None:
        writer.add_feed_forward_length(hp.intermediate)
    writer.add_head_count(hp.n_heads)
    writer.add_head_count_kv(hp.n_kv_heads)
    writer.add_key_length(hp.head_dim)
    writer.add_value_length(hp.head_dim)
    writer.add_rope_dimension_count(hp.rope_dims)
    writer.add_rope_freq_base(hp.rope_theta)
    writer.add_layer_norm_rms_eps(hp.rms_eps)
    writer.add_vocab_size(hp.vocab_size)
    if hp.rope_type == "linear":
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(hp.rope["factor"]))
    if hp.yarn is not None:
        writer.add_rope_scaling_type(RopeScalingType.YARN)
        writer.add_rope_scaling_factor(hp.yarn.factor)
        writer.add_rope_scaling_orig_ctx_len(hp.yarn.original_context)
        writer.add_rope_scaling_yarn_beta_fast(hp.yarn.beta_fast)
        writer.add_rope_scaling_yarn_beta_slow(hp.yarn.beta_slow)
    if hp.longrope is not None:
        writer.add_rope_scaling_orig_ctx_len(hp.longrope.original_context)
        writer.add_rope_scaling_attn_factors(hp.longrope.attention_factor)
    if hp.sliding_window:
        writer.add_sliding_window(int(hp.sliding_window))
    if hp.sliding_layers is not None:
        writer.add_sliding_window_pattern(list(hp.sliding_layers))
        writer.add_rope_freq_base_swa(hp.rope_theta_sliding)
    if hp.attn_softcap is not None:
        writer.add_attn_logit_softcapping(float(hp.attn_softcap))
    if hp.final_softcap is not None:
        writer.add_final_logit_softcapping(float(hp.final_softcap))
    if hp.deltanet is not None:
        shape = hp.deltanet
        writer.add_ssm_conv_kernel(shape.conv_kernel)
        writer.add_ssm_state_size(shape.key_dim)
        writer.add_ssm_group_count(shape.key_heads)
        writer.add_ssm_time_step_rank(shape.value_heads)
        writer.add_ssm_inner_size(shape.value_heads * shape.value_dim)
        writer.add_full_attention_interval(shape.full_attention_interval)
    if hp.gemma4 is not None:
        gemma4.write_metadata(writer, hp.gemma4)
    if hp.rope_sections is not None:
        writer.add_rope_dimension_sections(list(hp.rope_sections))
    if hp.experts is not None:
        count, used, width = hp.experts
        writer.add_expert_count(count)
        writer.add_expert_used_count(used)
        writer.add_expert_feed_forward_length(width)
    if hp.shared_expert_width is not None:
        writer.add_expert_shared_feed_forward_length(hp.shared_expert_width)


def llama3_rope_divisors(hp: HyperParameters) -> torch.Tensor:
    """Llama 3.1's frequency rescaling as llama.cpp's rope_freqs: per frequency, the number the
    rotation frequency is divided by. Long wavelengths (beyond the original context / low
    factor) are slowed by `factor`, short ones (below / high factor) kept, and the band in
    between blends the two smoothly in 1 / frequency."""
    p = hp.rope
    factor = float(p.get("factor", 8.0))
    low, high = float(p.get("low_freq_factor", 1.0)), float(p.get("high_freq_factor", 4.0))
    original = float(p.get("original_max_position_embeddings", 8192))
    freqs = 1.0 / (hp.rope_theta ** (torch.arange(0, hp.head_dim, 2, dtype=torch.float32) / hp.head_dim))
    divisors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < original / high:
            divisors.append(1.0)
        elif wavelen > original / low:
            divisors.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(divisors, dtype=torch.float32)


# ---------------------------------------------------------------------------------------
# Tensors
# ---------------------------------------------------------------------------------------
