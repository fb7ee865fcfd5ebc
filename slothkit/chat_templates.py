"""The chat template helpers under the module path older Unsloth notebooks import:

    from slothkit.chat_templates import get_chat_template, standardize_sharegpt, train_on_responses_only
    from slothkit.chat_templates import to_sharegpt, apply_chat_template  # the Ollama notebooks' helpers

They are slothkit.data's functions (their docstrings say what each does); the calls those
notebooks make are accepted as written: ``get_chat_template(tokenizer, chat_template=...,
mapping=...)``, ``standardize_sharegpt(dataset, aliases_for_user=[...])`` (the
"conversations" column keeps its name), ``train_on_responses_only(trainer,
instruction_part=..., response_part=..., force_match=..., num_proc=...)`` (the trainer's
tokenized dataset gets its labels masked).
"""

from slothkit.data.chat_formats import FORMATS as CHAT_TEMPLATES
from slothkit.data.chat_templates import get_chat_template
from slothkit.data.columns_to_sharegpt import to_sharegpt
from slothkit.data.conversations import apply_chat_template
from slothkit.data.responses_only import train_on_responses_only
from slothkit.data.sharegpt import standardize_data_formats, standardize_sharegpt

__all__ = [
    "CHAT_TEMPLATES",
    "apply_chat_template",
    "get_chat_template",
    "standardize_data_formats",
    "standardize_sharegpt",
    "to_sharegpt",
    "train_on_responses_only",
]
