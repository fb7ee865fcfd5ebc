"""apply_chat_template over a dataset: the text column, and clear errors for bad conversations."""

import warnings

import datasets
import pytest
from transformers import AutoTokenizer

from slothkit.data import (
    apply_chat_template,
    check_conversation,
    conversation_text,
    get_chat_template,
)
from slothkit.testing import tiny_model_path

GOOD = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}]


def _tokenizer(name="chatml"):
    from transformers import AutoModelForCausalLM

    path = str(tiny_model_path("llama"))
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)  # grows with the format's tokens
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return get_chat_template(tokenizer, name, model=model, add_missing_tokens=True)


def test_text_column_replaces_messages():
    tokenizer = _tokenizer()
    dataset = apply_chat_template([{"messages": GOOD, "id": 7}], tokenizer)
    assert dataset.column_names == ["id", "text"]
    # No leading BOS (tokenizing adds it), no newline after the last <|im_end|>.
    assert (
        dataset[0]["text"]
        == "<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\nBlue.<|im_end|>"
    )
    kept = apply_chat_template([{"messages": GOOD}], tokenizer, keep_messages=True)
    assert kept.column_names == ["messages", "text"]


def test_generation_prompts_keep_their_trailing_text():
    tokenizer = _tokenizer("llama-3")
    dataset = apply_chat_template([{"messages": GOOD[:1]}], tokenizer, add_generation_prompt=True)
    assert dataset[0]["text"].endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_sharegpt_column_with_a_mapped_template():
    tokenizer = _tokenizer()
    tokenizer = get_chat_template(
        tokenizer, "chatml", mapping={"role": "from", "content": "value", "user": "human", "assistant": "gpt"}
    )
    records = [
        {"conversations": [{"from": "human", "value": "Name a colour."}, {"from": "gpt", "value": "Blue."}]}
    ]
    assert (
        apply_chat_template(records, tokenizer)[0]["text"]
        == apply_chat_template([{"messages": GOOD}], _tokenizer())[0]["text"]
    )


@pytest.mark.parametrize(
    "messages, match",
    [
        ([], "record 0 \\('messages'\\) is empty"),
        ([{"role": "user", "content": "a"}], "has no 'assistant' message, so nothing to train on"),
        (
            [{"role": "human", "content": "a"}, GOOD[1]],
            "message 0: role 'human' is not accepted here; accepted roles: "
            "'system' \\(first message only\\), 'user', 'assistant'",
        ),
        (
            [GOOD[0], {"role": "system", "content": "late"}, GOOD[1]],
            "message 1: role 'system' is not accepted",
        ),
        (
            [{"from": "human", "value": "a"}],
            "expected keys 'role' and 'content'.*run slothkit.data.standardize_sharegpt",
        ),
        (
            [{"role": "user", "content": ["a"]}, {"role": "assistant", "content": ["b"]}],
            "message 0: 'content' must be a string; got list",
        ),
    ],
)
def test_bad_conversations_are_named(messages, match):
    dataset = datasets.Dataset.from_dict({"messages": [messages]})
    with pytest.raises(ValueError, match=match):
        apply_chat_template(dataset, _tokenizer())


def test_template_errors_name_the_record():
    records = [{"messages": GOOD}, {"messages": [GOOD[0], GOOD[0], GOOD[1]]}]
    with pytest.raises(
        ValueError, match="record 1 \\('messages'\\): chat template mistral: turns must alternate"
    ):
        apply_chat_template(records, _tokenizer("mistral"))


def test_missing_column_and_missing_template():
    with pytest.raises(ValueError, match="no conversation column.*format_alpaca"):
        apply_chat_template([{"instruction": "a", "output": "b"}], _tokenizer())
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_path("llama")))
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="no chat template; set one with slothkit.data.get_chat_template"):
        conversation_text(tokenizer, GOOD)


def test_check_conversation_accepts_a_good_one():
    check_conversation([{"role": "system", "content": "s"}] + GOOD)
    check_conversation(GOOD[:1], need_assistant=False)


def test_a_marker_written_as_text_opens_the_text_column_with_a_word_start():
    """The module docstring's quirk for a format whose opening marker a SentencePiece
    tokenizer lacks (llama-3 on the tiny Mistral one, the marker then text): the text
    column's tokens differ from the template's only by one "▁" before the first marker."""
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_path("mistral")))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the notice of what stays text
        get_chat_template(tokenizer, "llama-3")
    chat_ids = tokenizer.apply_chat_template(GOOD, tokenize=True)
    chat_ids = chat_ids["input_ids"] if hasattr(chat_ids, "keys") else chat_ids
    text_ids = tokenizer(conversation_text(tokenizer, GOOD))["input_ids"]
    word_start = tokenizer.convert_tokens_to_ids("▁")
    assert text_ids == [tokenizer.bos_token_id, word_start] + chat_ids[1:]
