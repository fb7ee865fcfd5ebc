"""The fused training path's internals: what FastModel puts together.

- lora_projection: reads a PEFT LoRA layer (16-bit or NF4 base) into a kernel record
  (nf4_layout: the 4-bit weight's layout as the kernels read it).
- decoder, decoder_layer: the decoder glue, written once for every architecture record
  in slothkit.models, patched onto the model instance.
- experts: the fused mixture-of-experts block on a model's experts modules.
- generic_head, generic_layers: the fused loss, attention and MLP on a model without a
  record, each checked against the model's own before it is kept.
- gated_deltanet: Qwen3.5's gated DeltaNet layers through the delta rule kernel in
  training, checked the same way.
- checkpointing/: gradient checkpointing (which checkpointer, offloaded to host memory,
  use_gradient_checkpointing="auto").
- layer_graphs: CUDA graphs of whole decoder layers under offloaded checkpointing
  (layer_graph_calls: a layer call as a graph sees it; layer_graph_buffers: the static
  buffers the graphs read and write).

What the engine reads of a model (slothkit.core.inspection) and the sizes it cuts a step
into (slothkit.memory.sizes) live on the floors below it.
"""
