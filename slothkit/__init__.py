"""slothkit: fast, memory-efficient LoRA and QLoRA fine-tuning of open LLMs.

Importing slothkit changes nothing in other libraries: every speed-up is applied
to the model instance it is given. (Loading a model adds one filter to one logger of
bitsandbytes, dropping a notice about an optional kernel package: slothkit.checkpoint.before_loading;
loading one for a GPU turns on torch's expandable segments where the user has not set the
allocator's variable, said once: slothkit.core.allocator.)

The names older Unsloth notebooks import from their package are here too
(``is_bfloat16_supported``, ``UnslothTrainer``, ``to_sharegpt``, ``standardize_sharegpt``,
the dataset-level ``apply_chat_template``, ...; the chat template helpers in
slothkit.chat_templates, the TRL trainers in slothkit.trl).
"""

from slothkit.core.version import __version__

# name -> the module that defines it; imported on first use so that `import slothkit` (and
# the CLI) stays light.
_LAZY = {
    "FastModel": "slothkit.fast_model",
    "FastLanguageModel": "slothkit.fast_model",
    "FastLlamaModel": "slothkit.fast_model",
    "FastMistralModel": "slothkit.fast_model",
    "FastGemmaModel": "slothkit.fast_model",
    "FastGemma2Model": "slothkit.fast_model",
    "FastQwen2Model": "slothkit.fast_model",
    "FastQwen3Model": "slothkit.fast_model",
    "FastVisionModel": "slothkit.fast_vision_model",
    "is_bfloat16_supported": "slothkit.checkpoint.before_loading",
    "is_bf16_supported": "slothkit.checkpoint.before_loading",
    "get_chat_template": "slothkit.chat_templates",
    "TrainingArguments": "slothkit.trl",
    "UnslothTrainer": "slothkit.trl",
    "UnslothTrainingArguments": "slothkit.trl",
    "UnslothVisionDataCollator": "slothkit.trl",
    "VisionDataCollator": "slothkit.data",
    "PatchDPOTrainer": "slothkit.trl",
    "unsloth_train": "slothkit.trl",
    "to_sharegpt": "slothkit.data",
    "standardize_sharegpt": "slothkit.data",
    "apply_chat_template": "slothkit.data",
}

__all__ = [*_LAZY, "__version__"]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'slothkit' has no attribute {name!r}")
