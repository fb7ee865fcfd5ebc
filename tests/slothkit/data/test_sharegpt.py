"""standardize_sharegpt: from/value and human/gpt/system to role/content and user/assistant/system."""

import pytest

from slothkit.data import standardize_sharegpt

SHAREGPT = [
    {
        "id": 1,
        "conversations": [
            {"from": "system", "value": "Be brief."},
            {"from": "human", "value": "Hi"},
            {"from": "gpt", "value": "Hello!"},
        ],
    },
    {
        "id": 2,
        "conversations": [
            {"from": "Human", "value": "2 + 2?"},
            {"from": "bot", "value": "4"},
            {"from": "user", "value": "Thanks"},
            {"from": "model", "value": "You're welcome."},
        ],
    },
]


def test_converts_keys_and_roles_and_keeps_other_columns():
    # The column keeps its name, as Unsloth's standardize_sharegpt does.
    dataset = standardize_sharegpt(SHAREGPT)
    assert dataset.column_names == ["id", "conversations"]
    assert dataset[0]["conversations"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
    ]
    assert [m["role"] for m in dataset[1]["conversations"]] == ["user", "assistant", "user", "assistant"]
    assert dataset[1]["id"] == 2
    assert standardize_sharegpt(SHAREGPT, output_field="messages").column_names == ["id", "messages"]


def test_already_standard_records_pass_through():
    records = [{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}]
    assert standardize_sharegpt(records)[0]["messages"] == records[0]["messages"]


def test_custom_speaker_names():
    records = [
        {"conversations": [{"from": "patient", "value": "It hurts"}, {"from": "doctor", "value": "Where?"}]}
    ]
    dataset = standardize_sharegpt(records, aliases={"patient": "user", "doctor": "assistant"})
    assert [m["role"] for m in dataset[0]["conversations"]] == ["user", "assistant"]
    with pytest.raises(ValueError, match="aliases must map speaker names to 'system', 'user' or 'assistant'"):
        standardize_sharegpt(records, aliases={"doctor": "expert"})


@pytest.mark.parametrize(
    "conversation, match",
    [
        (
            [{"from": "narrator", "value": "x"}],
            "record 0 \\('conversations'\\), message 0: unknown speaker 'narrator'; "
            "accepted: assistant, bot, chatgpt, gpt, human, model, system, user",
        ),
        (
            [{"speaker": "human", "text": "x"}],
            "message 0: expected keys 'from' and 'value'.*got \\['speaker', 'text'\\]",
        ),
        ([{"from": "human", "value": 3}], "'value' must be a string; got int"),
        ([], "record 0 \\('conversations'\\) is empty"),
        ("hello", "expected a list of messages; got str"),
    ],
)
def test_bad_records_are_named(conversation, match):
    import datasets

    dataset = datasets.Dataset.from_dict({"conversations": [conversation]})
    with pytest.raises(ValueError, match=match):
        standardize_sharegpt(dataset)


def test_missing_column_lists_the_columns():
    with pytest.raises(
        ValueError, match="no 'conversations' or 'messages' column.*\\['instruction', 'output'\\]"
    ):
        standardize_sharegpt([{"instruction": "a", "output": "b"}])
