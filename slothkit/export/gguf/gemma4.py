"""Gemma 4's text model in llama.cpp's layout: its "gemma4" graph.

The layers are Gemma 3's (slothkit.export.gguf.layout: the six norms, q/k norms), with
every norm written as it is (Gemma 4's scale by w, llama.cpp's converter adds nothing). What
Gemma 4 adds, and where it goes (llama.cpp's converter, Gemma4Model in conversion/gemma.py):

    HF weight                                 GGUF tensor
    model.embed_tokens_per_layer.weight       per_layer_token_embd.weight
    model.per_layer_model_projection.weight   per_layer_model_proj.weight
    model.per_layer_projection_norm.weight    per_layer_proj_norm.weight
    layers.N.per_layer_input_gate.weight      blk.N.inp_gate.weight
    layers.N.per_layer_projection.weight      blk.N.proj.weight
    layers.N.post_per_layer_input_norm        blk.N.post_norm.weight (the record's norms)
    layers.N.layer_scalar                     blk.N.layer_output_scale.weight

The keys llama.cpp builds the layers from (the converter's set_gguf_parameters):

    attention.key_length / value_length          the full layers' head size
    attention.key_length_swa / value_length_swa  the sliding layers'
    attention.head_count_kv                      one number, or one per layer where they differ
    feed_forward_length                          one per layer where they differ (E2B/E4B's
                                                 double-wide MLP in the layers sharing k/v)
    attention.shared_kv_layers                   how many last layers reuse keys and values
    embedding_length_per_layer_input             the per-layer inputs' width (0: none)
    attention.sliding_window(_pattern)           the window and which layers slide
    rope.freq_base / freq_base_swa               the full and sliding layers' rope bases
    rope.dimension_count / dimension_count_swa   full layers: the whole head (below);
                                                 sliding layers: head x partial_rotary_factor
    final_logit_softcapping                      where the config sets it

Proportional rope: HF's full layers rotate pairs i < head x factor / 2 of each half-split
head at frequency base^(-2i / head) and leave the other pairs alone. llama.cpp rotates the
whole head at base^(-2i / head) and divides each pair's frequency by rope_freqs.weight (only
the full layers read it): 1 for the rotated pairs, 1e30 for the others, whose angle is then
zero.

Keys as values (attention_k_eq_v: the 31B's full layers): such a layer has no v_proj, and
HF takes its values from k_proj's output (before k_norm and rope), normalised by v_norm;
llama.cpp's graph does the same for a layer whose file holds no attn_v, so nothing is
written for it (its key/value heads, num_global_key_value_heads, go into head_count_kv per
layer).

Refused, where llama.cpp's graph would compute something else or slothkit has not checked it
against llama.cpp: a sliding-layer rope other than the default, a full-layer rope other than
proportional (or default over the whole head), layers sharing keys and values other than
after a sliding and then a full layer (llama.cpp's rule for which layer's cache they reuse),
and bidirectional attention over text (use_bidirectional_attention='all').

The mixture-of-experts block (enable_moe_block: 26B-A4B) runs beside each layer's MLP: a
router (router.proj -> ffn_gate_inp.weight, its input scale router.scale ->
ffn_gate_inp.scale, router.per_expert_scale -> ffn_down_exps.scale, each chosen expert's
weight multiplied by its scale), the experts as llama.cpp's fused stacks (experts.gate_up_proj
-> ffn_gate_up_exps.weight, the gate's rows then the up's, as HF holds them;
experts.down_proj -> ffn_down_exps.weight), and its norms (pre_feedforward_layernorm_2,
post_feedforward_layernorm_1 and _2 -> pre_ffw_norm_2, post_ffw_norm_1, post_ffw_norm_2);
the keys expert_count, expert_used_count (top_k_experts) and expert_feed_forward_length.
"""

from __future__ import annotations

import dataclasses

import torch

from slothkit.export.gguf.attention import rope_parameters

_TOP_LEVEL = {
    "model.embed_tokens_per_layer.weight": "per_layer_token_embd.weight",
    "model.per_layer_model_projection.weight": "per_layer_model_proj.weight",
    "model.per_layer_projection_norm.weight": "per_layer_proj_norm.weight",
}
_LAYER = {  # a decoder layer's own weights beside the attention, MLP and norms
    "per_layer_input_gate.weight": "inp_gate.weight",
    "per_layer_projection.weight": "proj.weight",
    "layer_scalar": "layer_output_scale.weight",
    # the mixture-of-experts block beside the MLP (enable_moe_block: 26B-A4B)
    "router.proj.weight": "ffn_gate_inp.weight",
    "router.scale": "ffn_gate_inp.scale",
    "router.per_expert_scale": "ffn_down_exps.scale",
    "experts.gate_up_proj": "ffn_gate_up_exps.weight",
    "experts.down_proj": "ffn_down_exps.weight",
}
_PREFIX = "model.layers."
_UNROTATED = 1e30  # rope_freqs' divisor of a pair proportional rope leaves alone


@dataclasses.dataclass(frozen=True)
class Gemma4Layers:
    head_dims: tuple[int, ...]  # per layer
    kv_heads: tuple[int, ...]  # per layer
    sliding: tuple[bool, ...]  # per layer: within the window
    widths: tuple[int, ...]  # per layer: the MLP's intermediate size
    shared_kv_layers: int
    per_layer_input: int  # hidden_size_per_layer_input; 0: none
    window: int
    rope_theta: float  # the full layers'
    rope_theta_sliding: float
    rotated_pairs: int  # of a full layer's head_dim / 2 pairs, those proportional rope turns
    rope_dims_sliding: int
    final_softcap: float | None
    experts: tuple[int, int, int] | None  # the MoE block's (count, used per token, width); None: none

    @property
    def full_head_dim(self) -> int:
        return next(d for d, s in zip(self.head_dims, self.sliding) if not s)

    @property
    def sliding_head_dim(self) -> int:
        return next(d for d, s in zip(self.head_dims, self.sliding) if s)


