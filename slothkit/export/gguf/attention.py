"""Attention per layer as a GGUF file states it: the rope parameters of the global and the
sliding-window layers, which layers slide, the window, and the checks that llama.cpp will
compute the attention the Hugging Face model computes.

A window on every layer (Mistral; Phi-3-mini-4k and Phi-3-medium-4k, 2047): HF's mask lets
a query at position i see keys j with i - j < window (masking_utils.sliding_window_overlay),
as llama.cpp's standard window does (llama_hparams::is_masked_swa masks p1 - p0 >= n_swa),
so attention.sliding_window holds config.sliding_window as it is. llama.cpp's graphs for
these families apply no window all the same: the llama graph reads none, and the phi3 graph
reads the key and then switches the window off (src/models/phi3.cpp, load_arch_hparams:
"Phi SWA is currently disabled", ggml-org/llama.cpp#13676). Their files match HF up to the
window's length (slothkit.export.gguf.verify keeps its prompts within it). A window at or
beyond the context (Phi-3-mini-128k: 262144) limits nothing and is not written.

transformers' configs spell the rope parameters in two ways:
    transformers 5   rope_parameters: one dict for every layer, or one per layer type,
                     {"full_attention": {...}, "sliding_attention": {...}} (Gemma 3);
                     layer_types names each layer's type
    transformers 4   rope_theta and rope_scaling (Gemma 3: the global layers'),
                     rope_local_base_freq (Gemma 3's sliding layers), sliding_window_pattern
                     (every Nth layer global) where layer_types is missing

llama.cpp's gemma3 graph (src/models/gemma3.cpp; its hyperparameters in src/llama-model.cpp),
for architectures whose record says windowed_layers:
  - rope.freq_base is the global layers' base, rope.freq_base_swa the sliding layers'
    (10,000 when absent); rope scaling applies to the global layers only (the sliding
    layers' frequency scale is fixed at 1), as in HF, whose rope_scaling is the global one;
  - attention.sliding_window_pattern, one bool per layer (true: sliding), says which layers
    slide (when absent: five sliding, then one global, repeating); attention.sliding_window
    is the window: a query at position i sees keys j with i - j < window, as in HF;
  - the query scale is fixed by the shape, 1 / sqrt(head_dim), or 1 / sqrt(hidden / heads)
    for a 62-layer model (Gemma 3 27B); no key sets it, so HF's query_pre_attn_scalar (its
    scale is 1 / sqrt(query_pre_attn_scalar)) must be that number;
  - the windowed graph applies no logit softcapping, final or in attention, and attends
    causally: a config asking for any of these is refused rather than exported wrong.
The pattern and the sliding rope base are written even where they equal llama.cpp's
defaults, so that the file states the model rather than rely on them.

llama.cpp's gemma2 graph (its hyperparameters in src/llama-model.cpp) differs where its
record's layout says so (fixed_sliding_pattern, logit_softcapping):
  - every second layer slides, the first included, whatever the file says: a model whose
    layer_types differ is refused; every layer has the one rope base, as in HF's Gemma 2;
  - it soft-caps the attention scores by attn_logit_softcapping and the output logits by
    final_logit_softcapping, both read from the file (50 and 30 when absent), always: a
    config without either is refused;
  - the query scale is 1 / sqrt(head_dim), or 1 / sqrt(hidden / heads) for a 46-layer
    model (Gemma 2 27B).
"""

from __future__ import annotations

from slothkit.models import Architecture


def rope_parameters(config) -> tuple[dict, dict | None]:
    """(the global layers' rope parameters, the sliding layers' or None when every layer
    has the same), each with "rope_type" and "rope_theta" filled in.

    Args:
        config: a transformers config, of transformers 4 or 5.
    """
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    if "full_attention" in params or "sliding_attention" in params:  # transformers 5, per layer type
        full, sliding = dict(params.get("full_attention") or {}), params.get("sliding_attention")
        sliding = dict(sliding) if sliding else None
    else:
        full, sliding = params, None
        local_base = getattr(config, "rope_local_base_freq", None)  # transformers 4's Gemma 3
        if local_base is not None:
            sliding = {"rope_type": "default", "rope_theta": local_base}
    default_theta = getattr(config, "rope_theta", None) or 10_000.0
    for p in (full, sliding):
        if p is not None:
            p["rope_type"] = p.get("rope_type", p.get("type", "default"))
            p["rope_theta"] = float(p.get("rope_theta", default_theta))
    return full, sliding


