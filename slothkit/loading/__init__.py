"""The loading pipeline behind FastModel: a checkpoint into a patched model, LoRA onto it,
and the switch between training and generation.

- load_model: checks, NF4 through bitsandbytes, the fused path patched onto the instance,
  the tokenizer (text_tower: a multimodal checkpoint's text model alone).
- saved_adapter: a saved LoRA adapter folder loaded with its base.
- lora_setup: LoRA adapters added through PEFT, the settings checked against the model.
- training_mode: set a PEFT model up to train (checkpointing, the save and push methods)
  and move it between training and generation.
"""
