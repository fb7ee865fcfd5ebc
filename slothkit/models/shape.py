"""A model's size, no weights: what `slothkit bench` builds with random weights and what
`slothkit plan` predicts memory from.

Each architecture record (slothkit.models) names the real checkpoints' shapes of its
family; slothkit.models.SHAPES collects them by name.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Families whose full-attention layers gate their output: q_proj writes each head's query
# and a gate as wide (transformers' Qwen3_5Attention), the attention's output is multiplied
# by the gate's sigmoid before o_proj; the planner (slothkit.memory.hybrid_layers), the
# FLOPs per token (Shape.matmul_parameters) and the decode step count both.
OUTPUT_GATE_TYPES = frozenset({"qwen3_5_text", "qwen3_5_moe_text"})


@dataclass(frozen=True)
class Shape:
    model_type: str  # transformers model_type
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    max_position_embeddings: int
    extra: dict = field(default_factory=dict)  # further config fields (rope_theta, head_dim, ...)

    def config_fields(self) -> dict:
        """The transformers config's fields of this shape (its model_type aside)."""
        return dict(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            vocab_size=self.vocab_size,
            max_position_embeddings=self.max_position_embeddings,
            **self.extra,
        )

    def config(self):
        from transformers import AutoConfig

        return AutoConfig.for_model(self.model_type, **self.config_fields())

    def experts(self) -> ExpertsShape | None:
        """The mixture-of-experts layers' sizes, or None for a dense model."""
        routed = self.extra.get("num_experts_per_tok")
        count = self.extra.get("num_experts") or self.extra.get("num_local_experts")
        if not routed or not count:
            return None
        # Qwen3-MoE may keep some layers dense: every decoder_sparse_step-th layer is
        # sparse, except those listed in mlp_only_layers.
        step = self.extra.get("decoder_sparse_step", 1) or 1
        dense = set(self.extra.get("mlp_only_layers") or ())
        layers = sum(1 for n in range(self.num_hidden_layers) if n not in dense and (n + 1) % step == 0)
        width = self.extra.get("moe_intermediate_size", self.intermediate_size)
        shared_width = self.extra.get("shared_expert_intermediate_size") or 0
        # Qwen3-MoE and Qwen2-MoE renormalise the chosen experts' weights where
        # norm_topk_prob says so; Qwen3.5-MoE and Mixtral always, and their configs do not say.
        renormalised = bool(self.extra.get("norm_topk_prob", True))
        return ExpertsShape(count, width, routed, layers, shared_width, renormalised)

    def layer_types(self) -> list[str]:
        """Each decoder layer's kind, as the config's layer_types names it: "full_attention"
        for every layer of a model that does not say."""
        return list(self.extra.get("layer_types") or ["full_attention"] * self.num_hidden_layers)

    def linear_attention(self) -> LinearAttentionShape | None:
        """The gated DeltaNet (linear attention) layers' sizes, or None where every layer
        attends in full."""
        layers = self.layer_types().count("linear_attention")
        if not layers:
            return None
        get = self.extra.get
        return LinearAttentionShape(
            get("linear_num_key_heads"),
            get("linear_num_value_heads"),
            get("linear_key_head_dim"),
            get("linear_value_head_dim"),
            get("linear_conv_kernel_dim"),
            layers,
        )

    def head_dim(self) -> int:
        """The full-attention layers' head width."""
        return self.extra.get("head_dim", self.hidden_size // self.num_attention_heads)

    def full_attention_layers(self) -> int:
        """The decoder layers that attend in full (all but a hybrid's linear-attention ones)."""
        linear = self.linear_attention()
        return self.num_hidden_layers - (linear.layers if linear else 0)

    def attention_parameters(self, layer_type: str = "full_attention") -> int:
        """One decoder layer's attention projections: q/k/v/o, q_proj twice as wide where
        the layer gates its output (OUTPUT_GATE_TYPES); a gated DeltaNet layer's
        ("linear_attention") in_proj_qkv, in_proj_z, in_proj_b, in_proj_a and out_proj."""
        h = self.hidden_size
        if layer_type == "linear_attention":
            linear = self.linear_attention()
            values = linear.value_heads * linear.value_dim
            # in_proj_qkv (the convolution's channels), in_proj_z (values), in_proj_b and
            # in_proj_a (a value head each) read the hidden state; out_proj writes it.
            return h * (linear.conv_channels + values + 2 * linear.value_heads) + values * h
        q = self.num_attention_heads * self.head_dim()
        return h * (self.query_width() + 2 * self.num_key_value_heads * self.head_dim()) + q * h

    def query_width(self) -> int:
        """A full-attention layer's q_proj output: the queries, and as many gate values
        where the layer gates its output (OUTPUT_GATE_TYPES)."""
        width = self.num_attention_heads * self.head_dim()
        return 2 * width if self.model_type in OUTPUT_GATE_TYPES else width

    def per_layer_input_parameters(self) -> tuple[int, int]:
        """Gemma 4 E2B/E4B's per-layer input embeddings: (the table, a lookup:
        vocab_size_per_layer_input rows of every layer's slice; the linear layers that mix
        it in: the projection of the token embeddings to every slice, and each layer's gate
        and projection back). (0, 0) for a model without them. E4B's table alone is 2.8
        billion parameters, a third of the checkpoint."""
        width = self.extra.get("hidden_size_per_layer_input") or 0
        if not width:
            return 0, 0
        slices = self.num_hidden_layers * width
        table = self.extra.get("vocab_size_per_layer_input", self.vocab_size) * slices
        return table, self.hidden_size * slices + self.num_hidden_layers * 2 * self.hidden_size * width

    def matmul_parameters(self) -> int:
        """Parameters of the projections and LM head that cost FLOPs per token: each layer's
        attention projections by its kind (``attention_parameters``); of a
        mixture-of-experts layer, the router, the experts each token is routed to and the
        shared expert with its gate (H -> 1), which every token runs."""
        attention = sum(self.attention_parameters(kind) for kind in self.layer_types())
        dense_mlp = 3 * self.hidden_size * self.intermediate_size
        experts = self.experts()
        sparse_layers = experts.layers if experts else 0
        mlps = (self.num_hidden_layers - sparse_layers) * dense_mlp
        if experts:
            routed = experts.top_k * 3 * self.hidden_size * experts.width + experts.count * self.hidden_size
            shared = (
                3 * self.hidden_size * experts.shared_width + self.hidden_size if experts.shared_width else 0
            )
            mlps += sparse_layers * (routed + shared)
        return attention + mlps + self.per_layer_input_parameters()[1] + self.vocab_size * self.hidden_size


@dataclass(frozen=True)
class ExpertsShape:
    """A model's mixture-of-experts layers: ``count`` experts of MLP width ``width``, each
    token routed to ``top_k`` of them, in ``layers`` of the decoder layers (the others
    have a dense MLP of the shape's intermediate_size).  Beside the routed experts, a
    shared expert of width ``shared_width`` that every token runs, its output scaled by
    sigmoid(shared_expert_gate(x)), a linear layer H -> 1 (Qwen3.5-MoE); 0
    where there is none (Qwen3-MoE, gpt-oss, Mixtral, Gemma 4).  ``renormalised``: the
    router divides the chosen experts' softmax weights by their sum."""

    count: int
    width: int
    top_k: int
    layers: int
    shared_width: int = 0
    renormalised: bool = True


@dataclass(frozen=True)
class LinearAttentionShape:
    """A hybrid model's gated DeltaNet layers (Qwen3.5): ``key_heads`` query/key heads of
    ``key_dim`` and ``value_heads`` value heads of ``value_dim`` (each key head serving
    value_heads / key_heads of them), a causal depthwise convolution ``conv_kernel`` wide
    over q, k and v, in ``layers`` of the decoder layers (the others attend in full)."""

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int
    layers: int

    @property
    def conv_channels(self) -> int:
        """The convolution's channels: q, k and v side by side."""
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim


# The config fields Shape.experts reads.
EXPERTS_FIELDS = (
    "num_experts",
    "num_local_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "decoder_sparse_step",
    "mlp_only_layers",
    "norm_topk_prob",
)

# The config fields Shape.linear_attention reads.
LINEAR_ATTENTION_FIELDS = (
    "layer_types",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
)


def _check_positive(config, name: str, required: bool) -> None:
    """A size field of a config is a positive integer (None allowed where not required)."""
    value = getattr(config, name, None)
    if value is None and not required:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        found = f"no {name}" if value is None else f"{name} {value!r}"
        raise ValueError(f"the model's config has {found}; expected a positive integer")


def _dense_width(config) -> int:
    """The config's dense MLP width (intermediate_size).  A model whose every layer is a
    mixture of experts may have none (Qwen3.5-MoE's config has no intermediate_size): the
    experts' width (moe_intermediate_size) stands in for it, which nothing reads where
    every layer is sparse (Shape.experts says which layers are; the memory model counts
    those by their experts) and which keeps the rank check of `slothkit plan` on the
    narrowest adapted projection."""
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    if getattr(config, "intermediate_size", None) is None and experts:
        _check_positive(config, "moe_intermediate_size", required=True)
        return config.moe_intermediate_size
    _check_positive(config, "intermediate_size", required=True)
    return config.intermediate_size


def shape_from_config(config) -> Shape:
    """A Shape read off a transformers config (for checkpoints the bench does not name).

    Args:
        config: a transformers config, or anything with its attributes (config.json's
            fields as a namespace).
    """
    for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        _check_positive(config, name, required=True)
    dense_width = _dense_width(config)
    _check_positive(config, "num_key_value_heads", required=False)
    extra = {}
    head_dim = getattr(config, "head_dim", None)
    if head_dim and head_dim != config.hidden_size // config.num_attention_heads:
        extra["head_dim"] = head_dim
    hybrid = "linear_attention" in (getattr(config, "layer_types", None) or ())
    # Shape.experts' fields, and Shape.linear_attention's where some layers are linear.
    for name in EXPERTS_FIELDS + (LINEAR_ATTENTION_FIELDS if hybrid else ()):
        value = getattr(config, name, None)
        if value is not None and (not isinstance(value, bool) or name == "norm_topk_prob"):
            extra[name] = list(value) if isinstance(value, (list, tuple)) else value
    return Shape(
        config.model_type,
        config.hidden_size,
        dense_width,
        config.num_hidden_layers,
        config.num_attention_heads,
        getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        config.vocab_size,
        getattr(config, "max_position_embeddings", 0),
        extra,
    )
