"""Table-like records (an Alpaca set, a CSV) as ShareGPT conversations, as Unsloth's Ollama
notebooks make them:

    to_sharegpt(dataset, merged_prompt="{instruction}[[\\nYour input is:\\n{input}]]",
                output_column_name="output", conversation_extension=3)

``merged_prompt`` writes each record's user turn: ``{column}`` is the column's value, and a
part in ``[[...]]`` is written only when every column it names has a value (not None, not
empty), so that a missing value leaves no dangling label.  The reply is
``output_column_name``'s value.  With ``conversation_extension=n`` each conversation goes on
for n exchanges: its own, then n - 1 of other records drawn at random (seeded by
``random_state``), so that the model sees multi-turn chats.
"""

from __future__ import annotations

import random
import re

_OPTIONAL = re.compile(r"\[\[(.*?)\]\]", flags=re.DOTALL)
_FIELD = re.compile(r"\{([^{}\[\]]+)\}")


def to_sharegpt(
    dataset,
    merged_prompt: str = "",
    merged_column_name: str = "instruction",
    output_column_name: str = "output",
    remove_unused_columns: bool = True,
    conversation_extension: int = 1,
    random_state: int = 3407,
):
    """A "conversations" column of ShareGPT turns made from the records' columns (module
    docstring).

    Args:
        dataset: a ``datasets.Dataset`` or what slothkit.data.load_data reads.
        merged_prompt: the user turn, with ``{column}`` fields and ``[[optional]]`` parts;
            "" (default): the ``merged_column_name`` column as it is.
        merged_column_name: the user turn's column when merged_prompt is "".
        output_column_name: the reply's column.
        remove_unused_columns: keep only "conversations" (default True).
        conversation_extension: exchanges per conversation (default 1).
        random_state: the seed of the records drawn for the later exchanges.

    Returns:
        The ``datasets.Dataset`` with a "conversations" column ({"from", "value"} turns,
        which standardize_sharegpt turns into role/content).

    Raises:
        ValueError: a column the prompt or the output names is missing, or
            conversation_extension is not a positive integer.
    """
    from slothkit.data.loading import as_dataset

    dataset = as_dataset(dataset)
    columns = dataset.column_names
    prompt = merged_prompt or "{" + merged_column_name + "}"
    named = sorted(set(_FIELD.findall(prompt)) | {output_column_name})
    missing = [name for name in named if name not in columns]
    if missing:
        raise ValueError(
            f"to_sharegpt names the columns {missing}, which the dataset lacks; its columns: {columns}"
        )
    if isinstance(conversation_extension, bool) or not isinstance(conversation_extension, int) or (
        conversation_extension < 1
    ):  # fmt: skip
        raise ValueError(f"conversation_extension={conversation_extension!r}; expected a positive integer")

    def exchange(record):
        return [
            {"from": "human", "value": merged_text(prompt, record)},
            {"from": "gpt", "value": _value(record[output_column_name])},
        ]

    exchanges = [exchange(record) for record in dataset]
    rng = random.Random(random_state)
    conversations = []
    for index, own in enumerate(exchanges):
        turns = list(own)
        for _ in range(conversation_extension - 1 if len(exchanges) > 1 else 0):
            other = rng.randrange(len(exchanges) - 1)  # any record but this one
            turns += exchanges[other + (other >= index)]
        conversations.append(turns)
    removed = columns if remove_unused_columns else [name for name in columns if name == "conversations"]
    return dataset.map(
        lambda _, index: {"conversations": conversations[index]},
        with_indices=True,
        remove_columns=removed,
        desc="Merging columns into conversations",
    )


def merged_text(prompt: str, record) -> str:
    """`prompt` with each ``{column}`` written and each ``[[part]]`` kept only where all its
    columns have values."""

    def optional(found):
        part = found.group(1)
        if all(_value(record[name]).strip() for name in _FIELD.findall(part)):
            return part
        return ""

    return _FIELD.sub(lambda found: _value(record[found.group(1)]), _OPTIONAL.sub(optional, prompt))


def _value(value) -> str:
    return "" if value is None else str(value)
