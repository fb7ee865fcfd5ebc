"""Chat templates and response masking on a real tokenizer: SmolLM2-135M-Instruct's
49,152-token byte-level BPE with its own ChatML template (which adds a system turn of
its own to conversations that have none), and Gemma 3's 262,144-token SentencePiece BPE
where a case concerns every tokenizer."""

import os
import types
import warnings

import pytest
import torch

from slothkit.data import get_chat_template, train_on_responses_only
from slothkit.data.chat_formats import format_of_template
from slothkit.data.chat_templates import matching_format

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SMOLLM_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

CONVERSATIONS = [
    [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris.\nIt lies on the Seine."},
        {"role": "user", "content": "And its population?"},
        {"role": "assistant", "content": "About 2.1 million people (2023)."},
    ],
    [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "Colour of the sky?"},
        {"role": "assistant", "content": " Blue"},
    ],
]


@pytest.fixture
def tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


def test_the_chat_template_is_detected_as_chatml(tokenizer):
    own = tokenizer.chat_template
    fmt = matching_format(tokenizer)
    assert fmt.name == "chatml" and fmt.default_system == SMOLLM_SYSTEM
    get_chat_template(tokenizer, "model")  # installs slothkit's ChatML with the generation marks
    assert format_of_template(tokenizer.chat_template).name == "chatml"
    assert tokenizer.eos_token == "<|im_end|>"
    for messages in CONVERSATIONS + [CONVERSATIONS[0][:1]]:
        for prompt in (False, True):
            assert tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=prompt
            ) == tokenizer.apply_chat_template(
                messages, chat_template=own, tokenize=False, add_generation_prompt=prompt
            )


def _reply_tokens(tokenizer, messages) -> tuple[list[int], list[bool]]:
    """The conversation's token ids and, for each, whether it lies inside an assistant reply
    (the reply's text, its <|im_end|> and the newline after it), found from character
    offsets in the rendered text."""
    return _tokens_inside_replies(
        tokenizer, messages, lambda m: (m["role"] + "\n", m["content"] + "<|im_end|>\n")
    )


def _tokens_inside_replies(tokenizer, messages, turn) -> tuple[list[int], list[bool]]:
    """The rendered conversation's token ids and, for each, whether it lies inside an
    assistant reply; turn(message) gives the text before the reply and the reply as the
    template writes it, found in order in the rendered text by character offsets."""
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans, start = [], 0
    for message in messages:
        header, closed = turn(message)
        at = text.index(header + closed, start) + len(header)
        if message["role"] == "assistant":
            spans.append((at, at + len(closed)))
        start = at + len(closed)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    inside = [any(a <= s and e <= b for a, b in spans) for s, e in encoded["offset_mapping"]]
    return encoded["input_ids"], inside


def test_responses_only_keeps_exactly_the_assistant_replies(tokenizer):
    from transformers import DataCollatorWithPadding

    expected = [_reply_tokens(tokenizer, messages) for messages in CONVERSATIONS]
    trainer = types.SimpleNamespace(
        processing_class=tokenizer,
        data_collator=DataCollatorWithPadding(tokenizer),
        train_dataset=None,
        eval_dataset=None,
    )
    train_on_responses_only(trainer)
    batch = trainer.data_collator([{"input_ids": ids} for ids, _ in expected])
    for row, (ids, inside) in enumerate(expected):
        length = len(ids)
        assert batch["input_ids"][row, :length].tolist() == ids
        kept = (batch["labels"][row] != -100).tolist()
        assert kept[:length] == inside and not any(kept[length:])
        replies = [m["content"] + "<|im_end|>\n" for m in CONVERSATIONS[row] if m["role"] == "assistant"]
        assert tokenizer.decode([i for i, k in zip(ids, inside) if k]) == "".join(replies)

    # TRL's assistant_only_loss reads the {% generation %} marks of the installed template:
    # they mark the same tokens.
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the detected format needs no new token and no new EOS
        get_chat_template(tokenizer, "model")
    for messages, (ids, inside) in zip(CONVERSATIONS, expected):
        marked = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        assert marked["input_ids"] == ids
        assert torch.tensor(marked["assistant_masks"]).bool().tolist() == inside


def test_swapped_chatml_markers_are_refused_on_smollm2s_own_template(tokenizer):
    """SmolLM2's own template (untouched) opens user turns with <|im_start|>user and replies
    with <|im_start|>assistant; the markers swapped trained on every user turn, silently."""
    from transformers import DataCollatorWithPadding

    def trainer():
        return types.SimpleNamespace(
            processing_class=tokenizer,
            data_collator=DataCollatorWithPadding(tokenizer),
            train_dataset=None,
            eval_dataset=None,
        )

    user, assistant = "<|im_start|>user\n", "<|im_start|>assistant\n"
    with pytest.raises(ValueError, match=r"instruction_part='<\|im_start\|>assistant\\n' and "
                       r"response_part='<\|im_start\|>user\\n' look swapped"):  # fmt: skip
        train_on_responses_only(trainer(), instruction_part=assistant, response_part=user)
    right = train_on_responses_only(trainer(), instruction_part=user, response_part=assistant)
    ids, inside = _reply_tokens(tokenizer, CONVERSATIONS[0])
    kept = (right.data_collator([{"input_ids": ids}])["labels"][0] != -100).tolist()
    assert kept == inside


