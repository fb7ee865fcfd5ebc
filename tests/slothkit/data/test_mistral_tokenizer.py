"""The "mistral" format against Mistral's own reference: the v1 SentencePiece tokenizer that
the mistral-common package ships, encoded by mistral-common itself.

The same tokenizer.model, converted to a Hugging Face tokenizer (legacy SentencePiece
behaviour, as Mistral-7B-Instruct's tokenizer.json has it), must produce exactly
mistral-common's token ids from slothkit's template, and train_on_responses_only must keep
exactly the reply tokens.  Needs mistral-common, sentencepiece and protobuf (all offline).
"""

import os
import pathlib
import shutil
import warnings

import pytest
import torch

mistral_common = pytest.importorskip("mistral_common")
pytest.importorskip("sentencepiece")
pytest.importorskip("google.protobuf")

from mistral_common.protocol.instruct.messages import AssistantMessage, UserMessage
from mistral_common.protocol.instruct.request import (
    ChatCompletionRequest,
    InstructRequest,
)
from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

from slothkit.data import conversation_text, get_chat_template
from slothkit.data.responses_only import ResponseMasker, infer_markers, probe_markers

V1_MODEL = pathlib.Path(mistral_common.__file__).parent / "data" / "tokenizer.model.v1"

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello! How can I help?"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And the capital of France?"},
        {"role": "assistant", "content": "Paris.\nAnything else?"},
    ],
]


@pytest.fixture(scope="module")
def reference():
    return MistralTokenizer.from_file(str(V1_MODEL))


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import LlamaTokenizer

    folder = tmp_path_factory.mktemp("mistral-v1")
    shutil.copy(V1_MODEL, folder / "tokenizer.model")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tokenizer = LlamaTokenizer.from_pretrained(str(folder), legacy=True, add_bos_token=True)
    return get_chat_template(tokenizer, "mistral")


def _reference_messages(conversation):
    system = conversation[0]["content"] if conversation[0]["role"] == "system" else None
    turns = conversation[1:] if system is not None else conversation
    messages = [
        UserMessage(content=m["content"]) if m["role"] == "user" else AssistantMessage(content=m["content"])
        for m in turns
    ]
    return messages, system


@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
def test_training_sequence_matches_mistral_common(reference, tokenizer, index):
    conversation = CONVERSATIONS[index]
    messages, system = _reference_messages(conversation)
    expected = reference.instruct_tokenizer.encode_instruct(
        InstructRequest(messages=messages, system_prompt=system)
    ).tokens
    ids = tokenizer.apply_chat_template(conversation, tokenize=True, return_dict=True)["input_ids"]
    assert ids == expected
    assert tokenizer(conversation_text(tokenizer, conversation))["input_ids"] == expected


@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
def test_generation_prompt_matches_mistral_common(reference, tokenizer, index):
    conversation = CONVERSATIONS[index][:-1]  # ends with the user's turn
    messages, system = _reference_messages(conversation)
    if system is not None:
        from mistral_common.protocol.instruct.messages import SystemMessage

        messages = [SystemMessage(content=system)] + messages
    expected = reference.encode_chat_completion(ChatCompletionRequest(messages=messages)).tokens
    prompt = tokenizer.apply_chat_template(
        conversation, tokenize=True, add_generation_prompt=True, return_dict=True
    )
    assert prompt["input_ids"] == expected


def test_responses_only_keeps_exactly_the_replies(tokenizer):
    assert infer_markers(tokenizer) == ("[INST]", "[/INST]") == probe_markers(tokenizer)
    masker = ResponseMasker(tokenizer, *infer_markers(tokenizer))
    for conversation in CONVERSATIONS:
        encoded = tokenizer.apply_chat_template(
            conversation, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        ids = torch.tensor(encoded["input_ids"])
        keep = masker.keep_row(ids)
        assert keep.tolist() == [bool(m) for m in encoded["assistant_masks"]]
        replies = [m["content"] for m in conversation if m["role"] == "assistant"]
        assert tokenizer.decode(ids[keep]) == "</s> ".join(replies) + "</s>"


def test_eos_stays_the_documents_eos(tokenizer):
    assert tokenizer.eos_token == "</s>" and tokenizer.eos_token_id == 2
    assert os.path.getsize(V1_MODEL) > 100_000  # the real 32k-piece model, not a stand-in
    assert len(tokenizer) == 32000
