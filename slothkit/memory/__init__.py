"""GPU memory of LoRA training, predicted from the model's shape, and the settings that fit.

- sizes: the piece and chunk sizes the engine cuts a step into (token chunks of the MLP,
  pinned host pieces), which the prediction reads.
- memory_model: the arithmetic of a training step's memory.
- plan: `slothkit plan` and the choices use_gradient_checkpointing="auto" makes.
"""
