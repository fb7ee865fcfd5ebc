"""The fused training path's internals: what FastModel puts together.

- inspection: the model inside a PeftModel, whether it is 4-bit, its dtypes.
- loading: checks and choices made before a model is loaded (dtype, bitsandbytes, targets).
- lora_projection: reads a PEFT LoRA layer (16-bit or NF4 base) into a kernel record.
- decoder, decoder_layer: the decoder glue, written once for every architecture record
  in slothkit.models, patched onto the model instance.
- generic_head: the fused loss on the head of a model without a record, where its own
  loss is the plain one.
- offload_checkpoint: gradient checkpointing with layer inputs offloaded to host memory
  (offloaded_activation: one layer's host copies; recomputation: what the modules inside
  a layer's re-run see of it).
- checkpointing: which checkpointer the decoder layers get (enable_checkpointing).
- recompute_policy: use_gradient_checkpointing="auto", which layers keep their activations
  under a memory budget (slothkit.memory.memory_model's arithmetic).
- layer_graphs: CUDA graphs of whole decoder layers under offloaded checkpointing
  (layer_graph_calls: a layer call as a graph sees it; layer_graph_buffers: the static
  buffers the graphs read and write).
"""