def test_the_eos_token_sentinel_keeps_each_real_tokenizers_own_eos(smollm2_path, gemma3_path):
    """Unsloth's notebooks pass (template, "eos_token") to mean the tokenizer's own EOS: the
    template renders that EOS, and no token is added (so no model is needed)."""
    from transformers import AutoTokenizer

    template = "{% for message in messages %}{{ message['content'] }}{{ eos_token }}{% endfor %}"
    conversation = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
    for path, eos in ((smollm2_path, "<|im_end|>"), (gemma3_path, "<eos>")):
        tokenizer = AutoTokenizer.from_pretrained(path)
        size = len(tokenizer)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # nothing added, the EOS unchanged: nothing to warn of
            get_chat_template(tokenizer, (template, "eos_token"))
        assert (tokenizer.eos_token, len(tokenizer)) == (eos, size)
        text = tokenizer.apply_chat_template(conversation, tokenize=False)
        assert text == f"Hi{eos}Yo{eos}"
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert ids.count(tokenizer.eos_token_id) == 2 and max(ids) < size


def test_a_format_whose_markers_the_real_tokenizer_holds_adds_no_token(smollm2_path, gemma3_path):
    """ChatML on SmolLM2 and gemma on Gemma 3 use the tokenizer's own marker tokens: nothing
    is added, so no model is needed and the embeddings keep their size; each marker is one id."""
    from transformers import AutoTokenizer

    for path, name, markers in (
        (smollm2_path, "chatml", ("<|im_start|>", "<|im_end|>")),
        (gemma3_path, "gemma", ("<start_of_turn>", "<end_of_turn>")),
    ):
        tokenizer = AutoTokenizer.from_pretrained(path)
        size, own_ids = len(tokenizer), tokenizer.convert_tokens_to_ids(list(markers))
        get_chat_template(tokenizer, name, model=None)  # would raise if a token had to be added
        assert len(tokenizer) == size and tokenizer.eos_token == markers[1]
        text = tokenizer.apply_chat_template(CONVERSATIONS[0], tokenize=False)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert [ids.count(i) for i in own_ids] == [4, 4]


LLAMA3_USER = "<|start_header_id|>user<|end_header_id|>\n\n"
LLAMA3_ASSISTANT = "<|start_header_id|>assistant<|end_header_id|>\n\n"

# The second conversation in Llama 3's turns on SmolLM2's tokenizer, each turn ended by its
# EOS <|im_end|>: what a named "llama-3.1" format and a custom Llama 3 pair both render.
LLAMA3_TURNS_ENDING_IN_IM_END = (
    "<|start_header_id|>system<|end_header_id|>\n\nAnswer in one word.<|im_end|>"
    + LLAMA3_USER
    + "Colour of the sky?<|im_end|>"
    + LLAMA3_ASSISTANT
    + "Blue<|im_end|>"
)


