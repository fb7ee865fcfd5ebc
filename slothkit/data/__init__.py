"""Training data for slothkit: chat templates, dataset formatting and loading.

    from slothkit.data import get_chat_template, standardize_sharegpt, apply_chat_template

    tokenizer = get_chat_template(tokenizer, "llama-3", model=model)
    dataset = apply_chat_template(standardize_sharegpt(load_data("data.jsonl")), tokenizer)
    ...
    trainer = train_on_responses_only(trainer)

Each name lives in the file after it: chat_formats (the formats, as data; the markers of
their turns in turn_layouts, which ollama_templates writes as an Ollama Modelfile too), chat_templates
(installing one), marker_tokens (which of a format's markers are added, mapped onto the
EOS or left as text), sharegpt, columns_to_sharegpt (to_sharegpt: table-like records as
conversations), conversations (with prompt_templates: a {SYSTEM}/{INPUT}/{OUTPUT} prompt
as a chat template), alpaca, responses_only, loading, examples, example_images (formula
images with their LaTeX, for vision fine-tuning), vision_collator,
packing (PackingCollator: a batch as one row of samples, no padding); validation holds the checks slothkit.trl's trainers run before handing data to TRL; text_encoding finds
text that is not UTF-8.
"""

from slothkit.data.alpaca import alpaca_prompt, format_alpaca
from slothkit.data.chat_formats import FORMATS, ChatFormat
from slothkit.data.chat_templates import (
    chat_template_names,
    follow_tokenizer,
    get_chat_template,
)
from slothkit.data.columns_to_sharegpt import to_sharegpt
from slothkit.data.conversations import (
    apply_chat_template,
    check_conversation,
    conversation_text,
)
from slothkit.data.example_images import example_image_dataset, example_images
from slothkit.data.examples import example_dataset
from slothkit.data.loading import as_dataset, load_data
from slothkit.data.packing import PackingCollator
from slothkit.data.responses_only import (
    NoTrainableTokensError,
    infer_markers,
    train_on_responses_only,
)
from slothkit.data.sharegpt import standardize_data_formats, standardize_sharegpt
from slothkit.data.vision_collator import VisionDataCollator

__all__ = [
    "FORMATS",
    "ChatFormat",
    "NoTrainableTokensError",
    "PackingCollator",
    "VisionDataCollator",
    "alpaca_prompt",
    "apply_chat_template",
    "as_dataset",
    "chat_template_names",
    "check_conversation",
    "conversation_text",
    "example_dataset",
    "example_image_dataset",
    "example_images",
    "follow_tokenizer",
    "format_alpaca",
    "get_chat_template",
    "infer_markers",
    "load_data",
    "standardize_data_formats",
    "standardize_sharegpt",
    "to_sharegpt",
    "train_on_responses_only",
]
