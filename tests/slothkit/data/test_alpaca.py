"""format_alpaca: Stanford Alpaca's prompts, the output, and EOS."""

import pytest
from transformers import AutoTokenizer

from slothkit.data import (
    alpaca_prompt,
    conversation_text,
    format_alpaca,
    get_chat_template,
)
from slothkit.testing import tiny_model_path

RECORDS = [
    {"instruction": "Name a colour.", "input": "", "output": "Blue."},
    {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"},
]


def _tokenizer():
    return AutoTokenizer.from_pretrained(str(tiny_model_path("mistral")))


def test_text_is_the_alpaca_prompt_output_and_eos():
    dataset = format_alpaca(RECORDS, _tokenizer())
    assert dataset[0]["text"] == (
        "Below is an instruction that describes a task. Write a response that appropriately completes the "
        "request.\n\n### Instruction:\nName a colour.\n\n### Response:\nBlue.</s>"
    )
    assert dataset[1]["text"] == (
        "Below is an instruction that describes a task, paired with an input that provides further context. "
        "Write a response that appropriately completes the request.\n\n### Instruction:\nAdd the numbers.\n\n"
        "### Input:\n2 and 3\n\n### Response:\n5</s>"
    )
    assert dataset.column_names == ["instruction", "input", "output", "text"]
    assert alpaca_prompt("Name a colour.") + "Blue.</s>" == dataset[0]["text"]


def test_tokenized_sample_ends_with_eos_and_has_one_bos():
    tokenizer = _tokenizer()
    ids = tokenizer(format_alpaca(RECORDS, tokenizer)[1]["text"])["input_ids"]
    assert ids[-1] == tokenizer.eos_token_id and ids.count(tokenizer.bos_token_id) == 1


def test_matches_the_alpaca_chat_template_for_one_turn():
    tokenizer = get_chat_template(_tokenizer(), "alpaca")
    conversation = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}]
    assert conversation_text(tokenizer, conversation) == format_alpaca(RECORDS[:1], tokenizer)[0]["text"]


def test_input_column_is_optional():
    dataset = format_alpaca([{"instruction": "Name a colour.", "output": "Blue."}], _tokenizer())
    assert dataset[0]["text"].endswith("### Instruction:\nName a colour.\n\n### Response:\nBlue.</s>")


@pytest.mark.parametrize(
    "records, match",
    [
        (
            [{"prompt": "a", "completion": "b"}],
            "need the columns \\['instruction', 'output'\\]; the dataset has",
        ),
        ([{"instruction": "a", "output": ""}], "record 0: 'output' must be a non-empty string; got ''"),
        (
            [{"instruction": "a", "output": "b"}, {"instruction": None, "output": "b"}],
            "record 1: 'instruction'",
        ),
        ([{"instruction": "a", "output": "b", "text": "c"}], "already has a 'text' column"),
    ],
)
def test_bad_records_are_named(records, match):
    with pytest.raises(ValueError, match=match):
        format_alpaca(records, _tokenizer())