def test_llama31_on_smollm2_ends_turns_with_its_eos_and_adds_nothing(smollm2_path):
    """Llama 3.1's three turn tokens are not in SmolLM2's vocabulary: the turn end is written
    as SmolLM2's EOS <|im_end|>, the header markers as text in ordinary pieces; the
    vocabulary, the embeddings and the tied head keep their 49,152 rows, generation stops
    at <|im_end|>, and a notice says so once."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from slothkit.core.notices import FallbackWarning, say_once

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32)
    say_once.cache_clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        get_chat_template(tokenizer, "llama-3.1", model=model)
        get_chat_template(tokenizer, "llama-3.1", model=model)  # the notebooks install it twice
    notices = [str(w.message) for w in caught if w.category is FallbackWarning]
    assert notices == [
        "get_chat_template('llama-3'): this tokenizer has no token '<|eot_id|>', so each turn ends with its "
        "EOS '<|im_end|>' (map_eos_token=True); '<|start_header_id|>' and '<|end_header_id|>' stay plain "
        "text, tokenized into ordinary pieces. No token is added and the embeddings keep their size. For "
        "tokens of their own, pass add_missing_tokens=True (the embeddings and head grow, and every save "
        "carries them; train the new rows with modules_to_save=['embed_tokens', 'lm_head'])"
    ]
    assert len(tokenizer) == 49152 and tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    assert model.get_input_embeddings().weight.shape[0] == 49152
    assert model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    assert model.generation_config.eos_token_id in (2, [2])

    text = tokenizer.apply_chat_template(CONVERSATIONS[1], tokenize=False)
    assert text == LLAMA3_TURNS_ENDING_IN_IM_END
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids.count(2) == 3 and max(ids) < 49152
    header = tokenizer.tokenize("<|start_header_id|>")
    assert header == ["<", "|", "start", "_", "header", "_", "id", "|", ">"]  # ordinary pieces


def test_llama31_on_smollm2_with_added_tokens_grows_the_model(smollm2_path):
    """add_missing_tokens=True: the three markers become tokens 49152 to 49154, the EOS is
    <|eot_id|>, and the embeddings and the tied head grow to 49,155 rows."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32)
    with pytest.warns(UserWarning, match="the embeddings grew from 49152 to 49155 rows"):
        get_chat_template(tokenizer, "llama-3.1", model=model, add_missing_tokens=True)
    added = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    assert tokenizer.convert_tokens_to_ids(added) == [49152, 49153, 49154] and len(tokenizer) == 49155
    assert tokenizer.eos_token == "<|eot_id|>"
    assert model.get_input_embeddings().weight.shape[0] == 49155
    assert model.get_output_embeddings().weight.shape[0] == 49155
    ids = tokenizer.apply_chat_template(CONVERSATIONS[1], tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert [ids.count(i) for i in (49152, 49153, 49154)] == [3, 3, 3]


def _llama3_reply_tokens(tokenizer, messages) -> tuple[list[int], list[bool]]:
    """As _reply_tokens, for Llama 3's layout written with SmolLM2's EOS: each reply (trimmed)
    and its <|im_end|>, found from character offsets in the rendered text."""
    return _tokens_inside_replies(
        tokenizer,
        messages,
        lambda m: (
            f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n",
            m["content"].strip() + "<|im_end|>",
        ),
    )


@pytest.mark.parametrize("markers", ["given", "inferred"])
def test_responses_only_finds_llama3_markers_written_as_text(tokenizer, markers):
    """The header markers are text in SmolLM2's BPE, tokenized into pieces that can merge
    with their neighbours: the masker matches them in context and keeps exactly each reply
    and its <|im_end|> (the reference: character offsets of the rendered text)."""
    from transformers import DataCollatorWithPadding

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the notice of what stays text
        get_chat_template(tokenizer, "llama-3.1")
    conversations = CONVERSATIONS + [
        [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": "(ok) done"},
            {"role": "user", "content": "\nnewline first"},
            {"role": "assistant", "content": "user<|end_header_id|> is text too"},
        ]
    ]
    expected = [_llama3_reply_tokens(tokenizer, messages) for messages in conversations]
    trainer = types.SimpleNamespace(
        processing_class=tokenizer,
        data_collator=DataCollatorWithPadding(tokenizer),
        train_dataset=None,
        eval_dataset=None,
    )
    parts = {"instruction_part": LLAMA3_USER, "response_part": LLAMA3_ASSISTANT} if markers == "given" else {}
    train_on_responses_only(trainer, **parts)
    batch = trainer.data_collator([{"input_ids": ids} for ids, _ in expected])
    for row, (ids, inside) in enumerate(expected):
        length = len(ids)
        assert batch["input_ids"][row, :length].tolist() == ids
        kept = (batch["labels"][row] != -100).tolist()
        assert kept[:length] == inside and not any(kept[length:])
        replies = [
            m["content"].strip() + "<|im_end|>" for m in conversations[row] if m["role"] == "assistant"
        ]
        assert tokenizer.decode([i for i, k in zip(ids, inside) if k]) == "".join(replies)
    # TRL's assistant_only_loss reads the {% generation %} marks: they mark the same tokens.
    for messages, (ids, inside) in zip(conversations, expected):
        marked = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        assert marked["input_ids"] == ids
        assert torch.tensor(marked["assistant_masks"]).bool().tolist() == inside


# Llama 3's layout as a custom (template, "<|eot_id|>") pair, as a notebook may write it.
LLAMA3_CUSTOM_TEMPLATE = (
    "{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n{{ message['content'] | trim }}<|eot_id|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def test_a_custom_llama3_pair_on_smollm2_ends_turns_with_its_eos_and_adds_nothing(tokenizer):
    """SmolLM2 lacks <|eot_id|>: the custom template writes <|im_end|> in its place, the
    vocabulary keeps its 49,152 ids, no model is needed, a notice says so once, and
    train_on_responses_only keeps exactly each reply and its <|im_end|>."""
    from transformers import DataCollatorWithPadding

    from slothkit.core.notices import FallbackWarning, say_once

    say_once.cache_clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        get_chat_template(tokenizer, (LLAMA3_CUSTOM_TEMPLATE, "<|eot_id|>"))
        get_chat_template(tokenizer, (LLAMA3_CUSTOM_TEMPLATE, "<|eot_id|>"))
    notices = [str(w.message) for w in caught if w.category is FallbackWarning]
    assert len(notices) == 1 and notices[0].startswith(
        "get_chat_template((template, '<|eot_id|>')): this tokenizer has no token '<|eot_id|>', so each "
        "turn ends with its EOS '<|im_end|>' (map_eos_token=True). No token is added"
    )
    assert "pass add_missing_tokens=True" in notices[0]
    assert [w for w in caught if w.category is not FallbackWarning] == []
    assert (len(tokenizer), tokenizer.eos_token, tokenizer.eos_token_id) == (49152, "<|im_end|>", 2)
    text = tokenizer.apply_chat_template(CONVERSATIONS[1], tokenize=False)
    assert text == LLAMA3_TURNS_ENDING_IN_IM_END
    assert tokenizer(text, add_special_tokens=False)["input_ids"].count(2) == 3

    expected = [_llama3_reply_tokens(tokenizer, messages) for messages in CONVERSATIONS]
    trainer = types.SimpleNamespace(
        processing_class=tokenizer,
        data_collator=DataCollatorWithPadding(tokenizer),
        train_dataset=None,
        eval_dataset=None,
    )
    train_on_responses_only(trainer, instruction_part=LLAMA3_USER, response_part=LLAMA3_ASSISTANT)
    batch = trainer.data_collator([{"input_ids": ids} for ids, _ in expected])
    for row, (ids, inside) in enumerate(expected):
        kept = (batch["labels"][row] != -100).tolist()
        assert batch["input_ids"][row, : len(ids)].tolist() == ids
        assert kept[: len(ids)] == inside and not any(kept[len(ids) :])
        replies = [
            m["content"].strip() + "<|im_end|>" for m in CONVERSATIONS[row] if m["role"] == "assistant"
        ]
        assert tokenizer.decode([i for i, k in zip(ids, inside) if k]) == "".join(replies)


def _responses_only_mask(tokenizer, messages) -> tuple[list[int], list[bool]]:
    """The ids of the rendered conversation and which of them train_on_responses_only keeps,
    with the markers it infers from the installed template."""
    from transformers import DataCollatorWithPadding

    ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    trainer = types.SimpleNamespace(
        processing_class=tokenizer,
        data_collator=DataCollatorWithPadding(tokenizer),
        train_dataset=None,
        eval_dataset=None,
    )
    train_on_responses_only(trainer)
    labels = trainer.data_collator([{"input_ids": ids}])["labels"][0]
    return ids, (labels != -100).tolist()


def test_qwen3_thinking_on_qwens_own_tokenizer(qwen_tokenizer_path):
    """Qwen3 Thinking-2507's format on Qwen's real tokenizer (its <|im_start|>/<|im_end|>
    markers are single tokens there): the reasoning of the last answer kept, the generation
    prompt opening <think>, and train_on_responses_only keeping exactly the tokens the
    template marks as the assistant's."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(qwen_tokenizer_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # what the format's markers are in this vocabulary
        get_chat_template(tokenizer, "qwen3-thinking")
    conversation = [
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "<think>\nTwo and two.\n</think>\n\n4"},
    ]
    text = tokenizer.apply_chat_template(conversation, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n<think>\nTwo and two.\n</think>\n\n4<|im_end|>\n")
    prompt = tokenizer.apply_chat_template(conversation[:1], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n")
    for messages in (conversation, CONVERSATIONS[0]):
        marked = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        ids, kept = _responses_only_mask(tokenizer, messages)
        assert ids == marked["input_ids"] and kept == [bool(m) for m in marked["assistant_masks"]]


def test_a_prompt_template_on_smollm2(tokenizer):
    """A {SYSTEM}/{INPUT}/{OUTPUT} prompt (Unsloth's Ollama notebooks) on SmolLM2's real
    tokenizer: multi-turn text, its tokens, and the replies train_on_responses_only keeps
    are exactly those the template marks."""
    from slothkit.data.conversations import install_prompt_template

    install_prompt_template(tokenizer, "{SYSTEM}\n### Question:\n{INPUT}\n### Answer:\n{OUTPUT}", "Be brief.")
    for messages in CONVERSATIONS:
        marked = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        ids, kept = _responses_only_mask(tokenizer, messages)
        assert ids == marked["input_ids"] and kept == [bool(m) for m in marked["assistant_masks"]]
        replies = [m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant"]
        assert tokenizer.decode([i for i, k in zip(ids, kept) if k]) == "".join(replies)
    assert tokenizer.apply_chat_template(CONVERSATIONS[1], tokenize=False).startswith(
        "Answer in one word.\n### Question:\nColour of the sky?\n### Answer:\n Blue<|im_end|>"
    )
