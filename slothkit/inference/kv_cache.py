"""A preallocated key/value cache: one (B, KV, S, D) pair per layer at fixed addresses.

Hugging Face's DynamicCache grows by concatenation, which allocates each token and gives
each step new addresses; a CUDA graph needs the opposite.  Here every slot exists from the
start, a step writes its keys and values in place (``index_copy_`` at slot indices held in
a device tensor, so a replayed graph writes where the current step is), and ``filled``
(B, S) marks which slots hold a real token: left padding stays unmarked and is never read.
"""

from __future__ import annotations

import torch


class StaticKVCache:
    """Keys and values for ``batch`` rows of up to ``slots`` tokens.

    Args:
        layers: decoder layers.
        batch: rows.
        kv_heads: key/value heads per layer.
        slots: tokens per row, prompt and generated (padding included).
        head_dim: D.
        dtype: the keys' dtype (the model's compute dtype).
        device: where the model runs.
    """

    def __init__(self, layers: int, batch: int, kv_heads: int, slots: int, head_dim: int, dtype, device):
        shape = (batch, kv_heads, slots, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.filled = torch.zeros(batch, slots, dtype=torch.bool, device=device)
        self.batch, self.slots = batch, slots

    @property
    def nbytes(self) -> int:
        """Bytes held: keys, values and the marks."""
        per_layer = self.keys[0].numel() * self.keys[0].element_size()
        return 2 * len(self.keys) * per_layer + self.filled.numel()

    def fits(self, batch: int, slots: int, dtype, device) -> bool:
        """Whether this cache can serve ``batch`` rows of ``slots`` tokens as is: the same
        rows, dtype and device, and from ``slots`` up to twice that many slots.  A longer
        cache serves a shorter call (its empty slots are never read as tokens), so a
        notebook that asks for 256 tokens, then 128, keeps one cache and one captured
        graph; no more than twice, because each decode step reads every slot."""
        key = self.keys[0]
        return (
            self.batch == batch
            and slots <= self.slots <= 2 * slots
            and key.dtype == dtype
            and key.device == device
        )

    def reset(self, attention_mask: torch.Tensor) -> None:
        """Start a new batch: the prompt's real tokens (attention_mask (B, P)) fill the
        first P slots' marks; later slots are empty until written."""
        self.filled.zero_()
        self.filled[:, : attention_mask.shape[1]] = attention_mask.bool()

    def mark(self, slot: torch.Tensor) -> None:
        """Mark ``slot`` (a 1-element long tensor) as real in every row."""
        self.filled.index_fill_(1, slot, True)

    def write(self, layer: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor):
        """Store (B, KV, T, D) keys and values at ``slots`` (T,) of ``layer``; return the
        layer's whole cache (keys, values)."""
        self.keys[layer].index_copy_(2, slots, keys.to(self.keys[layer].dtype))
        self.values[layer].index_copy_(2, slots, values.to(self.values[layer].dtype))
        return self.keys[layer], self.values[layer]
