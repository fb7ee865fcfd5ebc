"""Gradient checkpointing of the decoder layers.

- choice: which checkpointer the decoder layers get (``enable_checkpointing``).
- offload_checkpoint: checkpointing that keeps each layer's input in pinned host memory
  (offloaded_activation: one layer's host copies; pinned_pieces: the pinned memory, as
  power-of-two pieces; recomputation: what the modules inside a layer's re-run see of it;
  layer_call: what a layer reads with grad and writes for later layers besides its input).
- recompute_policy: use_gradient_checkpointing="auto", which layers keep their activations
  under a memory budget (slothkit.memory's arithmetic).
"""
