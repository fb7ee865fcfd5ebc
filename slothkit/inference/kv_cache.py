"""A preallocated key/value cache: one (B, KV, S, D) pair per layer at fixed addresses.

Hugging Face's DynamicCache grows by concatenation, which allocates each token and gives
each step new addresses; a CUDA graph needs the opposite.  Here every slot exists from the
start, a step writes its keys and values in place (``index_copy_`` at slot indices held in
a device tensor, so a replayed graph writes where the current step is), and ``filled``
(B, S) marks which slots hold a real token: left padding stays unmarked and is never read.

A layer that attends within a sliding window of W positions narrower than the cache (Gemma
2 and 3's local layers, Mistral v0.1) keeps a ring of W slots instead: the token at slot
s is stored at s mod W, over the token W positions before it, which its window no longer
reaches.  After a step writes slot s, the ring holds exactly the positions s - W + 1 .. s
that the step's query may read, so a decode step reads W slots of such a layer rather
than all S, and the ring's own marks ``ring_filled`` (B, W) are its whole mask.  Gemma 3
4B in bf16 at 8,192 slots a row: its 29 local layers hold 1,024 slots each, the cache 0.27
GiB a row rather than 1.06 (at 32,768: 0.74 rather than 4.25), and a step reads as much less.

A model with gated DeltaNet layers (Qwen3.5) keeps keys and values for its attention
layers only; its DeltaNet layers' recurrent states travel with the cache as
``linear_states`` (decode_deltanet.DeltaNetStates), sized by the rows alone, so a cache
that grows is handed them as they are.
"""

from __future__ import annotations

import torch


class StaticKVCache:
    """Keys and values for ``batch`` rows of up to ``slots`` tokens.

    Args:
        layers: attention layers (the decoder layers that keep keys and values).
        batch: rows.
        kv_heads: key/value heads of every layer, or of each (Gemma 4's full layers have
            their own count).
        slots: tokens per row, prompt and generated (padding included).
        head_dim: D of every layer, or of each (Gemma 4's full layers have wider heads).
        dtype: the keys' dtype (the model's compute dtype).
        device: where the model runs.
        windows: each layer's sliding window (None: full attention); a layer whose window
            is narrower than ``slots`` keeps a ring of that many slots.  None: every layer
            keeps all ``slots``.
        linear_states: the gated DeltaNet layers' states (decode_deltanet.DeltaNetStates)
            for the same rows, or None.
    """

    def __init__(
        self,
        layers: int,
        batch: int,
        kv_heads: int | list[int],
        slots: int,
        head_dim: int | list[int],
        dtype,
        device,
        windows: list[int | None] | None = None,
        linear_states=None,
    ):
        windows = [None] * layers if windows is None else list(windows)
        if len(windows) != layers:
            raise ValueError(f"{len(windows)} windows for {layers} layers")
        kv_heads = [kv_heads] * layers if isinstance(kv_heads, int) else list(kv_heads)
        head_dim = [head_dim] * layers if isinstance(head_dim, int) else list(head_dim)
        if not len(kv_heads) == len(head_dim) == layers:
            raise ValueError(
                f"{len(kv_heads)} head counts and {len(head_dim)} head sizes for {layers} layers"
            )
        # rings[layer]: the ring's width W, or None where the layer keeps every slot.
        self.rings = [window if window is not None and window < slots else None for window in windows]
        shapes = [
            (batch, heads, ring or slots, size) for ring, heads, size in zip(self.rings, kv_heads, head_dim)
        ]
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for shape in shapes]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for shape in shapes]
        self.filled = torch.zeros(batch, slots, dtype=torch.bool, device=device)
        widths = sorted({ring for ring in self.rings if ring is not None})
        self.ring_filled = {
            width: torch.zeros(batch, width, dtype=torch.bool, device=device) for width in widths
        }
        self.batch, self.slots = batch, slots
        self.linear_states = linear_states

    @property
    def nbytes(self) -> int:
        """Bytes held: keys, values and the marks."""
        tensors = [*self.keys, *self.values, self.filled, *self.ring_filled.values()]
        states = 0 if self.linear_states is None else self.linear_states.nbytes
        return states + sum(tensor.numel() * tensor.element_size() for tensor in tensors)

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

    def take_over(self, shorter: StaticKVCache) -> None:
        """Copy ``shorter``'s tokens into this longer cache of the same rows and free
        ``shorter``'s tensors (the two are held together only while this runs).  Every
        layer keeps its tokens at the same slots: one that keeps all slots in both caches,
        one with a ring in both, and one whose window W made no ring in the shorter cache
        (W at least its slots, so its position p sat at slot p = p mod W) but does here."""
        if shorter.batch != self.batch or shorter.slots > self.slots:
            raise ValueError(f"a cache of {shorter.slots} slots cannot grow into one of {self.slots}")
        for layer in range(len(self.keys)):
            for mine, theirs in ((self.keys, shorter.keys), (self.values, shorter.values)):
                mine[layer][:, :, : theirs[layer].shape[2]] = theirs[layer]
                theirs[layer] = None
        self.filled[:, : shorter.slots] = shorter.filled
        for width, marks in self.ring_filled.items():
            before = shorter.ring_filled.get(width, shorter.filled)
            marks[:, : min(width, before.shape[1])] = before[:, :width]
        shorter.filled, shorter.ring_filled = None, {}

    def reset(self, attention_mask: torch.Tensor) -> None:
        """Start a new batch: the prompt's real tokens (attention_mask (B, P)) fill the
        first P slots' marks, and each ring's marks for the prompt's last W positions
        (those the ring keeps); later slots are empty until written."""
        prompt = attention_mask.shape[1]
        self.filled.zero_()
        self.filled[:, :prompt] = attention_mask.bool()
        for width, marks in self.ring_filled.items():
            marks.zero_()
            kept = torch.arange(max(0, prompt - width), prompt, device=marks.device)
            marks[:, kept % width] = attention_mask[:, kept].bool()

    def mark(self, slot: torch.Tensor) -> None:
        """Mark ``slot`` (a 1-element long tensor) as real in every row."""
        self.filled.index_fill_(1, slot, True)
        for width, marks in self.ring_filled.items():
            marks.index_fill_(1, slot % width, True)

    def storage_slots(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """Where ``layer`` stores the tokens of ``slots``: the same slots, or their places
        in its ring."""
        ring = self.rings[layer]
        return slots if ring is None else slots % ring

    def write(self, layer: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor):
        """Store (B, KV, T, D) keys and values of the tokens at ``slots`` (T,) in
        ``layer``; a ring keeps the last W of them.  Returns the layer's whole cache
        (keys, values)."""
        ring = self.rings[layer]
        if ring is not None and slots.shape[0] > ring:
            keys, values, slots = keys[:, :, -ring:], values[:, :, -ring:], slots[-ring:]
        slots = self.storage_slots(layer, slots)
        self.keys[layer].index_copy_(2, slots, keys.to(self.keys[layer].dtype))
        self.values[layer].index_copy_(2, slots, values.to(self.values[layer].dtype))
        return self.keys[layer], self.values[layer]
