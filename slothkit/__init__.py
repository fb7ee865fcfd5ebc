"""slothkit: fast, memory-efficient LoRA and QLoRA fine-tuning of open LLMs.

Importing slothkit changes nothing in other libraries: every speed-up is applied
to the model instance it is given.
"""

__version__ = "0.1.0"

__all__ = ["FastModel", "FastLanguageModel", "__version__"]


def __getattr__(name):
    # Imported on first use so that `import slothkit` (and the CLI) stays light.
    if name in ("FastModel", "FastLanguageModel"):
        from slothkit import fast_model

        return getattr(fast_model, name)
    raise AttributeError(f"module 'slothkit' has no attribute {name!r}")