def sliding_window(config, arch: Architecture) -> int | None:
    """The window the file states (attention.sliding_window), or None.

    Args:
        config: the model's transformers config.
        arch: its record: a family whose config carries a window (sliding_window), or may
            (GGUFLayout.optional_window).
    """
    if not (arch.sliding_window or arch.gguf.optional_window):
        return None
    window = getattr(config, "sliding_window", None)
    if arch.gguf.windowed_layers:
        return window  # required there (check_windowed_attention)
    if not window or window >= config.max_position_embeddings:
        return None  # limits nothing within the context
    return int(window)


def ignored_window(config, arch: Architecture) -> int | None:
    """The window HF applies to every layer and llama.cpp's graph does not, or None: the
    length up to which the file and the model agree (see the module docstring)."""
    return None if arch.gguf.windowed_layers else sliding_window(config, arch)


def sliding_layers(config) -> tuple[bool, ...]:
    """Per layer, whether it attends within the sliding window (True) or globally.

    Args:
        config: a transformers config with layer_types, or transformers 4's
            sliding_window_pattern (every Nth layer global).
    """
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        pattern = getattr(config, "sliding_window_pattern", None) or getattr(
            config, "_sliding_window_pattern", 6
        )
        return tuple(bool((i + 1) % pattern) for i in range(config.num_hidden_layers))
    unknown = sorted(set(layer_types) - {"sliding_attention", "full_attention"})
    if unknown:
        raise ValueError(
            f"GGUF export knows the layer types 'sliding_attention' and 'full_attention'; this model has {unknown}"
        )
    return tuple(kind == "sliding_attention" for kind in layer_types)


def check_windowed_attention(config, arch: Architecture, head_dim: int, sliding_rope: dict | None) -> None:
    """Refuse a model whose attention llama.cpp's windowed graph would not reproduce (see the
    module docstring).

    Args:
        config: the model's transformers config.
        arch: its record; its GGUF arch names llama.cpp's graph in the messages.
        head_dim: the width of one attention head.
        sliding_rope: the sliding layers' rope parameters (rope_parameters), or None.
    """
    graph = f"llama.cpp's {arch.gguf.arch!r} graph"
    if not getattr(config, "sliding_window", None):
        raise ValueError(f"{graph} needs the sliding window size; this config has sliding_window=None")
    if sliding_rope is not None and sliding_rope["rope_type"] != "default":
        raise NotImplementedError(
            f"{graph} scales rope on the global layers only; this model's sliding layers use "
            f"rope type {sliding_rope['rope_type']!r} (accepted: 'default')"
        )
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        cap = getattr(config, key, None)
        if cap and not arch.gguf.logit_softcapping:
            raise NotImplementedError(f"{graph} applies no {key}; this model sets it to {cap}")
        if not cap and arch.gguf.logit_softcapping:
            raise NotImplementedError(f"{graph} always applies {key}; this model sets it to {cap}")
    if getattr(config, "use_bidirectional_attention", False):
        raise NotImplementedError(f"{graph} attends causally; this model sets use_bidirectional_attention")
    pattern = arch.gguf.fixed_sliding_pattern
    if pattern is not None:
        fixed = tuple(i % pattern < pattern - 1 for i in range(config.num_hidden_layers))
        if sliding_layers(config) != fixed:
            raise NotImplementedError(
                f"{graph} slides on the layers i with i % {pattern} != {pattern - 1} and reads no per-layer "
                f"pattern; this model's sliding layers are {list(sliding_layers(config))}"
            )
    scalar = getattr(config, "query_pre_attn_scalar", None)
    expected = head_dim
    layers_27b = arch.gguf.query_scale_hidden_layers
    if config.num_hidden_layers == layers_27b:
        expected = config.hidden_size // config.num_attention_heads
    if scalar is not None and scalar != expected:
        raise NotImplementedError(
            f"{graph} scales queries by 1/sqrt({expected}) for this shape (its head_dim, or hidden / heads "
            f"at {layers_27b} layers) and reads no setting for it; this model's "
            f"query_pre_attn_scalar is {scalar}"
        )