def gemma4_layers(config) -> Gemma4Layers:
    """What llama.cpp's gemma4 graph needs of a gemma4_text config, refused where it would
    compute another model (module docstring)."""
    graph = "llama.cpp's 'gemma4' graph"
    # "vision" makes image tokens attend both ways, text causally: a text model is unchanged.
    if getattr(config, "use_bidirectional_attention", None) == "all":
        raise NotImplementedError(
            f"{graph} attends causally; this model sets use_bidirectional_attention='all' (accepted: None, 'vision')"
        )
    layers = list(config.per_layer_config)
    sliding = tuple(kind == "sliding_attention" for kind in config.layer_types)
    if all(sliding) or not any(sliding):
        raise NotImplementedError(
            f"{graph} takes sliding and full layers; this model's are {config.layer_types}"
        )
    n = config.num_hidden_layers
    shared = int(getattr(config, "num_kv_shared_layers", 0) or 0)
    first_shared = n - shared
    if shared and (first_shared < 2 or sliding[first_shared - 1] or not sliding[first_shared - 2]):
        raise NotImplementedError(
            f"{graph} gives the last {shared} layers the keys and values of layer {first_shared - 2} (sliding) "
            f"and {first_shared - 1} (full); this model's layer types end its own keys and values with "
            f"{config.layer_types[max(first_shared - 2, 0) : first_shared]}"
        )
    width = config.intermediate_size
    double = getattr(config, "use_double_wide_mlp", False)
    widths = tuple(width * 2 if double and i >= first_shared else width for i in range(n))
    full, sliding_rope = rope_parameters(config)
    sliding_rope = sliding_rope or full
    if sliding_rope["rope_type"] != "default":
        raise NotImplementedError(
            f"{graph} rotates the sliding layers with the default rope; this model's is "
            f"{sliding_rope['rope_type']!r}"
        )
    full_head = next(layer.head_dim for layer, s in zip(layers, sliding) if not s)
    factor = float(full.get("partial_rotary_factor", 1.0))
    if full["rope_type"] not in ("proportional", "default") or (
        full["rope_type"] == "default" and factor != 1.0
    ):
        raise NotImplementedError(
            f"{graph} rotates the full layers proportionally (or wholly); this model's rope is "
            f"{full['rope_type']!r} with partial_rotary_factor {factor}"
        )
    sliding_head = next(layer.head_dim for layer, s in zip(layers, sliding) if s)
    return Gemma4Layers(
        head_dims=tuple(layer.head_dim for layer in layers),
        kv_heads=tuple(layer.num_key_value_heads for layer in layers),
        sliding=sliding,
        widths=widths,
        shared_kv_layers=shared,
        per_layer_input=int(getattr(config, "hidden_size_per_layer_input", 0) or 0),
        window=int(config.sliding_window),
        rope_theta=full["rope_theta"],
        rope_theta_sliding=sliding_rope["rope_theta"],
        rotated_pairs=int(full_head * factor / 2),
        rope_dims_sliding=int(sliding_head * float(sliding_rope.get("partial_rotary_factor", 1.0))),
        final_softcap=getattr(config, "final_logit_softcapping", None),
        experts=(
            (int(config.num_experts), int(config.top_k_experts), int(config.moe_intermediate_size))
            if getattr(config, "enable_moe_block", False)
            else None
        ),
    )


def write_metadata(writer, layers: Gemma4Layers) -> None:
    """The keys of the module docstring's table that the common ones (metadata.write_metadata)
    leave out; key_length, rope.dimension_count and the rest come from HyperParameters."""
    writer.add_key_length_swa(layers.sliding_head_dim)
    writer.add_value_length_swa(layers.sliding_head_dim)
    writer.add_rope_dimension_count_swa(layers.rope_dims_sliding)
    writer.add_rope_freq_base_swa(layers.rope_theta_sliding)
    writer.add_sliding_window(layers.window)
    writer.add_sliding_window_pattern(list(layers.sliding))
    writer.add_shared_kv_layers(layers.shared_kv_layers)
    writer.add_embedding_length_per_layer_input(layers.per_layer_input)
    if layers.final_softcap:
        writer.add_final_logit_softcapping(float(layers.final_softcap))


def rope_divisors(layers: Gemma4Layers) -> torch.Tensor:
    """rope_freqs.weight: 1 for each rotated pair of a full layer's head, 1e30 for the others."""
    pairs = layers.full_head_dim // 2
    return torch.tensor(
        [1.0] * layers.rotated_pairs + [_UNROTATED] * (pairs - layers.rotated_pairs), dtype=torch.float32
    )


def gguf_tensor_name(hf_name: str) -> tuple[str, int | None] | None:
    """The GGUF name and layer (None outside the layers) of a weight only Gemma 4 has, or None."""
    if hf_name in _TOP_LEVEL:
        return _TOP_LEVEL[hf_name], None
    if not hf_name.startswith(_PREFIX):
        return None
    layer, _, parameter = hf_name[len(_PREFIX) :].partition(".")
    if parameter not in _LAYER or not layer.isdigit():
        return None
    return f"blk.{layer}.{_LAYER[parameter]}", int(layer)
