"""One forward step of Gemma 4's text decoder (transformers' ``gemma4_text``) over a static KV cache.

What Gemma 4 adds to the sandwich layer of Gemma 2 and 3 that ModelStep runs:

- Per-layer input embeddings (E2B, E4B).  A second table of L x P columns per token and a
  projection of the token embedding e give every layer l its own P-wide input

      p_l = (rmsnorm(e W_proj / sqrt(hidden))_l + embed_per_layer(token)_l) / sqrt(2)

  computed once per step (transformers' get_per_layer_inputs and project_per_layer_inputs);
  after its MLP each layer adds  rmsnorm(W_up (act(W_gate h) * p_l))  to its residual.
- Key/value sharing.  The last ``num_kv_shared_layers`` layers compute queries only and
  attend over the keys and values of the last earlier layer of their own type (sliding or
  full), as that layer attended over them in the same step.  They hold no cache: E4B's 18
  sharing layers of 42 make its cache 24/42 of a per-layer one.  A prefill that wants the
  last token's logits only runs those layers on that token alone, as transformers does:
  nothing after them reads the other tokens.
- Per-layer shapes.  Full layers have wider heads (global_head_dim) and may have their own
  key/value head count; with ``attention_k_eq_v`` they have no v_proj and their values are
  the keys' projection before k_norm and RoPE.  Values are RMS-normed without a scale
  (v_norm); attention scores are not scaled (scaling 1, the q/k norms set the size).
  Full layers rotate with "proportional" RoPE, whose tables are a whole head wide with
  their unrotated pairs at angle 0, so one RoPE serves both types.
- A scalar per layer multiplies its output (layer_scalar).
- 26B-A4B: beside the dense MLP, a mixture-of-experts block reads the residual before the
  MLP: its router chooses experts from it, and the experts read its own pre-norm of it;
  the two outputs, each normed, are summed before post_feedforward_layernorm.  The chosen
  experts, with their GELU-tanh gate, run through decode_experts.py.

Shapes as in model_step.py: B rows, T new tokens, S cache slots, H query heads, D head size
(the layer's), P the per-layer input width, L layers.
"""

from __future__ import annotations

import torch
from torch import nn

from slothkit.core.inspection import attention_window
from slothkit.core.notices import FallbackWarning, say_once
from slothkit.engine.experts import ExpertsCall, describe_experts
from slothkit.inference.decode_experts import GATHER_ROWS, chosen_experts, expert_adapters
from slothkit.inference.decode_projections import SharedInputProjections
from slothkit.inference.kv_cache import StaticKVCache
from slothkit.inference.model_step import (
    ModelStep,
    _DecodeMLP,
    _rope_and_cache,
    _rotate,
    _StepAttention,
)


class _ExpertBlock:
    """26B-A4B's mixture-of-experts block as a step runs it: transformers' router on the
    residual, the chosen experts (decode_experts.chosen_experts) on its own pre-norm of
    it, then its post-norm.  A prefill of more than GATHER_ROWS tokens runs the experts
    module's forward (the fused experts where the model has them); experts the gathered
    path does not describe (an activation other than the fused experts' gates, several
    active adapters) run the module's own forward, said once."""

    def __init__(self, layer: nn.Module, dtype: torch.dtype):
        self.router, self.experts = layer.router, layer.experts
        self.norm_in, self.norm_out = layer.pre_feedforward_layernorm_2, layer.post_feedforward_layernorm_2
        with torch.no_grad():  # the experts' base weights are frozen; adapters read as views
            self.call = describe_experts(layer.experts)
        gathered = isinstance(self.call, ExpertsCall)
        self.adapters = expert_adapters(self.call, dtype) if gathered else (None, None)
        if not gathered:
            say_once(
                f"slothkit: a decode step runs this mixture-of-experts block's own experts "
                f"forward, which reads every expert hit: {self.call}",
                FallbackWarning,
            )

    def refresh(self) -> None:
        for adapter in self.adapters:
            if adapter is not None:
                adapter.refresh()

    def __call__(self, residual: torch.Tensor) -> torch.Tensor:
        rows = residual.reshape(-1, residual.shape[-1])  # (B T, hidden)
        _, weights, ids = self.router(rows)  # (B T, k) each
        x = self.norm_in(rows)
        if isinstance(self.call, str) or rows.shape[0] > GATHER_ROWS:
            out = self.experts(x, ids, weights)
        else:
            out = chosen_experts(self.call, self.adapters, x, weights, ids)
        return self.norm_out(out.view(residual.shape))


