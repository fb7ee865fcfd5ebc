"""slothkit: fast, memory-efficient LoRA and QLoRA fine-tuning of open LLMs.

Importing slothkit changes nothing in other libraries: every speed-up is applied
to the model instance it is given.
"""

__version__ = "0.1.0"
