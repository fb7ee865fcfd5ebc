"""apply_chat_template of a tokenizer FastModel loaded, called as for datasets 3 and
transformers 4: a whole datasets column of conversations renders as the list it stands
for, in any process; token ids come back as transformers 4's list that also reads as
transformers 5's dict."""

import pickle

import pytest
from datasets import Dataset

from slothkit import FastLanguageModel
from slothkit.data.chat_template_calls import ChatTemplateCall, TokenIds, is_column_of_conversations
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
    assert isinstance(copy.__dict__["apply_chat_template"], ChatTemplateCall)
    assert copy.apply_chat_template.tokenizer is copy
    expected = tokenizer.apply_chat_template(CONVERSATIONS, tokenize=False)
    assert copy.apply_chat_template(_column(), tokenize=False) == expected


def test_token_ids_are_transformers_4s_list_and_read_as_transformers_5s_dict(tokenizer):
    plain = type(tokenizer).apply_chat_template
    for conversation in (CONVERSATIONS[0], CONVERSATIONS):
        encoding = plain(tokenizer, conversation, tokenize=True)  # transformers 5: a BatchEncoding
        ids = tokenizer.apply_chat_template(conversation)
        assert (
            isinstance(ids, TokenIds)
            and ids == encoding["input_ids"]
            and len(ids) == len(encoding["input_ids"])
        )
        assert ids["attention_mask"] == encoding["attention_mask"] and ids.input_ids == encoding["input_ids"]
        assert dict(ids) == dict(encoding) and list(ids.keys()) == list(encoding.keys())
        assert (lambda **kw: kw)(**ids) == dict(encoding)
        assert ids[:2] == encoding["input_ids"][:2]
    # Asked for a dict, tensors or a string, transformers' own return.
    assert not isinstance(tokenizer.apply_chat_template(CONVERSATIONS[0], return_dict=True), TokenIds)
    assert tokenizer.apply_chat_template(CONVERSATIONS[0], return_dict=False) == ids_of(
        tokenizer, CONVERSATIONS[0]
    )
    tensors = tokenizer.apply_chat_template(CONVERSATIONS[0], return_tensors="pt")
    assert tensors["input_ids"].tolist() == [ids_of(tokenizer, CONVERSATIONS[0])]
    assert isinstance(tokenizer.apply_chat_template(CONVERSATIONS[0], tokenize=False), str)
    copy = pickle.loads(pickle.dumps(tokenizer.apply_chat_template(CONVERSATIONS[0])))
    assert copy == ids_of(tokenizer, CONVERSATIONS[0]) and copy["attention_mask"] == [1] * len(copy)


def ids_of(tokenizer, conversation):
    return type(tokenizer).apply_chat_template(tokenizer, conversation, tokenize=True)["input_ids"]


def test_a_batched_map_stores_the_ids_and_their_lengths(tokenizer):
    """Unsloth's Qwen3 GRPO notebook measures its prompts so; transformers 5's dict made
    datasets refuse the map."""
    dataset = Dataset.from_list([{"prompt": c} for c in CONVERSATIONS])
    tokenized = dataset.map(
        lambda x: {
            "tokens": tokenizer.apply_chat_template(x["prompt"], add_generation_prompt=True, tokenize=True)
        },
        batched=True,
    )
    lengths = tokenized.map(lambda x: {"L": len(x["tokens"])})["L"]
    expected = [
        type(tokenizer).apply_chat_template(tokenizer, c, add_generation_prompt=True, tokenize=True)[
            "input_ids"
        ]
        for c in CONVERSATIONS
    ]
    assert tokenized["tokens"] == expected and lengths == [len(ids) for ids in expected]


def test_tensors_are_transformers_4s_tensor_and_read_as_transformers_5s_dict():
    """apply_chat_template(..., return_tensors="pt"): a tensor for ids.shape[1] and ids[0]
    (the tool-calling notebook's slicing), and a mapping for generate(**ids)."""
    import torch
    from transformers import BatchEncoding

    from slothkit.data.chat_template_calls import TokenTensor

    model, tokenizer = FastLanguageModel.from_pretrained(str(tiny_model_path("qwen3")), load_in_4bit=False)
    plain = type(tokenizer).apply_chat_template(
        tokenizer, CONVERSATIONS[2], add_generation_prompt=True, return_tensors="pt"
    )
    ids = tokenizer.apply_chat_template(CONVERSATIONS[2], add_generation_prompt=True, return_tensors="pt").to(
        "cpu"
    )
    assert isinstance(ids, TokenTensor) and torch.equal(ids, plain["input_ids"]) and ids.shape[0] == 1
    assert tokenizer.decode(ids[0]) == tokenizer.decode(plain["input_ids"][0])
    assert type(ids[0]) is torch.Tensor and type(ids + 1) is torch.Tensor  # operations give plain tensors
    assert torch.equal(ids["attention_mask"], plain["attention_mask"]) and dict(ids).keys() == plain.keys()
    settings = {"max_new_tokens": 3, "do_sample": False}
    expected = model.generate(**plain, **settings)
    for call in (lambda: model.generate(**ids, **settings), lambda: model.generate(input_ids=ids, **settings),
                 lambda: model.generate(ids, **settings)):  # fmt: skip
        assert torch.equal(call(), expected)
    assert ids.shape[1] < expected.shape[1]
    # A padded batch keeps its mask: transformers' BatchEncoding, as asked.
    batch = tokenizer.apply_chat_template(CONVERSATIONS, return_tensors="pt", padding=True)
    assert isinstance(batch, BatchEncoding) and not batch["attention_mask"].all()