class _Gemma4Layer:
    """One Gemma 4 decoder layer's projections (grouped by shared input), norms and
    attention settings; ``cache_layer`` is where its keys and values live in the cache,
    None for a layer that reuses another's."""

    def __init__(self, layer: nn.Module, dtype: torch.dtype, cache_layer: int | None):
        attention = layer.self_attn
        self.layer = layer
        self.cache_layer = cache_layer
        self.layer_type = attention.layer_type
        self.window = attention_window(attention)
        self.head_dim = attention.head_dim
        self.scaling = float(attention.scaling)
        self.softcap = self.sinks = None  # what _StepAttention reads besides the window
        # The last producing layer of its type: the layers that reuse keys and values read its.
        self.stores = bool(attention.store_full_length_kv)
        self.q_norm = attention.q_norm
        projections = [attention.q_proj]
        if cache_layer is not None:
            projections.append(attention.k_proj)
            if attention.v_proj is not None:  # attention_k_eq_v: values from k_proj's output
                projections.append(attention.v_proj)
            self.k_norm, self.v_norm = attention.k_norm, attention.v_norm
        self.qkv = SharedInputProjections(projections, dtype)
        self.o = SharedInputProjections([attention.o_proj], dtype)
        self.mlp = _DecodeMLP(layer.mlp, dtype)
        self.experts = _ExpertBlock(layer, dtype) if getattr(layer, "enable_moe_block", False) else None
        self.per_layer = None
        if getattr(layer, "hidden_size_per_layer_input", None):
            self.per_layer = (
                SharedInputProjections([layer.per_layer_input_gate], dtype),
                SharedInputProjections([layer.per_layer_projection], dtype),
            )

    def project(self, hidden: torch.Tensor) -> tuple:
        """q (B, H, T, D) normed, and k and v (B, KV, T, D) normed, not yet rotated (None
        in a layer that reuses another's)."""
        batch, tokens, _ = hidden.shape
        projected = self.qkv(self.layer.input_layernorm(hidden))
        q = self.q_norm(projected[0].view(batch, tokens, -1, self.head_dim)).transpose(1, 2)
        if self.cache_layer is None:
            return q, None, None
        k = projected[1].view(batch, tokens, -1, self.head_dim)
        v = projected[2].view(batch, tokens, -1, self.head_dim) if len(projected) == 3 else k
        return q, self.k_norm(k).transpose(1, 2), self.v_norm(v).transpose(1, 2)

    def finish(self, hidden: torch.Tensor, attended: torch.Tensor, per_layer_input) -> torch.Tensor:
        """The layer's output from its input ``hidden`` (B, T, hidden), its attention's
        output (B, H, T, D) and its per-layer input (B, T, P) or None."""
        layer = self.layer
        batch, tokens, _ = hidden.shape
        out = self.o(attended.transpose(1, 2).reshape(batch, tokens, -1))[0]
        hidden = hidden + layer.post_attention_layernorm(out)
        out = self.mlp(layer.pre_feedforward_layernorm(hidden))
        if self.experts is not None:
            out = layer.post_feedforward_layernorm_1(out) + self.experts(hidden)
        hidden = hidden + layer.post_feedforward_layernorm(out)
        if self.per_layer is not None:
            gate, projection = self.per_layer
            gated = layer.act_fn(gate(hidden)[0]) * per_layer_input
            hidden = hidden + layer.post_per_layer_input_norm(projection(gated)[0])
        return hidden.mul_(layer.layer_scalar)  # in place, as transformers: hidden's dtype kept

    def refresh(self) -> None:
        parts = [self.qkv, self.o, self.mlp, *(self.per_layer or ())]
        for part in parts + ([self.experts] if self.experts is not None else []):
            part.refresh()


