"""A checkpoint's soundness, checked before and after loading it and before saving one.

- before_loading: checks and choices made before a model is loaded (dtype, bitsandbytes,
  the checkpoint's files, the context length, which modules LoRA targets).
- loaded_weights: checks of the weights a checkpoint loaded into a model.
- finite: finding non-finite weights, for loading and for saving.

Imports only slothkit.core: loading (slothkit.loading), saving (slothkit.export) and the
planner (slothkit.memory) all read it.
"""
