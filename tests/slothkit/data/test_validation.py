"""Dataset checks run before a TRL trainer: each bad layout gets an error naming the record."""

import datasets
import pytest
from transformers import AutoTokenizer

from slothkit.data import get_chat_template
from slothkit.data.validation import (
    check_preference_dataset,
    check_prompt_dataset,
    check_sft_dataset,
)
from slothkit.testing import tiny_model_path

GOOD = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}]


def _tokenizer():
    return get_chat_template(AutoTokenizer.from_pretrained(str(tiny_model_path("mistral"))), "mistral")


@pytest.mark.parametrize(
    "records",
    [
        [{"text": "some text</s>"}],
        [{"messages": GOOD}],
        [{"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}]}],
        [{"prompt": "2 + 2 =", "completion": " 4"}],
        [{"prompt": GOOD[:1], "completion": GOOD[1:]}],
        [{"input_ids": [1, 2, 3]}],
    ],
)
def test_sft_layouts_trl_accepts(records):
    check_sft_dataset(datasets.Dataset.from_list(records), _tokenizer())


@pytest.mark.parametrize(
    "records, match",
    [
        (
            [{"instruction": "a", "output": "b"}],
            "columns \\['instruction', 'output'\\]; SFT needs one of: 'text'.*format_alpaca",
        ),
        ([{"text": "fine"}, {"text": "  "}], "training record 1 \\('text'\\) is empty"),
        ([{"messages": []}], "training record 0 \\('messages'\\) is empty"),
        ([{"messages": [{"role": "person", "content": "a"}]}], "role 'person' is not accepted"),
        ([{"messages": GOOD[:1]}], "has no 'assistant' message"),
        ([{"conversations": [{"from": "alien", "value": "a"}]}], "unknown speaker 'alien'"),
        ([{"prompt": "a", "completion": ""}], "training record 0 \\('completion'\\) is empty"),
    ],
)
def test_bad_sft_records_are_named(records, match):
    with pytest.raises(ValueError, match=match):
        check_sft_dataset(datasets.Dataset.from_list(records), _tokenizer())


def test_conversations_need_a_chat_template():
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_path("mistral")))
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="holds conversations but the tokenizer has no chat template"):
        check_sft_dataset(datasets.Dataset.from_list([{"messages": GOOD}]), tokenizer)
    with pytest.raises(ValueError, match="the training dataset has no records"):
        check_sft_dataset(datasets.Dataset.from_dict({"text": []}), tokenizer)


def test_preference_records():
    check_preference_dataset(datasets.Dataset.from_list([{"prompt": "Q", "chosen": "yes", "rejected": "no"}]))
    conversational = {"prompt": GOOD[:1], "chosen": GOOD[1:], "rejected": GOOD[1:]}
    check_preference_dataset(datasets.Dataset.from_list([conversational]))
    with pytest.raises(ValueError, match="lacks \\['rejected'\\]"):
        check_preference_dataset(datasets.Dataset.from_list([{"prompt": "Q", "chosen": "yes"}]))
    with pytest.raises(ValueError, match="record 0 \\('rejected'\\) has no 'assistant' message"):
        check_preference_dataset(datasets.Dataset.from_list([{"chosen": GOOD[1:], "rejected": GOOD[:1]}]))


def test_prompt_records():
    check_prompt_dataset(datasets.Dataset.from_list([{"prompt": GOOD[:1]}, {"prompt": GOOD[:1]}]))
    with pytest.raises(ValueError, match="needs a 'prompt' column for GRPO"):
        check_prompt_dataset(datasets.Dataset.from_list([{"question": "Q"}]))
    with pytest.raises(ValueError, match="ends with an assistant message"):
        check_prompt_dataset(datasets.Dataset.from_list([{"prompt": GOOD}]))


def test_streamed_datasets_are_checked_on_their_first_records():
    stream = datasets.Dataset.from_list([{"text": "ok"}, {"text": ""}]).to_iterable_dataset()
    with pytest.raises(ValueError, match="record 1 \\('text'\\) is empty"):
        check_sft_dataset(stream)


def test_a_lone_surrogate_in_streamed_text_is_named_before_the_tokenizer_meets_it():
    bad = "caf\udce9"  # bytes.decode("utf-8", "surrogateescape") of latin-1 "café"
    with pytest.raises(TypeError, match="TextEncodeInput"):
        _tokenizer()(bad)  # what training would meet
    cases = [
        ({"text": bad}, "training record 1 \\('text'\\)"),
        (
            {"messages": [{"role": "user", "content": bad}, GOOD[1]]},
            "training record 1 \\('messages'\\), message 0",
        ),
        ({"prompt": "2 + 2 =", "completion": bad}, "training record 1 \\('completion'\\)"),
    ]
    for record, where in cases:
        records = [{key: (GOOD if key == "messages" else "ok") for key in record}, record]
        stream = datasets.IterableDataset.from_generator(lambda records=records: iter(records))
        with pytest.raises(ValueError, match=f"^{where}.* holds a lone surrogate '\\\\udce9' at character 3"):
            check_sft_dataset(stream)
    with pytest.raises(ValueError, match="training record 0 \\('chosen'\\) holds a lone surrogate"):
        check_preference_dataset(
            datasets.IterableDataset.from_generator(lambda: iter([{"chosen": bad, "rejected": "x"}]))
        )