class Gemma4Step(ModelStep):
    """ModelStep for Gemma 4's text decoder (module docstring); same call, same cache
    protocol, with a cache layer only for the layers that compute keys and values."""

    @staticmethod
    def cannot_decode(config) -> str | None:
        if getattr(config, "use_bidirectional_attention", None) == "all":
            return "a Gemma 4 model whose text attends bidirectionally (use_bidirectional_attention='all')"
        if config.num_kv_shared_layers >= config.num_hidden_layers:
            return (
                "a Gemma 4 model whose every layer reuses keys and values it is handed (an assistant model)"
            )
        return None

    def build_projections(self) -> None:
        self.decode_layers, entries = [], 0
        for layer in self.layers:
            reuses = layer.self_attn.is_kv_shared_layer
            self.decode_layers.append(_Gemma4Layer(layer, self.dtype, None if reuses else entries))
            entries += not reuses
        self.first_reusing = next(
            (index for index, g in enumerate(self.decode_layers) if g.cache_layer is None), len(self.layers)
        )

    def cache_layout(self) -> tuple[list[int | None], list[int], list[int]]:
        producers = [g for g in self.decode_layers if g.cache_layer is not None]
        heads = self.config.num_attention_heads
        kv_heads = [heads // g.layer.self_attn.num_key_value_groups for g in producers]
        return [g.window for g in producers], kv_heads, [g.head_dim for g in producers]

    def _per_layer_inputs(self, input_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor | None:
        """(B, T, L, P): every layer's input from the per-layer embeddings, or None."""
        if not getattr(self.decoder, "hidden_size_per_layer_input", None):
            return None
        return self.decoder.project_per_layer_inputs(
            hidden,
            self.decoder.get_per_layer_inputs(input_ids, hidden),  # 5.17 requires the embeddings
        )

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
        """As ModelStep.__call__."""
        tokens = input_ids.shape[1]
        hidden = self.decoder.embed_tokens(input_ids)  # scaled by sqrt(hidden) by the module
        per_layer = self._per_layer_inputs(input_ids, hidden)
        tables = {
            kind: self.decoder.rotary_emb(hidden, positions, kind) for kind in self.decoder.unique_layer_types
        }
        visible = cache.slots if visible is None else visible
        ring_step = tokens == 1  # a one-token step reads each ring whole (_StepAttention)
        attend = _StepAttention(self, cache, first_slot, tokens, visible, causal, hidden.dtype)
        slots = first_slot + torch.arange(tokens, device=input_ids.device)
        stored = {ring: slots if ring is None else slots % ring for ring in set(cache.rings)}
        shared = {}  # layer type -> (keys, values, ring) its storing layer attended over
        for index, g in enumerate(self.decode_layers):
            if index == self.first_reusing and last_only and hidden.shape[1] > 1:
                # Only the last token's logits are wanted and the layers from here on write
                # no cache: run them on that token alone, attending as a one-token step
                # at the prompt's last slot (under a mask, not causal SDPA's alignment).
                hidden = hidden[:, -1:]
                per_layer = None if per_layer is None else per_layer[:, -1:]
                tables = {kind: (cos[:, -1:], sin[:, -1:]) for kind, (cos, sin) in tables.items()}
                attend = _StepAttention(
                    self, cache, first_slot + slots.shape[0] - 1, 1, visible, False, hidden.dtype
                )
            cos, sin = tables[g.layer_type]  # (B, T, D) each
            q, k, v = g.project(hidden)
            if g.cache_layer is None:
                q = _rotate(q, cos[:, None], sin[:, None])
                keys, values, ring = shared[g.layer_type]
            else:
                entry = g.cache_layer
                q, keys, values = _rope_and_cache(
                    q, k, v, cos, sin, cache, entry, slots, stored[cache.rings[entry]]
                )
                ring = cache.rings[entry] if ring_step else None
                if ring is None:
                    keys, values = keys[:, :, :visible], values[:, :, :visible]
                if g.stores:
                    shared[g.layer_type] = keys, values, ring
            attended = attend(q, keys, values, g, ring)
            hidden = g.finish(hidden, attended, None if per_layer is None else per_layer[:, :, index])
        if last_only:
            hidden = hidden[:, -1:]
        logits = self.causal_lm.get_output_embeddings()(self.decoder.norm(hidden)).float()
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits[:, -1] if last_only else logits
