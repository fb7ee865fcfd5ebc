"""One forward step of a Llama-family decoder over a static KV cache.

The model's own modules compute every projection, norm and MLP (so LoRA adapters, 4-bit
weights and slothkit's fused norms apply as they do in training, without a merge); what
this file replaces is the part of Hugging Face's forward that cannot run inside a CUDA
graph or costs host time per token: the dynamic cache, the mask builders and the layer
wrappers.  Every tensor a step reads or writes has a fixed address, so the same step can
be captured once and replayed for each new token.

Shapes: B rows, T new tokens per row (the prompt in prefill, 1 in decode), S cache slots,
H query heads, G = H / KV query heads per key/value head, D head size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from slothkit.inference.kv_cache import StaticKVCache


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE as Hugging Face stores it: the two halves of each head are the pair
    (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _grouped_attention(q, keys, values, allowed, scaling: float) -> torch.Tensor:
    """Attention of q (B, H, T, D) over keys/values (B, KV, S, D) where ``allowed``
    (B, T, S) says which slot each query may read.  The G query heads that share a
    key/value head are stacked as G*T rows of one head, so the cache is read once
    and never repeated G times."""
    batch, heads, tokens, dim = q.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    q = q.reshape(batch, kv_heads, group * tokens, dim)
    mask = allowed[:, None].repeat(1, 1, group, 1)  # (B, 1, G*T, S): rows ordered g-major
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scaling)
    return out.reshape(batch, heads, tokens, dim)


def _mlp(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    # slothkit's fused training MLP dequantises whole 4-bit matrices per call; for a few
    # tokens the module's own forward (bitsandbytes' 4-bit GEMV, PEFT's adapters) reads less.
    forward = getattr(mlp, "_slothkit_original_forward", None) or mlp
    return forward(x)


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
        self.decoder = causal_lm.model
        config = causal_lm.config
        self.layers = list(self.decoder.layers[: config.num_hidden_layers])
        attention = self.layers[0].self_attn
        self.head_dim = attention.head_dim
        self.scaling = float(attention.scaling)
        self.window = getattr(config, "sliding_window", None)
        self.softcap = getattr(config, "final_logit_softcapping", None)
        embeddings = causal_lm.get_input_embeddings()
        base = embeddings.get_base_layer() if hasattr(embeddings, "get_base_layer") else embeddings
        scales_itself = getattr(base, "embed_scale", None) is not None
        self.embedding_scale = config.hidden_size**0.5 if embedding_scale and not scales_itself else None

    def allowed_slots(self, filled: torch.Tensor, first_slot: torch.Tensor, tokens: int) -> torch.Tensor:
        """(B, T, S) for the S slots of ``filled`` (B, S): query t (at slot first_slot + t) reads slot s when s holds a real
        token, s <= its own slot, and s is inside the sliding window; its own slot always
        (a left-padding query then reads itself and stays finite, as in Hugging Face)."""
        slots = torch.arange(filled.shape[1], device=filled.device)
        own = first_slot + torch.arange(tokens, device=filled.device)  # (T,)
        allowed = filled[:, None, :] & (slots[None, None, :] <= own[None, :, None])
        if self.window is not None:
            allowed = allowed & (slots[None, None, :] > own[None, :, None] - self.window)
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
    ) -> torch.Tensor:
        """Logits for ``input_ids`` (B, T) at RoPE ``positions`` (B, T), written into the
        cache at slots first_slot .. first_slot + T - 1 (``first_slot`` a 1-element long
        tensor, so that a captured step reads its current value).  The cache's ``filled``
        marks must already include these slots.  ``visible``: attend over the first
        ``visible`` slots only (a prefill from slot 0 reads T slots, not the whole cache).
        ``causal``: the T tokens are a prefill from slot 0 with no padding and no window
        shorter than T, so plain causal attention (the flash kernel, no mask) is exact.

        Returns:
            float32 logits (B, V) of the last token, or (B, T, V) with last_only=False.
        """
        batch, tokens = input_ids.shape
        hidden = self.decoder.embed_tokens(input_ids)
        if self.embedding_scale is not None:
            hidden = hidden * torch.tensor(self.embedding_scale, dtype=hidden.dtype)
        cos, sin = self.decoder.rotary_emb(hidden, positions)  # (B, T, D) each
        cos, sin = cos[:, None], sin[:, None]
        visible = cache.slots if visible is None else visible
        allowed = None if causal else self.allowed_slots(cache.filled[:, :visible], first_slot, tokens)
        slots = first_slot + torch.arange(tokens, device=input_ids.device)
        for index, layer in enumerate(self.layers):
            attention = layer.self_attn
            x = layer.input_layernorm(hidden)
            q = attention.q_proj(x).view(batch, tokens, -1, self.head_dim).transpose(1, 2)
            k = attention.k_proj(x).view(batch, tokens, -1, self.head_dim).transpose(1, 2)
            v = attention.v_proj(x).view(batch, tokens, -1, self.head_dim).transpose(1, 2)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            keys, values = cache.write(index, slots, k, v)
            keys, values = keys[:, :, :visible], values[:, :, :visible]
            if causal:
                out = F.scaled_dot_product_attention(
                    q, keys, values, is_causal=True, scale=self.scaling, enable_gqa=True
                )
            else:
                out = _grouped_attention(q, keys, values, allowed, self.scaling)
            out = out.transpose(1, 2).reshape(batch, tokens, -1)
            hidden = hidden + attention.o_proj(out)
            hidden = hidden + _mlp(layer.mlp, layer.post_attention_layernorm(hidden))
        if last_only:
            hidden = hidden[:, -1:]
        logits = self.causal_lm.get_output_embeddings()(self.decoder.norm(hidden)).float()
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits[:, -1] if last_only else logits
