"""One forward step of a decoder (Llama's layer, Gemma 2/3's sandwich layer, or Qwen3.5's
gated DeltaNet and gated attention layers) over a static KV cache.

The model's own modules compute the norms and the base projections (16-bit or 4-bit
weights, read where they are); the LoRA adapters are applied without a merge by
``SharedInputProjections``, a few launches per group of projections that read the same
input.  What this file replaces is the part of Hugging Face's forward that cannot run
inside a CUDA graph or costs host time per token: the dynamic cache, the mask builders
and the layer wrappers.  Every tensor a step reads or writes has a fixed address, so the same step can
be captured once and replayed for each new token.

Shapes: B rows, T new tokens per row (the prompt in prefill, 1 in decode), S cache slots,
H query heads, G = H / KV query heads per key/value head, D head size.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch import nn

from slothkit.core.inspection import attention_window, language_model_of
from slothkit.core.model_state import patched_module
from slothkit.inference.decode_deltanet import DecodeDeltaNet, DeltaNetStates, linear_attention_of
from slothkit.inference.decode_experts import DecodeExperts, is_expert_block
from slothkit.inference.decode_projections import SharedInputProjections
from slothkit.inference.kv_cache import StaticKVCache
from slothkit.memory.sizes import mlp_token_chunk
from slothkit.models.shape import OUTPUT_GATE_TYPES
from slothkit_kernels import attention, geglu, rope, rope_into_cache, swiglu


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE as Hugging Face stores it: the two halves of each head are the pair
    (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin).  Tables narrower than the head
    (Qwen3.5's partial rotary) turn its first features so and pass the rest."""
    width = cos.shape[-1]
    if width < x.shape[-1]:
        return torch.cat((_rotate(x[..., :width], cos, sin), x[..., width:]), dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _rotate_pair(q, k, cos, sin):
    """RoPE on q (B, H, T, D) and k, in place where a GPU runs slothkit's kernel (one
    launch for both, computed in fp32 as in training), else as Hugging Face computes it."""
    if q.is_cuda and cos.shape[-1] == q.shape[-1]:
        return rope(q, k, cos, sin)
    return _rotate(q, cos[:, None], sin[:, None]), _rotate(k, cos[:, None], sin[:, None])


def _fused_rope_and_cache_write(q: torch.Tensor) -> bool:
    """Whether RoPE and the cache write run as one launch of slothkit's kernel: where a
    GPU runs it.  Elsewhere q and k are rotated as Hugging Face rotates them."""
    return q.is_cuda


def _rope_and_cache(q, k, v, cos, sin, cache: StaticKVCache, layer: int, slots: torch.Tensor, stored):
    """q rotated, and k rotated and v written into ``layer``'s cache for the tokens at
    ``slots``, which the layer keeps at ``stored`` (the same slots, or their places in
    its ring); returns (q, the keys and values to attend over).  Those are the layer's
    whole cache, except in a prefill longer than the layer's ring, which keeps only the
    prompt's last W tokens: attention then reads the prompt's own keys and values.  On a
    GPU one launch (rope_into_cache) where rope and two index_copy_ launches would be
    three."""
    keys, values = cache.keys[layer], cache.values[layer]
    fits = keys.shape[2] >= slots.shape[0]
    whole_head = cos.shape[-1] == q.shape[-1]  # the kernel turns whole heads (not Qwen3.5's quarter)
    if _fused_rope_and_cache_write(q) and whole_head and keys.dtype == q.dtype and fits:
        return rope_into_cache(q, k, v, cos, sin, keys, values, stored), keys, values
    q, k = _rotate_pair(q, k, cos, sin)
    keys, values = cache.write(layer, slots, k, v)
    return (q, keys, values) if fits else (q, k, v)


def _tiled_prefill_attention(q: torch.Tensor) -> bool:
    """Whether a prefill layer that plain causal SDPA cannot serve (a sliding window
    shorter than the prompt, soft-capped scores) runs slothkit's tiled attention kernel,
    which applies the window and the cap inside its tiles: where a GPU runs it.  The other
    way builds a (T, S) mask per query head group and, with a cap, the whole score matrix
    in fp32, which a long prompt cannot afford (Gemma 2 9B at 8,192 tokens: 4 GiB of fp32
    scores a row, 64 GiB at 32,768).  A padded prompt's capped layers run it too, with the
    padding as a (B, 1, T, S) mask (fp32 inside the kernel: 256 MiB a row at 8,192)."""
    return q.is_cuda


def _additive_mask(allowed: torch.Tensor, group: int, dtype: torch.dtype) -> torch.Tensor:
    """``allowed`` (B, T, S) as an additive mask, built once per step and read by every
    layer (a boolean mask would be converted inside each attention call): for a one-token
    step (B, 1, G, S), its row for each of the G query heads that share a key/value head
    (_grouped_attention stacks them as the rows of one call); for a prompt (B, 1, T, S),
    which each of the G heads reads in turn, so that a long padded prompt's mask is the
    size of Hugging Face's (B, 1, T, S) one (G x T x S entries per row of the batch would
    be 32 GiB in bf16 for four padded 32K-token prompts of Llama-3-8B, G = 4; this is 8)."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    mask = mask.masked_fill(~allowed, float("-inf"))
    if allowed.shape[1] == 1:
        return mask[:, None].repeat(1, 1, group, 1)
    return mask[:, None]


def _attend(q, keys, values, mask, scaling: float, softcap: float | None, sinks=None) -> torch.Tensor:
    """Attention of q (B, KV, R, D) over keys/values (B, KV, S, D) under the additive
    ``mask`` (broadcast to (B, KV, R, S)).

    ``softcap`` (Gemma 2's attention-logit soft-capping, which SDPA cannot do): the scores
    s = q k^T * scaling become softcap * tanh(s / softcap) before the mask and softmax.
    ``sinks`` (gpt-oss's per-head sink logits, which SDPA cannot take either), broadcast
    to (B, KV, R, 1): one more column of every row's scores, in the softmax's denominator
    and dropped after it (it has no value), as transformers' eager attention computes it."""
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scaling)
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scaling  # (B, KV, R, S)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.float() + mask
    if sinks is None:
        return torch.matmul(torch.softmax(scores, dim=-1).to(values.dtype), values)
    column = sinks.float().expand(*scores.shape[:-1], 1)
    weights = torch.softmax(torch.cat((scores, column), dim=-1), dim=-1)[..., :-1]
    return torch.matmul(weights.to(values.dtype), values)


def _grouped_attention(
    q, keys, values, mask, scaling: float, softcap: float | None = None, sinks: torch.Tensor | None = None
) -> torch.Tensor:
    """Attention of q (B, H, T, D) over keys/values (B, KV, S, D), never repeating the
    cache G times for the G query heads that share a key/value head: a one-token step
    stacks them as the G rows of one call under the mask (B, 1, G, S); a prompt attends
    with each of them in turn under the mask (B, 1, T, S) (_additive_mask).  ``sinks``:
    (H,) sink logits, query head h = kv * G + g, or None."""
    batch, heads, tokens, dim = q.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    by_head = None if sinks is None else sinks.view(kv_heads, group)
    if mask.shape[-2] == group * tokens:
        # Row g * T + t of key/value head kv is query head kv * G + g's token t.
        rows = None if by_head is None else by_head.repeat_interleave(tokens, dim=1)[None, :, :, None]
        out = _attend(
            q.reshape(batch, kv_heads, group * tokens, dim), keys, values, mask, scaling, softcap, rows
        )
        return out.reshape(batch, heads, tokens, dim)
    by_group = q.reshape(batch, kv_heads, group, tokens, dim)
    out = torch.empty_like(by_group)
    for head in range(group):
        rows = None if by_head is None else by_head[None, :, head, None, None]
        out[:, :, head] = _attend(by_group[:, :, head], keys, values, mask, scaling, softcap, rows)
    return out.view(batch, heads, tokens, dim)


class _DecodeMLP:
    """The gated MLP down(act(gate(x)) * up(x)) with gate and up as one
    SharedInputProjections, and the activation in one launch on a GPU (slothkit's
    kernel, where the model is on the fused path).

    A long prompt's prefill runs it in chunks of tokens, as training's long steps do
    (slothkit.memory.sizes.mlp_token_chunk): the (tokens, intermediate) tensors, gate, up
    and their product, are most of a prefill's working memory (Llama-3-8B at 131,072
    tokens: 3.5 GiB each), and the MLP treats each token on its own."""

    def __init__(self, mlp: nn.Module, dtype: torch.dtype):
        self.mlp = mlp
        # Phi-3 computes gate and up as one gate_up_proj (gate's rows first) and calls its
        # activation activation_fn.
        self.fused_gate_up = hasattr(mlp, "gate_up_proj")
        self.act_fn = getattr(mlp, "act_fn", None) or getattr(mlp, "activation_fn", None)
        separate = all(hasattr(mlp, name) for name in ("gate_proj", "up_proj"))
        self.gated = (
            (self.fused_gate_up or separate) and hasattr(mlp, "down_proj") and self.act_fn is not None
        )
        if self.gated:
            gate_up = [mlp.gate_up_proj] if self.fused_gate_up else [mlp.gate_proj, mlp.up_proj]
            self.gate_up = SharedInputProjections(gate_up, dtype)
            self.down = SharedInputProjections([mlp.down_proj], dtype)
        record = patched_module(mlp)
        self.activation = record.activation if record is not None else None
        # slothkit's fused training MLP dequantises whole 4-bit matrices per call; for a
        # few tokens the module's own forward reads less.
        self.own_forward = record.original_forward if record is not None else mlp

    def refresh(self) -> None:
        if self.gated:
            self.gate_up.refresh()
            self.down.refresh()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.shape[:-1].numel()
        chunk = mlp_token_chunk(tokens)
        if chunk is None:
            return self._mlp(x)
        rows = x.reshape(tokens, x.shape[-1])
        out = None
        for start in range(0, tokens, chunk):
            part = self._mlp(rows[start : start + chunk])
            if out is None:
                out = part.new_empty(tokens, part.shape[-1])
            out[start : start + chunk] = part
        return out.view(*x.shape[:-1], out.shape[-1])

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        if not self.gated:
            return self.own_forward(x)
        gate, up = self.gate_up(x)[0].chunk(2, dim=-1) if self.fused_gate_up else self.gate_up(x)
        if self.activation == "swiglu" and x.is_cuda:
            hidden = swiglu(gate, up)
        elif self.activation in ("geglu_tanh", "geglu") and x.is_cuda:
            hidden = geglu(gate, up, "tanh" if self.activation == "geglu_tanh" else "none")
        else:
            hidden = self.act_fn(gate) * up
        return self.down(hidden)[0]


def longrope_short_positions(config) -> int | None:
    """How many positions a longrope model (Phi-3.5, the 128k Phi-3s) rotates with its
    short factors; None for other rope types.  Past them transformers switches every
    position's tables to the long factors and its generate re-runs the prompt, a step the
    fast loop lacks: it takes only calls that stay within them."""
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type") != "longrope":
        return None
    # The rope parameters hold the switch point; Phi-3's config, its generate's re-run point.
    limits = [
        rope.get("original_max_position_embeddings"),
        getattr(config, "original_max_position_embeddings", None),
    ]
    return min(limit for limit in limits if limit) if any(limits) else 0


def layer_windows(causal_lm: nn.Module) -> list[int | None]:
    """Each attention layer's sliding window (None: full attention), in layer order; a
    gated DeltaNet layer (decode_deltanet.py) keeps no keys and has none."""
    layers = language_model_of(causal_lm).layers[: causal_lm.config.get_text_config().num_hidden_layers]
    return [attention_window(layer.self_attn) for layer in layers if linear_attention_of(layer) is None]


class _DecodeLayer:
    """One decoder layer's projections, grouped by shared input; its q/k norms where the
    attention has them (Qwen3, Gemma 3: RMSNorm over each head before RoPE); its window,
    rotary table (by layer type: Gemma 3's sliding and global layers have their own rope
    bases) and attention-logit softcap (Gemma 2); its output gate (Qwen3.5); in a sandwich
    layer (Gemma 2 and 3), the norms after attention and around the MLP; or, in place of
    the attention, a gated DeltaNet layer (decode_deltanet.py)."""

    def __init__(self, layer: nn.Module, dtype: torch.dtype, linear_index: int | None = None):
        sandwich = all(hasattr(layer, n) for n in ("pre_feedforward_layernorm", "post_feedforward_layernorm"))
        #   h = x + post_attention_norm(attn(input_norm(x)));  y = h + post_mlp_norm(mlp(mlp_norm(h)))
        # (a Llama layer: y = h + mlp(post_attention_layernorm(h)), h = x + attn(input_norm(x)))
        self.attention_out_norm = layer.post_attention_layernorm if sandwich else None
        self.mlp_norm = layer.pre_feedforward_layernorm if sandwich else layer.post_attention_layernorm
        self.mlp_out_norm = layer.post_feedforward_layernorm if sandwich else None
        # A mixture-of-experts block reads its tokens' chosen experts only (decode_experts.py).
        self.mlp = (
            DecodeExperts(layer.mlp, dtype) if is_expert_block(layer.mlp) else _DecodeMLP(layer.mlp, dtype)
        )
        # A gated DeltaNet layer (Qwen3.5's linear attention) mixes tokens through its
        # recurrent state, the ``linear_index``-th of the step's DeltaNetStates.
        linear = linear_attention_of(layer)
        self.linear_attention = None if linear is None else DecodeDeltaNet(linear, dtype, linear_index)
        self.layer_type = None
        if linear is not None:
            return
        attention = layer.self_attn
        # Read off the modules, not the patch record: a model loaded with fused=False
        # decodes through here too.
        has_qk_norm = hasattr(attention, "q_norm") and hasattr(attention, "k_norm")
        self.qk_norm = (attention.q_norm, attention.k_norm) if has_qk_norm else None
        self.window = attention_window(attention)
        self.layer_type = getattr(attention, "layer_type", None)
        self.softcap = getattr(attention, "attn_logit_softcapping", None)
        self.sinks = getattr(attention, "sinks", None)  # gpt-oss: (H,) logits, one per query head
        self.scaling = float(attention.scaling)
        # Qwen3.5's gated attention: q_proj writes each head's query and then as wide a
        # gate; the attention's output is multiplied by sigmoid(gate) before o_proj.
        self.output_gate = (
            getattr(getattr(attention, "config", None), "model_type", None) in OUTPUT_GATE_TYPES
        )
        if hasattr(attention, "qkv_proj"):  # Phi-3: one layer, q's rows, then k's, then v's
            config = attention.config
            kv = config.num_key_value_heads * attention.head_dim
            self.qkv_split = (config.num_attention_heads * attention.head_dim, kv, kv)
            self.qkv = SharedInputProjections([attention.qkv_proj], dtype)
        else:
            self.qkv_split = None
            self.qkv = SharedInputProjections([attention.q_proj, attention.k_proj, attention.v_proj], dtype)
        self.o = SharedInputProjections([attention.o_proj], dtype)

    def project_qkv(self, x: torch.Tensor) -> tuple:
        """q, k and v of ``x``, (B, T, heads * D) each."""
        if self.qkv_split is None:
            return self.qkv(x)
        return self.qkv(x)[0].split(self.qkv_split, dim=-1)

    def refresh(self) -> None:
        self.mlp.refresh()
        if self.linear_attention is not None:
            self.linear_attention.refresh()
        else:
            self.qkv.refresh()
            self.o.refresh()


class _StepAttention:
    """How the layers of one step attend, and the masks they share (each built at its
    first use, by window or ring width, and read by every layer with the same one).

    A one-token step reads a ring whole under the ring's own marks; the other layers read
    the first ``visible`` slots.  An unpadded prefill (``causal``) needs no mask: plain
    causal SDPA (the flash kernel) where no cap or window shorter than the prompt applies,
    else slothkit's tiled kernel on a GPU; a padded prefill's capped layers take that
    kernel too, with the padding as its mask; everything else attends under an additive
    mask (the scores made explicitly where a cap applies).  ``both_ways`` (B, T, T): pairs
    of prompt tokens that read each other whatever their order (Gemma 3's image tokens,
    image_prompt.py); the tiled kernel, causal by construction, is then not used."""

    def __init__(
        self,
        step,
        cache: StaticKVCache,
        first_slot,
        tokens: int,
        visible: int,
        causal: bool,
        dtype,
        both_ways: torch.Tensor | None = None,
    ):
        self.step, self.cache, self.first_slot = step, cache, first_slot
        self.tokens, self.visible, self.causal, self.dtype = tokens, visible, causal, dtype
        self.both_ways = both_ways
        self.masks = {}

    def _allowed(self, window: int | None) -> torch.Tensor:
        """(B, T, visible) slots each query may read, within ``window``."""
        filled = self.cache.filled[:, : self.visible]
        return self.step.allowed_slots(filled, self.first_slot, self.tokens, window, self.both_ways)

    def _mask(self, key, build):
        if key not in self.masks:
            self.masks[key] = build()
        return self.masks[key]

    def __call__(self, q, keys, values, projections: _DecodeLayer, ring: int | None) -> torch.Tensor:
        """q (B, H, T, D) over ``keys`` / ``values`` (a ring of width ``ring``, or the
        first ``visible`` slots); returns (B, H, T, D)."""
        window, softcap, scaling = projections.window, projections.softcap, projections.scaling
        sinks = projections.sinks
        plain = (
            ring is None and softcap is None and sinks is None and (window is None or window >= self.tokens)
        )
        if self.causal and plain:
            return F.scaled_dot_product_attention(
                q, keys, values, is_causal=True, scale=scaling, enable_gqa=True
            )
        beyond_sdpa = softcap is not None or sinks is not None
        tiled = self.tokens > 1 and (self.causal or beyond_sdpa) and self.both_ways is None
        if tiled and _tiled_prefill_attention(q):
            padding = None
            if not self.causal:  # (B, 1, T, S) booleans, not H times as many fp32 scores
                padding = self._mask(("padding", window), lambda: self._allowed(window)[:, None])
            return attention(q, keys, values, scaling, padding, softcap, window, sinks).transpose(1, 2)
        group = q.shape[1] // keys.shape[1]  # per layer: Gemma 4's full layers have their own
        if ring is None:
            mask = self._mask(
                (window, group), lambda: _additive_mask(self._allowed(window), group, self.dtype)
            )
        else:
            marks = self.cache.ring_filled[ring][:, None, :]
            mask = self._mask(("ring", ring, group), lambda: _additive_mask(marks, group, self.dtype))
        return _grouped_attention(q, keys, values, mask, scaling, softcap, sinks)


def _whole_head_tables(tables: tuple, head_dim: int) -> tuple:
    """(cos, sin) over a whole head.  gpt-oss's rotary returns D/2 columns, one per pair,
    and rotates head halves (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin): the same as
    the rotation of the other families with each table written twice, [cos, cos], which
    slothkit's RoPE kernels read."""
    cos, sin = tables
    if cos.shape[-1] * 2 != head_dim:
        return tables
    return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)


class ModelStep:
    """The decoder of one loaded causal LM, run token by token against a StaticKVCache.

    Args:
        causal_lm: the transformers *ForCausalLM (inside a PeftModel its modules carry the
            adapters); read, never changed.
        embedding_scale: multiply the token embeddings by sqrt(hidden size) (Gemma), where
            the embedding module does not do it itself.
    """

    def __init__(self, causal_lm: nn.Module, embedding_scale: bool = False):
        self.causal_lm = causal_lm
        # An image-text model's language model (its text config) is the decoder stepped.
        self.decoder = language_model_of(causal_lm)
        self.config = config = causal_lm.config.get_text_config()
        self.layers = list(self.decoder.layers[: config.num_hidden_layers])
        # Gated DeltaNet layers (Qwen3.5) keep a recurrent state (DeltaNetStates), not keys
        # and values: the cache holds the attention layers only, cache_layers[i] being
        # layer i's place in it (None for a DeltaNet layer).
        self.deltanet_modules = [m for m in map(linear_attention_of, self.layers) if m is not None]
        attention_layers = [layer for layer in self.layers if linear_attention_of(layer) is None]
        places = iter(range(len(attention_layers)))
        self.cache_layers = [None if linear_attention_of(layer) else next(places) for layer in self.layers]
        self.head_dim = attention_layers[0].self_attn.head_dim
        self.windows = layer_windows(causal_lm)  # per attention layer; the cache keeps rings by them
        # Tables narrower than the head (Qwen3.5's partial rotary) turn part of each head.
        rope = getattr(config, "rope_parameters", None) or {}
        self.partial_rotary = (
            rope.get("partial_rotary_factor") or getattr(config, "partial_rotary_factor", None) or 1.0
        ) < 1
        # M-RoPE (Qwen2.5-VL's and Qwen3.5's rotary modules, which carry mrope_section,
        # defaulted when the config has none): positions (3, B, T), one row per section;
        # some transformers releases (5.17) index them as such, so a text position p is
        # written (p, p, p), which the module turns as plain RoPE.
        self.mrope = getattr(self.decoder.rotary_emb, "mrope_section", None) is not None
        self.softcap = getattr(config, "final_logit_softcapping", None)
        # transformers gives each layer type its own rope base through one rotary module
        # called with the layer's type (Gemma 3), or one table for all layers.
        self.rotary_by_layer_type = (
            "layer_type" in inspect.signature(self.decoder.rotary_emb.forward).parameters
        )
        self.short_factors_only = longrope_short_positions(config) is not None
        embeddings = causal_lm.get_input_embeddings()
        base = embeddings.get_base_layer() if hasattr(embeddings, "get_base_layer") else embeddings
        scales_itself = getattr(base, "embed_scale", None) is not None
        self.embedding_scale = config.hidden_size**0.5 if embedding_scale and not scales_itself else None
        self.dtype = base.weight.dtype
        self.build_projections()

    @staticmethod
    def cannot_decode(config) -> str | None:
        """Why this step cannot decode a model of ``config`` (a family step says), or None."""
        return None

    def cache_layout(self) -> tuple[list[int | None], list[int], list[int]]:
        """The StaticKVCache this step reads: each cache layer's sliding window, key/value
        heads and head size (here one cache layer per attention layer, all alike; a gated
        DeltaNet layer keeps its recurrent state instead, new_linear_states)."""
        config = self.config
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        layers = len(self.windows)
        return self.windows, [kv_heads] * layers, [self.head_dim] * layers

    def build_projections(self) -> None:
        """Describe every layer's projections afresh (after adapters were added, switched,
        merged or disabled)."""
        linear_places = iter(range(len(self.deltanet_modules)))
        self.decode_layers = [
            _DecodeLayer(layer, self.dtype, next(linear_places) if linear_attention_of(layer) else None)
            for layer in self.layers
        ]

    def new_linear_states(self, batch: int, device) -> DeltaNetStates | None:
        """Zeroed states of the gated DeltaNet layers for ``batch`` rows (None: it has none)."""
        if not self.deltanet_modules:
            return None
        return DeltaNetStates(self.deltanet_modules, batch, self.dtype, device)

    def refresh(self) -> None:
        """Bring the adapter copies up to date with adapters trained in place."""
        for decode_layer in self.decode_layers:
            decode_layer.refresh()

    def _short_factor_tables(self, hidden: torch.Tensor, positions: torch.Tensor):
        """A longrope model's (cos, sin) with its short factors, which every call the fast
        loop takes stays within.  transformers picks the factors in a wrapper around the
        rotary forward that, in some versions, reads the longest position back to the host
        (which a captured step cannot do); the forward under it computes the tables from
        ``inv_freq``, set here to the short factors (``original_inv_freq``)."""
        rotary = self.decoder.rotary_emb
        rotary.inv_freq.copy_(rotary.original_inv_freq)
        forward = type(rotary).forward
        return getattr(forward, "__wrapped__", forward)(rotary, hidden, positions)

    @staticmethod
    def allowed_slots(
        filled: torch.Tensor,
        first_slot: torch.Tensor,
        tokens: int,
        window: int | None,
        both_ways: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """(B, T, S) for the S slots of ``filled`` (B, S): query t (at slot first_slot + t) reads slot s when s holds a real
        token, s <= its own slot or (t, s) is a ``both_ways`` pair (a prefill from slot 0,
        S = T), and s is inside the sliding ``window``; its own slot always (a left-padding
        query then reads itself and stays finite, as in Hugging Face)."""
        slots = torch.arange(filled.shape[1], device=filled.device)
        own = first_slot + torch.arange(tokens, device=filled.device)  # (T,)
        earlier = slots[None, None, :] <= own[None, :, None]
        if both_ways is not None:
            earlier = earlier | both_ways
        allowed = filled[:, None, :] & earlier
        if window is not None:
            allowed = allowed & (slots[None, None, :] > own[None, :, None] - window)
        return allowed | (slots[None, None, :] == own[None, :, None])

    @torch.no_grad()
    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: StaticKVCache,
        first_slot: torch.Tensor,
        last_only: bool = True,
        visible: int | None = None,
        causal: bool = False,
        inputs_embeds: torch.Tensor | None = None,
        both_ways: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits for ``input_ids`` (B, T) at RoPE ``positions`` (B, T), written into the
        cache at slots first_slot .. first_slot + T - 1 (``first_slot`` a 1-element long
        tensor, so that a captured step reads its current value).  The cache's ``filled``
        marks must already include these slots.  ``visible``: attend over the first
        ``visible`` slots only (a prefill from slot 0 reads T slots, not the whole cache).
        ``causal``: the T tokens are a prefill from slot 0 with no padding, so attention
        needs no mask: plain causal SDPA (the flash kernel) in layers without a cap or a
        window shorter than T, slothkit's tiled kernel in the others where a GPU runs it.
        ``inputs_embeds`` (B, T, hidden): the layers' input in place of the tokens'
        embeddings (an image prompt's, with the image features merged: image_prompt.py);
        ``positions`` may then be (3, B, T), M-RoPE's, which the model's rotary module
        composes.  ``both_ways``: (B, T, T) pairs of prompt tokens that read each other
        whatever their order (_StepAttention).

        Returns:
            float32 logits (B, V) of the last token, or (B, T, V) with last_only=False.
        """
        batch, tokens = input_ids.shape
        if inputs_embeds is not None:
            hidden = inputs_embeds
        else:
            hidden = self.decoder.embed_tokens(input_ids)
            if self.embedding_scale is not None:
                hidden = hidden * torch.tensor(self.embedding_scale, dtype=hidden.dtype)
        if self.mrope and positions.dim() == 2:
            positions = positions.expand(3, -1, -1)
        if self.short_factors_only:
            tables = dict.fromkeys(
                {p.layer_type for p in self.decode_layers}, self._short_factor_tables(hidden, positions)
            )
        elif self.rotary_by_layer_type:
            layer_types = {projections.layer_type for projections in self.decode_layers}
            tables = {kind: self.decoder.rotary_emb(hidden, positions, kind) for kind in layer_types}
        else:
            tables = dict.fromkeys(
                {p.layer_type for p in self.decode_layers}, self.decoder.rotary_emb(hidden, positions)
            )
        if not self.partial_rotary:
            tables = {kind: _whole_head_tables(pair, self.head_dim) for kind, pair in tables.items()}
        visible = cache.slots if visible is None else visible
        ring_step = tokens == 1  # a one-token step reads each ring whole (_StepAttention)
        attend = _StepAttention(self, cache, first_slot, tokens, visible, causal, hidden.dtype, both_ways)
        slots = first_slot + torch.arange(tokens, device=input_ids.device)
        # Where each layer keeps these tokens: computed once per ring width, not per layer.
        stored = {ring: slots if ring is None else slots % ring for ring in set(cache.rings)}
        # A DeltaNet layer zeroes padded positions (a one-token step is never padding).
        real = None if tokens == 1 or causal else cache.filled.index_select(1, slots)
        for layer, projections, index in zip(self.layers, self.decode_layers, self.cache_layers):
            if projections.linear_attention is not None:
                out = projections.linear_attention(layer.input_layernorm(hidden), cache.linear_states, real)
                hidden = hidden + out
                out = projections.mlp(projections.mlp_norm(hidden))
                hidden = hidden + out
                continue
            cos, sin = tables[projections.layer_type]  # (B, T, D) each
            q, k, v = projections.project_qkv(layer.input_layernorm(hidden))
            gate = None
            if projections.output_gate:  # each head's query, then its gate
                q, gate = q.view(batch, tokens, -1, 2 * self.head_dim).chunk(2, dim=-1)
                gate = gate.reshape(batch, tokens, -1)
            q = q.reshape(batch, tokens, -1, self.head_dim)
            k = k.view(batch, tokens, -1, self.head_dim)
            if projections.qk_norm is not None:
                q_norm, k_norm = projections.qk_norm
                q, k = q_norm(q), k_norm(k)
            q, k = q.transpose(1, 2), k.transpose(1, 2)
            v = v.view(batch, tokens, -1, self.head_dim).transpose(1, 2)
            q, keys, values = _rope_and_cache(
                q, k, v, cos, sin, cache, index, slots, stored[cache.rings[index]]
            )
            ring = cache.rings[index] if ring_step else None
            if ring is None:
                keys, values = keys[:, :, :visible], values[:, :, :visible]
            out = attend(q, keys, values, projections, ring)
            out = out.transpose(1, 2).reshape(batch, tokens, -1)
            if gate is not None:
                out = out * torch.sigmoid(gate)
            out = projections.o(out)[0]
            if projections.attention_out_norm is not None:
                out = projections.attention_out_norm(out)
            hidden = hidden + out
            out = projections.mlp(projections.mlp_norm(hidden))
            if projections.mlp_out_norm is not None:
                out = projections.mlp_out_norm(out)
            hidden = hidden + out
        if last_only:
            hidden = hidden[:, -1:]
        logits = self.causal_lm.get_output_embeddings()(self.decoder.norm(hidden)).float()
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits[:, -1] if last_only else logits
