"""Say once when a training forward runs past the model's positions.

A model is trained on positions 0 .. max_position_embeddings - 1.  A longer sequence still
runs: RoPE turns the later positions by angles the model never saw, and what it learns
there does not carry over to the positions it was made for.  transformers says nothing, so a dataset left untruncated
trains on them without a word.  A model loaded with a longer max_seq_length has its RoPE
scaled and its max_position_embeddings raised to it (slothkit.checkpoint.before_loading.
extend_context): no notice up to that length.

The notice is a forward pre-hook on the decoder (the *Model inside the *ForCausalLM or
sequence classifier), which every path reaches: the fused families, the generic path and
Hugging Face's own modules.  It reads shapes only, never a tensor's values, so it adds no
GPU synchronisation to a step:

- no position_ids: positions are 0 .. T - 1, so the sequence length T is the extent;
- position_ids given (packed rows, which restart their positions at every sample): the
  longest sample is known only where the collator gives it as an int (TRL's padding-free
  batches: ``max_length_q``); otherwise nothing is said;
- a forward with a KV cache is generation, which has its own notice
  (slothkit.inference.fast_decoder), and an eval-mode forward is no training.
"""

from __future__ import annotations

from torch import nn

from slothkit.core.notices import DataWarning, say_once


class PositionLimitNotice:
    """The decoder's forward pre-hook (with kwargs): says once per model when a training
    forward reaches past ``config.max_position_embeddings`` (module docstring).  A class
    rather than a closure, so that the model still pickles and deep-copies."""

    def __init__(self) -> None:
        self.said = False

    def __call__(self, decoder: nn.Module, args: tuple, kwargs: dict) -> None:
        if self.said or not decoder.training or kwargs.get("past_key_values") is not None:
            return
        limit = getattr(decoder.config, "max_position_embeddings", None)
        length = _extent(args, kwargs)
        if not limit or length is None or length <= limit:
            return
        self.said = True
        say_once(
            f"slothkit: a training forward of {length} tokens runs past the model's {limit} positions "
            f"(config.max_position_embeddings): RoPE turns the later positions by angles the model "
            f"never saw, and what it learns there does not carry over (said once). Truncate the samples "
            f"to {limit} tokens (SFTConfig(max_length={limit})), or load with max_seq_length={length} "
            f"or more, which scales RoPE to reach it",
            DataWarning,
        )


def _extent(args: tuple, kwargs: dict) -> int | None:
    """The number of positions a decoder forward spans, from shapes alone; None where only
    the values of position_ids would tell."""
    positions = kwargs.get("position_ids", args[2] if len(args) > 2 else None)
    if positions is not None:
        longest = kwargs.get("max_length_q")  # padding-free batches: their longest sample
        return longest if isinstance(longest, int) else None
    tokens = kwargs.get("input_ids", args[0] if args else None)
    if tokens is not None:
        return tokens.shape[-1]  # (B, T)
    embeds = kwargs.get("inputs_embeds")
    return embeds.shape[1] if embeds is not None else None  # (B, T, H)


def watch_position_limit(causal_lm: nn.Module) -> None:
    """Hook PositionLimitNotice onto ``causal_lm``'s decoder, once."""
    decoder = getattr(causal_lm, "base_model", None) or getattr(causal_lm, "model", None)
    if decoder is None or decoder is causal_lm:
        return
    if any(isinstance(hook, PositionLimitNotice) for hook in decoder._forward_pre_hooks.values()):
        return
    decoder.register_forward_pre_hook(PositionLimitNotice(), with_kwargs=True)
