"""A whole datasets column of conversations through the apply_chat_template of a
tokenizer FastModel loaded: rendered as the list it stands for, in any process."""

import pickle

import pytest
from datasets import Dataset

from slothkit import FastLanguageModel
from slothkit.data.conversation_columns import ColumnsAsBatches, is_column_of_conversations
from slothkit.testing import tiny_model_path

CONVERSATIONS = [
    [{"role": "user", "content": "Name a slow animal."}, {"role": "assistant", "content": "The sloth."}],
    [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi!"}],
    [{"role": "user", "content": "Spell cat."}],
]


@pytest.fixture(scope="module")
def tokenizer():
    _, loaded = FastLanguageModel.from_pretrained(str(tiny_model_path("qwen3")), load_in_4bit=False)
    return loaded


def _column():
    column = Dataset.from_list([{"conversations": c} for c in CONVERSATIONS])["conversations"]
    assert not isinstance(column, list)  # datasets 4 and later: a lazy Column
    return column


def test_a_column_renders_as_its_list(tokenizer):
    column = _column()
    for options in (
        {"tokenize": False},
        {"tokenize": True},
        {"tokenize": False, "add_generation_prompt": True},
    ):
        assert tokenizer.apply_chat_template(column, **options) == tokenizer.apply_chat_template(
            CONVERSATIONS, **options
        )
    # One conversation, and a list of them, are transformers' own calls.
    plain = type(tokenizer).apply_chat_template
    assert tokenizer.apply_chat_template(CONVERSATIONS[0], tokenize=False) == plain(
        tokenizer, CONVERSATIONS[0], tokenize=False
    )
    assert tokenizer.apply_chat_template(CONVERSATIONS, tokenize=False) == plain(
        tokenizer, CONVERSATIONS, tokenize=False
    )


def test_only_sequences_of_conversations_count():
    assert is_column_of_conversations(_column())
    assert not is_column_of_conversations(CONVERSATIONS)  # a list: transformers batches it itself
    assert not is_column_of_conversations("text")
    assert not is_column_of_conversations(Dataset.from_list([{"text": "a"}])["text"])  # a column of strings
    assert not is_column_of_conversations(Dataset.from_list([{"text": "a"}])["text"][:0])


def test_a_pickled_tokenizer_keeps_the_reading(tokenizer):
    """datasets.map's workers get the tokenizer pickled: the copy reads columns too, through
    its own wrapper around the class's method."""
    copy = pickle.loads(pickle.dumps(tokenizer))
    assert isinstance(copy.__dict__["apply_chat_template"], ColumnsAsBatches)
    assert copy.apply_chat_template.tokenizer is copy
    expected = tokenizer.apply_chat_template(CONVERSATIONS, tokenize=False)
    assert copy.apply_chat_template(_column(), tokenize=False) == expected
