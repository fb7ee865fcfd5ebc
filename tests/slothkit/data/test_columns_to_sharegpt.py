"""to_sharegpt: records' columns merged into a user turn, optional parts, conversations
extended with other records."""

import pytest
from datasets import Dataset

from slothkit.data import to_sharegpt

RECORDS = [
    {"instruction": "Add 2 and 3.", "input": "", "output": "5", "id": 0},
    {"instruction": "Name a colour.", "input": "warm", "output": "Red", "id": 1},
    {"instruction": "Spell cat.", "input": None, "output": "C A T", "id": 2},
    {"instruction": "Count to two.", "input": "  ", "output": "1, 2", "id": 3},
]
PROMPT = "{instruction}[[\nYour input is:\n{input}]]"


def test_optional_parts_appear_only_with_their_values():
    conversations = to_sharegpt(Dataset.from_list(RECORDS), merged_prompt=PROMPT)["conversations"]
    assert [c[0]["value"] for c in conversations] == [
        "Add 2 and 3.",
        "Name a colour.\nYour input is:\nwarm",
        "Spell cat.",
        "Count to two.",
    ]
    assert [c[1] for c in conversations] == [{"from": "gpt", "value": r["output"]} for r in RECORDS]
    assert all(c[0]["from"] == "human" and len(c) == 2 for c in conversations)


def test_columns_kept_or_removed_and_the_plain_instruction_column():
    kept = to_sharegpt(RECORDS, remove_unused_columns=False)
    assert kept.column_names == ["instruction", "input", "output", "id", "conversations"]
    assert kept[1]["conversations"][0]["value"] == "Name a colour."  # merged_prompt "": the instruction
    assert to_sharegpt(RECORDS).column_names == ["conversations"]
    numbers = to_sharegpt([{"q": 2, "a": 4}], merged_prompt="Double {q}.", output_column_name="a")
    assert numbers[0]["conversations"] == [
        {"from": "human", "value": "Double 2."},
        {"from": "gpt", "value": "4"},
    ]


def test_extended_conversations_add_other_records_reproducibly():
    first = to_sharegpt(RECORDS, merged_prompt=PROMPT, conversation_extension=3, random_state=1)[
        "conversations"
    ]
    again = to_sharegpt(RECORDS, merged_prompt=PROMPT, conversation_extension=3, random_state=1)[
        "conversations"
    ]
    other_seed = to_sharegpt(RECORDS, merged_prompt=PROMPT, conversation_extension=3, random_state=2)
    assert first == again and first != other_seed["conversations"]
    single = to_sharegpt(RECORDS, merged_prompt=PROMPT)["conversations"]
    for index, conversation in enumerate(first):
        assert len(conversation) == 6 and conversation[:2] == single[index]
        exchanges = [conversation[i : i + 2] for i in (2, 4)]
        assert all(e in single and e != single[index] for e in exchanges)  # another record's


def test_refusals():
    with pytest.raises(ValueError, match="names the columns \\['question'\\], which the dataset lacks"):
        to_sharegpt(RECORDS, merged_prompt="{question}")
    with pytest.raises(ValueError, match="names the columns \\['answer'\\]"):
        to_sharegpt(RECORDS, output_column_name="answer")
    with pytest.raises(ValueError, match="conversation_extension=0; expected a positive integer"):
        to_sharegpt(RECORDS, conversation_extension=0)
