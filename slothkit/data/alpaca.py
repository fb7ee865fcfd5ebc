"""Stanford Alpaca records (instruction, input, output) to training text.

The prompts are Alpaca's own (tatsu-lab/stanford_alpaca, train.py):

    Below is an instruction that describes a task[, paired with an input that provides
    further context]. Write a response that appropriately completes the request.

    ### Instruction:
    {instruction}

    [### Input:
    {input}

    ]### Response:
    {output}<EOS>

EOS ends every sample so that the model learns to stop; without it a fine-tuned model
runs on past its answer.
"""

from __future__ import annotations

PREAMBLE = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request."
)
PREAMBLE_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request."
)
INSTRUCTION_PART = "### Instruction:\n"
RESPONSE_PART = "### Response:\n"


def alpaca_prompt(instruction: str, input: str = "") -> str:
    """The prompt up to and including "### Response:\\n" (what generation continues)."""
    if input:
        return f"{PREAMBLE_WITH_INPUT}\n\n{INSTRUCTION_PART}{instruction}\n\n### Input:\n{input}\n\n{RESPONSE_PART}"
    return f"{PREAMBLE}\n\n{INSTRUCTION_PART}{instruction}\n\n{RESPONSE_PART}"


def format_alpaca(
    dataset,
    tokenizer,
    *,
    instruction_field: str = "instruction",
    input_field: str = "input",
    output_field: str = "output",
    text_field: str = "text",
):
    """Add `text_field` = Alpaca prompt + output + EOS to every record.

    The input column is optional (records without one, or with an empty one, use the
    no-input prompt); instruction and output must be non-empty strings.
    """
    from slothkit.data.loading import as_dataset

    eos = tokenizer.eos_token
    if not eos:
        raise ValueError(
            "the tokenizer has no EOS token; Alpaca samples end with EOS so that the model learns to stop"
        )
    dataset = as_dataset(dataset)
    columns = dataset.column_names
    missing = [name for name in (instruction_field, output_field) if name not in columns]
    if missing:
        hint = (
            " (conversations go through slothkit.data.apply_chat_template)" if "messages" in columns else ""
        )
        raise ValueError(f"Alpaca records need the columns {missing}; the dataset has {columns}{hint}")
    if text_field in columns:
        raise ValueError(f"the dataset already has a {text_field!r} column; pass another text_field")
    has_input = input_field in columns

    def render(record, index):
        instruction, output = record[instruction_field], record[output_field]
        extra = record[input_field] if has_input else ""
        for name, value in ((instruction_field, instruction), (output_field, output)):
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"record {index}: {name!r} must be a non-empty string; got {value!r}")
        if extra is not None and not isinstance(extra, str):
            raise ValueError(f"record {index}: {input_field!r} must be a string; got {type(extra).__name__}")
        return {text_field: alpaca_prompt(instruction, extra or "") + output + eos}

    return dataset.map(render, with_indices=True, desc="Formatting Alpaca records")
