"""Load a saved LoRA adapter of an image-text model with FastVisionModel.from_pretrained.

    model.save_pretrained("lora_model"); processor.save_pretrained("lora_model")
    model, processor = FastVisionModel.from_pretrained("lora_model")   # later, or elsewhere

As for a text model's (slothkit.loading.saved_adapter), the folder's adapter_config.json
names the base; the base loads through FastVisionModel's loading with the same settings,
then the adapter onto it as a trainable ``peft.PeftModel``, prepared as
``FastVisionModel.get_peft_model`` prepares a new one.  The processor is the folder's
where it was saved there (its chat template as trained with), else the base's.
"""

from __future__ import annotations

import os

from slothkit.loading.load_model import LoadOptions
from slothkit.loading.saved_adapter import checked_adapter_base
from slothkit.loading.vision_lora import ready_vision_model
from slothkit.loading.vision_model import image_text_config, load_processor, load_vision_model

# What processor.save_pretrained writes beside the tokenizer's files.
_PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")


def load_saved_vision_adapter(folder: str, options: LoadOptions, checkpointing="offload"):
    """The image-text base model named in `folder`'s adapter_config.json with the adapter
    on it, and its processor.

    Args:
        folder: a folder written by ``PeftModel.save_pretrained`` from a FastVisionModel.
        options: ``FastVisionModel.from_pretrained``'s options, for the base model.
        checkpointing: as ``FastVisionModel.get_peft_model``'s use_gradient_checkpointing.

    Returns:
        ``(peft_model, processor)``.

    Raises:
        FileNotFoundError: adapter_config.json names no base model, or a folder that is
            not there; or neither the folder nor the base has a processor.
        ValueError: the base is not an image-text model, or holds other weights than the
            adapter was trained on.
    """
    from peft import PeftModel

    base = checked_adapter_base(folder)
    image_text_config(base, options.token)  # before the processor: a text base is refused as such
    saved_processor = any(os.path.isfile(os.path.join(folder, name)) for name in _PROCESSOR_FILES)
    processor = load_processor(folder if saved_processor else base, options.token)
    model = load_vision_model(base, options, processor)
    peft_model = PeftModel.from_pretrained(model, folder, is_trainable=True)
    return ready_vision_model(peft_model, checkpointing), processor
