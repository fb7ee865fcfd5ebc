"""Chat templates render each format's text exactly, tokenize with one BOS, mark the
assistant replies for TRL, and end replies with the token generation stops on."""

import datetime
import os
import warnings

import pytest
import torch
from transformers import AutoTokenizer

from slothkit.data import FORMATS, conversation_text, get_chat_template
from slothkit.data.chat_formats import DEFAULT_MAPPING, format_of_template, jinja_string
from slothkit.data.chat_templates import matching_format
from slothkit.testing import tiny_model_path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

B, E = "<|begin_of_text|>", "<|end_of_text|>"  # the tiny Llama tokenizer's BOS and EOS
VICUNA_SYSTEM = (
    "A chat between a curious user and an artificial intelligence assistant. "
    "The assistant gives helpful, detailed, and polite answers to the user's questions."
)
ALPACA_SYSTEM = "Below is an instruction that describes a task. Write a response that appropriately completes the request."

TWO_EXCHANGES = [
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4"},
]
WITH_SYSTEM = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "Blue."},
]
PROMPT = [{"role": "user", "content": "Name a colour."}]

# (two exchanges, with a system message, generation prompt), written out from each format's spec.
GOLDEN = {
    "chatml": (
        B + "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n",
        B + "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nName a colour.<|im_end|>\n"
        "<|im_start|>assistant\nBlue.<|im_end|>\n",
        B + "<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\n",
    ),
    "vicuna": (
        B + VICUNA_SYSTEM + " USER: Hi there ASSISTANT: Hello!" + E + "USER: What is 2 + 2? ASSISTANT: 4" + E,
        B + "Be brief. USER: Name a colour. ASSISTANT: Blue." + E,
        B + VICUNA_SYSTEM + " USER: Name a colour. ASSISTANT:",
    ),
    "zephyr": (
        B
        + "<|user|>\nHi there"
        + E
        + "\n<|assistant|>\nHello!"
        + E
        + "\n<|user|>\nWhat is 2 + 2?"
        + E
        + "\n<|assistant|>\n4"
        + E
        + "\n",
        B
        + "<|system|>\nBe brief."
        + E
        + "\n<|user|>\nName a colour."
        + E
        + "\n<|assistant|>\nBlue."
        + E
        + "\n",
        B + "<|user|>\nName a colour." + E + "\n<|assistant|>\n",
    ),
    "alpaca": (
        B
        + ALPACA_SYSTEM
        + "\n\n### Instruction:\nHi there\n\n### Response:\nHello!"
        + E
        + "\n\n### Instruction:\nWhat is 2 + 2?\n\n### Response:\n4"
        + E
        + "\n\n",
        B + "Be brief.\n\n### Instruction:\nName a colour.\n\n### Response:\nBlue." + E + "\n\n",
        B + ALPACA_SYSTEM + "\n\n### Instruction:\nName a colour.\n\n### Response:\n",
    ),
    "llama-3": (
        B + "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhat is 2 + 2?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n4<|eot_id|>",
        B + "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nName a colour.<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nBlue.<|eot_id|>",
        B + "<|start_header_id|>user<|end_header_id|>\n\nName a colour.<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
    ),
    "gemma": (
        B + "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n"
        "<start_of_turn>user\nWhat is 2 + 2?<end_of_turn>\n<start_of_turn>model\n4<end_of_turn>\n",
        B
        + "<start_of_turn>user\nBe brief.\n\nName a colour.<end_of_turn>\n<start_of_turn>model\nBlue.<end_of_turn>\n",
        B + "<start_of_turn>user\nName a colour.<end_of_turn>\n<start_of_turn>model\n",
    ),
    "mistral": (
        B + "[INST] Hi there [/INST] Hello!" + E + "[INST] What is 2 + 2? [/INST] 4" + E,
        B + "[INST] Be brief.\n\nName a colour. [/INST] Blue." + E,
        B + "[INST] Name a colour. [/INST]",
    ),
}

QWEN_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
# gpt-oss (harmony): its own system message, dated today, opens every conversation.
HARMONY_SYSTEM = (
    "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
    f"Knowledge cutoff: 2024-06\nCurrent date: {datetime.date.today().isoformat()}\n\nReasoning: medium\n\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>"
)
VICUNA_OLD_SYSTEM = (
    "A chat between a curious human and an artificial intelligence assistant. "
    "The assistant gives helpful, detailed, and polite answers to the human's questions."
)
GOLDEN.update(
    {
        "llama-2": (
            B + "[INST] Hi there [/INST] Hello! " + E + B + "[INST] What is 2 + 2? [/INST] 4 " + E,
            B + "[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nName a colour. [/INST] Blue. " + E,
            B + "[INST] Name a colour. [/INST]",
        ),
        "qwen-2.5": (
            B + f"<|im_start|>system\n{QWEN_SYSTEM}<|im_end|>\n" + GOLDEN["chatml"][0].removeprefix(B),
            GOLDEN["chatml"][1],
            B + f"<|im_start|>system\n{QWEN_SYSTEM}<|im_end|>\n" + GOLDEN["chatml"][2].removeprefix(B),
        ),
        # Qwen3: the answer after the last user turn opens with an empty thinking block.
        "qwen3": (
            GOLDEN["chatml"][0].replace("assistant\n4", "assistant\n<think>\n\n</think>\n\n4"),
            GOLDEN["chatml"][1].replace("assistant\nBlue", "assistant\n<think>\n\n</think>\n\nBlue"),
            GOLDEN["chatml"][2],
        ),
        # Qwen3 Thinking-2507: as qwen3, and the generation prompt opens the thinking block.
        "qwen3-thinking": (
            GOLDEN["chatml"][0].replace("assistant\n4", "assistant\n<think>\n\n</think>\n\n4"),
            GOLDEN["chatml"][1].replace("assistant\nBlue", "assistant\n<think>\n\n</think>\n\nBlue"),
            GOLDEN["chatml"][2] + "<think>\n",
        ),
        "phi-3": (
            B + "<|user|>\nHi there<|end|>\n<|assistant|>\nHello!<|end|>\n"
            "<|user|>\nWhat is 2 + 2?<|end|>\n<|assistant|>\n4<|end|>\n",
            B
            + "<|system|>\nBe brief.<|end|>\n<|user|>\nName a colour.<|end|>\n<|assistant|>\nBlue.<|end|>\n",
            B + "<|user|>\nName a colour.<|end|>\n<|assistant|>\n",
        ),
        "phi-4": (
            B + "<|im_start|>user<|im_sep|>Hi there<|im_end|><|im_start|>assistant<|im_sep|>Hello!<|im_end|>"
            "<|im_start|>user<|im_sep|>What is 2 + 2?<|im_end|><|im_start|>assistant<|im_sep|>4<|im_end|>",
            B
            + "<|im_start|>system<|im_sep|>Be brief.<|im_end|><|im_start|>user<|im_sep|>Name a colour.<|im_end|>"
            "<|im_start|>assistant<|im_sep|>Blue.<|im_end|>",
            B + "<|im_start|>user<|im_sep|>Name a colour.<|im_end|><|im_start|>assistant<|im_sep|>",
        ),
        "vicuna_old": (
            B + VICUNA_OLD_SYSTEM + "\n### Human: Hi there\n### Assistant: Hello!" + E + "\n"
            "### Human: What is 2 + 2?\n### Assistant: 4" + E + "\n",
            B + "Be brief.\n### Human: Name a colour.\n### Assistant: Blue." + E + "\n",
            B + VICUNA_OLD_SYSTEM + "\n### Human: Name a colour.\n### Assistant:",
        ),
        # The last answer of a training text ends with <|return|>, earlier ones with <|end|>.
        "gpt-oss": (
            B + HARMONY_SYSTEM + "<|start|>user<|message|>Hi there<|end|>"
            "<|start|>assistant<|channel|>final<|message|>Hello!<|end|><|start|>user<|message|>What is 2 + 2?<|end|>"
            "<|start|>assistant<|channel|>final<|message|>4<|return|>",
            B + HARMONY_SYSTEM + "<|start|>developer<|message|># Instructions\n\nBe brief.\n\n<|end|>"
            "<|start|>user<|message|>Name a colour.<|end|><|start|>assistant<|channel|>final<|message|>Blue.<|return|>",
            B + HARMONY_SYSTEM + "<|start|>user<|message|>Name a colour.<|end|><|start|>assistant",
        ),
    }
)

# Qwen3.5 writes these as Qwen3 Thinking does (no spaces around the texts, no switch passed).
GOLDEN["qwen3.5"] = GOLDEN["qwen3-thinking"]
GOLDEN["gemma-4"] = (
    B + "<|turn>user\nHi there<turn|>\n<|turn>model\nHello!<turn|>\n"
    "<|turn>user\nWhat is 2 + 2?<turn|>\n<|turn>model\n4<turn|>\n",
    B + "<|turn>system\nBe brief.<turn|>\n<|turn>user\nName a colour.<turn|>\n<|turn>model\nBlue.<turn|>\n",
    B + "<|turn>user\nName a colour.<turn|>\n<|turn>model\n",
)

# What the assistant masks keep of TWO_EXCHANGES: each reply, its end token and separator.
KEPT = {
    "chatml": "Hello!<|im_end|>\n4<|im_end|>\n",
    "vicuna": " Hello!" + E + " 4" + E,
    "zephyr": "Hello!" + E + "\n4" + E + "\n",
    "alpaca": "Hello!" + E + "\n\n4" + E + "\n\n",
    "llama-3": "Hello!<|eot_id|>4<|eot_id|>",
    "gemma": "Hello!<end_of_turn>\n4<end_of_turn>\n",
    "mistral": " Hello!" + E + " 4" + E,
    "llama-2": " Hello! " + E + " 4 " + E,
    "qwen-2.5": "Hello!<|im_end|>\n4<|im_end|>\n",
    "qwen3": "Hello!<|im_end|>\n<think>\n\n</think>\n\n4<|im_end|>\n",
    "qwen3-thinking": "Hello!<|im_end|>\n<think>\n\n</think>\n\n4<|im_end|>\n",
    "qwen3.5": "Hello!<|im_end|>\n<think>\n\n</think>\n\n4<|im_end|>\n",
    "gemma-4": "Hello!<turn|>\n4<turn|>\n",
    "phi-3": "Hello!<|end|>\n4<|end|>\n",
    "phi-4": "Hello!<|im_end|>4<|im_end|>",
    "vicuna_old": " Hello!" + E + "\n 4" + E + "\n",
    "gpt-oss": "<|channel|>final<|message|>Hello!<|end|><|channel|>final<|message|>4<|return|>",
}


def _tokenizer(arch="llama", **kwargs):
    return AutoTokenizer.from_pretrained(str(tiny_model_path(arch)), **kwargs)


def _model(arch="llama"):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_model_path(arch)), dtype=torch.float32)


def _templated(name, arch="llama", **kwargs):
    # Each format as its own tokenizers hold it: the markers the tiny tokenizer lacks are
    # added (with a model whose embeddings follow); the default, which adds none, is
    # covered below.
    tokenizer = _tokenizer(arch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the embeddings-grew notice
        return get_chat_template(tokenizer, name, model=_model(arch), add_missing_tokens=True, **kwargs)


def _ids(encoded):
    return encoded["input_ids"] if hasattr(encoded, "keys") else encoded


def test_qwen3_thinking_switch_and_an_answer_with_its_own_reasoning():
    tokenizer = _templated("qwen3")
    no_thinking = tokenizer.apply_chat_template(
        PROMPT, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert no_thinking == GOLDEN["qwen3"][2] + "<think>\n\n</think>\n\n"
    reasoned = [*PROMPT, {"role": "assistant", "content": "<think>\nA primary one.\n</think>\n\nBlue."}]
    assert tokenizer.apply_chat_template(reasoned, tokenize=False).endswith(
        "<|im_start|>assistant\n<think>\nA primary one.\n</think>\n\nBlue.<|im_end|>\n"
    )


def test_qwen3_thinking_splits_the_reasoning_and_always_opens_the_block():
    tokenizer = _templated("qwen3-thinking")
    for enable_thinking in (True, False):  # no effect
        prompt = tokenizer.apply_chat_template(
            PROMPT, tokenize=False, add_generation_prompt=True, enable_thinking=enable_thinking
        )
        assert prompt == GOLDEN["qwen3-thinking"][2]
    reasoned = [
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "<think>\nGreet back.\n</think>\n\nHello!"},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "<think>\n\nTwo and two.\n\n</think>\n\n\n4"},
    ]
    # The past answer loses its reasoning; the last keeps it, its newlines as Qwen writes them.
    assert tokenizer.apply_chat_template(reasoned, tokenize=False) == GOLDEN["qwen3-thinking"][0].replace(
        "<think>\n\n</think>", "<think>\nTwo and two.\n</think>"
    )
    # Unsloth's "qwen3-instruct" (Instruct-2507) is ChatML.
    assert (
        _templated("qwen3-instruct").apply_chat_template(TWO_EXCHANGES, tokenize=False) == GOLDEN["chatml"][0]
    )


def test_every_format_has_golden_strings():
    assert set(GOLDEN) == set(FORMATS) == set(KEPT)


@pytest.mark.parametrize("name", list(GOLDEN))
def test_renders_golden_strings(name):
    tokenizer = _templated(name)
    two, system, prompt = GOLDEN[name]
    assert tokenizer.apply_chat_template(TWO_EXCHANGES, tokenize=False) == two
    assert tokenizer.apply_chat_template(WITH_SYSTEM, tokenize=False) == system
    assert tokenizer.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True) == prompt
    assert format_of_template(tokenizer.chat_template).name == name


def _as_parts(text: str) -> list[dict]:
    """Content as transformers' multimodal chat messages write it: typed parts, here the
    text cut in two."""
    half = len(text) // 2
    return [{"type": "text", "text": text[:half]}, {"type": "text", "text": text[half:]}]


@pytest.mark.parametrize("name", list(GOLDEN))
def test_content_given_as_text_parts_renders_as_the_text(name):
    """Unsloth's Gemma 3 notebooks write each message's content as a list of typed parts."""
    tokenizer = _templated(name)
    two, system, prompt = GOLDEN[name]
    as_parts = [{**m, "content": _as_parts(m["content"])} for m in WITH_SYSTEM]
    assert tokenizer.apply_chat_template(as_parts, tokenize=False) == system
    as_parts = [{**m, "content": _as_parts(m["content"])} for m in PROMPT]
    assert tokenizer.apply_chat_template(as_parts, tokenize=False, add_generation_prompt=True) == prompt
    image = [
        {"role": "user", "content": [{"type": "image", "url": "cat.png"}, {"type": "text", "text": "What?"}]}
    ]
    with pytest.raises(Exception, match="part of type image cannot be rendered; slothkit trains text models"):
        tokenizer.apply_chat_template(image, tokenize=False)


@pytest.mark.parametrize("name", list(GOLDEN))
def test_assistant_masks_keep_the_replies(name):
    tokenizer = _templated(name)
    encoded = tokenizer.apply_chat_template(
        TWO_EXCHANGES, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    kept = [t for t, m in zip(encoded["input_ids"], encoded["assistant_masks"]) if m]
    assert tokenizer.decode(kept) == KEPT[name]


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma"])
@pytest.mark.parametrize("name", list(GOLDEN))
def test_one_bos_on_both_tokenization_paths(name, arch):
    tokenizer = _templated(name, arch)
    bos = tokenizer.bos_token_id
    chat_ids = _ids(tokenizer.apply_chat_template(WITH_SYSTEM, tokenize=True))
    text = conversation_text(tokenizer, WITH_SYSTEM)
    text_ids = tokenizer(text)["input_ids"]
    assert chat_ids[0] == bos and chat_ids.count(bos) == 1
    assert text_ids[0] == bos and text_ids.count(bos) == 1
    assert not text.startswith(tokenizer.bos_token)
    # Both paths spell the same text; the text ends on the reply's end token.
    rendered = tokenizer.apply_chat_template(WITH_SYSTEM, tokenize=False)
    assert tokenizer.bos_token + text == rendered.rstrip()
    assert tokenizer.decode(text_ids[1:], skip_special_tokens=False) == text
    assert text_ids[-1] == tokenizer.eos_token_id  # map_eos_token: the turn end is the EOS


def test_no_bos_when_the_tokenizer_adds_none():
    tokenizer = _tokenizer(add_bos_token=False)
    assert tokenizer("a")["input_ids"][0] != tokenizer.bos_token_id
    with pytest.warns(UserWarning, match="ends turns with EOS '<\\|eot_id\\|>'; pass model="):
        get_chat_template(tokenizer, "llama-3")
    assert tokenizer.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True) == (
        GOLDEN["llama-3"][2].removeprefix(B)
    )


# The tiny Llama tokenizer holds Llama 3's markers only: added, ChatML's and Gemma's turn
# ends are tokens of their own; by default they are its EOS, <|end_of_text|>.
@pytest.mark.parametrize(
    "name, add_missing_tokens, turn_end",
    [
        ("chatml", True, "<|im_end|>"),
        ("chatml", None, E),
        ("llama-3", None, "<|eot_id|>"),
        ("gemma", True, "<end_of_turn>"),
        ("gemma", None, E),
        ("mistral", None, E),
    ],
)
def test_turn_end_becomes_eos_and_generation_stops_there(name, add_missing_tokens, turn_end):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_path("llama")), dtype=torch.float32)
    tokenizer = _tokenizer()
    rows, size = model.get_input_embeddings().weight.shape[0], len(tokenizer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the notice of what stays text
        get_chat_template(tokenizer, name, model=model, add_missing_tokens=add_missing_tokens)
    turn_end_id = tokenizer.convert_tokens_to_ids(turn_end)
    assert tokenizer.eos_token == turn_end
    stop_ids = model.generation_config.eos_token_id
    stop_ids = [stop_ids] if isinstance(stop_ids, int) else stop_ids
    assert stop_ids[0] == turn_end_id
    assert model.get_input_embeddings().weight.shape[0] == max(rows, len(tokenizer))
    assert (len(tokenizer) > size) == (add_missing_tokens is True)
    assert len(tokenizer.tokenize(turn_end)) == 1  # a single token, never split

    # Force a reply of three tokens then the turn end, then more: generate must stop at it.
    forced = [300, 301, 302, turn_end_id, 303, 304]

    class Force:
        def __call__(self, input_ids, scores):
            step = input_ids.shape[1] - prompt.shape[1]
            scores = torch.full_like(scores, -1e9)
            scores[:, forced[step]] = 0.0
            return scores

    prompt = _ids(tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt"))
    output = model.generate(prompt, max_new_tokens=6, do_sample=False, logits_processor=[Force()])
    assert output[0, prompt.shape[1] :].tolist() == forced[:4]


def test_added_tokens_grow_the_embeddings_and_warn():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_path("mistral")), dtype=torch.float32)
    tokenizer = _tokenizer("mistral")
    model.resize_token_embeddings(len(tokenizer))  # no spare rows: new tokens need new ones
    size = len(tokenizer)
    with pytest.warns(UserWarning, match="embeddings grew"):
        get_chat_template(tokenizer, "llama-3", model=model, add_missing_tokens=True)
    assert len(tokenizer) == size + 3 and model.get_input_embeddings().weight.shape[0] == len(tokenizer)
    for token in FORMATS["llama-3"].special_tokens:
        assert len(tokenizer.tokenize(token)) == 1
    # Without a model the tokens are refused rather than added past the embeddings.
    tokenizer = _tokenizer("mistral")
    with pytest.raises(
        ValueError,
        match="needs the tokens \\['<\\|im_start\\|>', '<\\|im_end\\|>'\\], which this tokenizer lacks "
        "\\(add_missing_tokens=True\\): pass model=",
    ):
        get_chat_template(tokenizer, "chatml", add_missing_tokens=True)
    assert "<|im_start|>" not in tokenizer.get_vocab()


# The formats whose turn ends with a token of its own, on the tiny Mistral tokenizer, which
# holds none of them (its BOS <s>, its EOS </s>).
OWN_TURN_END = [name for name, fmt in FORMATS.items() if fmt.turn_end is not None]


@pytest.mark.parametrize("name", OWN_TURN_END)
def test_a_turn_end_the_tokenizer_lacks_is_written_as_its_eos(name):
    """By default nothing is added: the golden text with the turn end replaced by the
    tokenizer's EOS, the other markers as text; the assistant masks keep each reply and its
    EOS; the notice is given once."""
    from slothkit.core.notices import FallbackWarning, say_once

    say_once.cache_clear()
    tokenizer = _tokenizer("mistral")
    size, turn_end = len(tokenizer), FORMATS[name].turn_end
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        get_chat_template(tokenizer, name)  # no model needed: nothing is added
        get_chat_template(tokenizer, name)
    notices = [str(w.message) for w in caught if w.category is FallbackWarning]
    assert len(notices) == 1 and f"no token {turn_end!r}, so each turn ends with its EOS '</s>'" in notices[0]
    assert [str(w.message) for w in caught if w.category is not FallbackWarning] == []
    assert len(tokenizer) == size and tokenizer.eos_token == "</s>"

    def mapped(text):
        return text.replace(B, "<s>").replace(turn_end, "</s>")

    two, system, prompt = GOLDEN[name]
    assert tokenizer.apply_chat_template(TWO_EXCHANGES, tokenize=False) == mapped(two)
    assert tokenizer.apply_chat_template(WITH_SYSTEM, tokenize=False) == mapped(system)
    assert tokenizer.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True) == mapped(prompt)
    assert format_of_template(tokenizer.chat_template).name == name
    encoded = tokenizer.apply_chat_template(
        TWO_EXCHANGES, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    assert max(encoded["input_ids"]) < size
    kept = [t for t, m in zip(encoded["input_ids"], encoded["assistant_masks"]) if m]
    assert tokenizer.decode(kept) == mapped(KEPT[name])


def test_a_turn_end_written_as_an_eos_with_quotes_stays_one_literal():
    from slothkit.data.chat_formats import template_source, with_turn_end

    fmt = with_turn_end(FORMATS["chatml"], "<it's \\end>")
    source = template_source(fmt, mapping=dict(DEFAULT_MAPPING), system_message=None, use_bos=False)
    text = _tokenizer().apply_chat_template(TWO_EXCHANGES, chat_template=source, tokenize=False)
    assert text == GOLDEN["chatml"][0].removeprefix(B).replace("<|im_end|>", "<it's \\end>")


def test_map_eos_token_false_adds_a_missing_turn_end_and_add_missing_tokens_false_refuses():
    """A turn end that is not the EOS must be a token generation can stop on: with
    map_eos_token=False the missing markers are added (a model is needed), and
    add_missing_tokens=False, which would leave it text, is refused."""
    tokenizer, model = _tokenizer("mistral"), _model("mistral")
    size = len(tokenizer)
    with pytest.raises(
        ValueError, match="lacks \\(map_eos_token=False, so the turn end must be a token of its own"
    ):
        get_chat_template(_tokenizer("mistral"), "llama-3", map_eos_token=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the embeddings-grew notice
        get_chat_template(tokenizer, "llama-3", map_eos_token=False, model=model)
    assert len(tokenizer) == size + 3 and tokenizer.eos_token == "</s>"
    assert model.generation_config.eos_token_id[0] == tokenizer.convert_tokens_to_ids("<|eot_id|>")
    assert tokenizer.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True) == (
        GOLDEN["llama-3"][2].replace(B, "<s>")
    )
    with pytest.raises(ValueError, match="map_eos_token=False: as text the turn end is no token"):
        get_chat_template(_tokenizer("mistral"), "llama-3", map_eos_token=False, add_missing_tokens=False)
    with pytest.raises(TypeError, match="add_missing_tokens must be True, False or None; got 'yes'"):
        get_chat_template(_tokenizer("mistral"), "llama-3", add_missing_tokens="yes")
    template = ("{% for m in messages %}{{ m['content'] }}<|eot_id|>{% endfor %}", "<|eot_id|>")
    with pytest.raises(
        ValueError, match="ends turns with '<\\|eot_id\\|>', which this tokenizer lacks, add_missing_tokens=F"
    ):
        get_chat_template(_tokenizer("mistral"), template, map_eos_token=False, add_missing_tokens=False)


# A custom template that writes its turn end <|eot_id|> as plain text and inside a string
# literal, and names it in a comment and in a variable the mapping must leave alone.
CUSTOM_TEMPLATE = (
    "{#- each turn ends with <|eot_id|> -#}\n"
    "{%- set eot_id = '<|eot_id|>' -%}\n"
    "{%- for message in messages -%}\n"
    "    {%- if message['role'] == 'user' -%}\n"
    "        {{- 'User: ' + message['content'] + eot_id }}\n"
    "    {%- else -%}\n"
    "        Bot: {{ message['content'] }}<|eot_id|>\n"
    "    {%- endif -%}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt %}Bot: {% endif -%}"
)
CUSTOM_CONVERSATION = [
    {"role": "user", "content": "Hi <|eot_id|> there"},  # a message's own text stays as it is
    {"role": "assistant", "content": "Yo"},
]


def test_a_custom_pairs_turn_end_the_tokenizer_lacks_is_written_as_its_eos():
    """As for a named format: the template writes the tokenizer's EOS where it wrote the
    token, nothing is added (no model needed) and a notice says so once; with
    add_missing_tokens=True or map_eos_token=False the token is added instead."""
    from slothkit.core.notices import FallbackWarning, say_once

    say_once.cache_clear()
    tokenizer = _tokenizer("mistral")
    size = len(tokenizer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        get_chat_template(tokenizer, (CUSTOM_TEMPLATE, "<|eot_id|>"))
        get_chat_template(tokenizer, (CUSTOM_TEMPLATE, "<|eot_id|>"))
    assert [str(w.message) for w in caught if w.category is FallbackWarning] == [
        "get_chat_template((template, '<|eot_id|>')): this tokenizer has no token '<|eot_id|>', so each turn "
        "ends with its EOS '</s>' (map_eos_token=True). No token is added and the embeddings keep their "
        "size. For a token of its own, pass add_missing_tokens=True (the embeddings and head grow, and "
        "every save carries them; train the new row with modules_to_save=['embed_tokens', 'lm_head'])"
    ]
    assert [w for w in caught if w.category is not FallbackWarning] == []
    assert (len(tokenizer), tokenizer.eos_token) == (size, "</s>")
    text = tokenizer.apply_chat_template(CUSTOM_CONVERSATION, tokenize=False, add_generation_prompt=True)
    assert text == "User: Hi <|eot_id|> there</s>Bot: Yo</s>Bot: "
    assert tokenizer.chat_template.startswith("{#- each turn ends with <|eot_id|> -#}")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids.count(tokenizer.eos_token_id) == 2 and max(ids) < size

    for options in ({"add_missing_tokens": True}, {"map_eos_token": False}):
        tokenizer, model = _tokenizer("mistral"), _model("mistral")
        with pytest.raises(ValueError, match="pass model="):
            get_chat_template(tokenizer, (CUSTOM_TEMPLATE, "<|eot_id|>"), **options)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the embeddings-grew notice
            get_chat_template(tokenizer, (CUSTOM_TEMPLATE, "<|eot_id|>"), model=model, **options)
        eot = tokenizer.convert_tokens_to_ids("<|eot_id|>")
        assert (len(tokenizer), eot) == (size + 1, size)
        assert model.generation_config.eos_token_id[0] == eot
        assert tokenizer.apply_chat_template(CUSTOM_CONVERSATION, tokenize=False) == (
            "User: Hi <|eot_id|> there<|eot_id|>Bot: Yo<|eot_id|>"
        )


def test_replacing_written_text_leaves_comments_names_and_tags_alone():
    """Only what the template writes changes: its text, raw blocks and string literals,
    with quotes, backslashes and tag characters in the new text kept literal."""
    import jinja2

    from slothkit.data.template_text import replace_written_text

    source = (
        "{#- END -#}{%- set END = 'x END' -%}\n  {{- END }}|END|{{ \"a'END\" }}"
        "{% raw %}END{{ }}{% endraw %}{{ 'q\\'END' }}{{ 'END' if END }}"
    )
    new = "<it's {e}\\>"
    rewritten = replace_written_text(source, "END", new)
    assert rewritten.startswith("{#- END -#}{%- set END = ")
    assert jinja2.Environment().from_string(source).render() == "x END|END|a'ENDEND{{ }}q'ENDEND"
    assert jinja2.Environment().from_string(rewritten).render() == ("x N|N|a'NN{{ }}q'NN".replace("N", new))
    assert replace_written_text(source, "absent", new) == source


def test_mapping_reads_sharegpt_records_directly():
    tokenizer = _templated(
        "llama-3", mapping={"role": "from", "content": "value", "user": "human", "assistant": "gpt"}
    )
    sharegpt = [
        {"from": "human" if m["role"] == "user" else "gpt", "value": m["content"]} for m in TWO_EXCHANGES
    ]
    assert tokenizer.apply_chat_template(sharegpt, tokenize=False) == GOLDEN["llama-3"][0]
    assert conversation_text(tokenizer, sharegpt) == GOLDEN["llama-3"][0].removeprefix(B)


def test_system_message_default_override_and_escaping():
    text = 'Say "hi" {{ not jinja }} {% raw %} 100% \\ @ROLES@ ünïcode 🦥\nsecond line'
    tokenizer = _templated("chatml", system_message=text)
    rendered = tokenizer.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True)
    assert rendered == B + f"<|im_start|>system\n{text}<|im_end|>\n" + GOLDEN["chatml"][2].removeprefix(B)
    # A conversation's own system message wins over the default.
    assert tokenizer.apply_chat_template(WITH_SYSTEM, tokenize=False) == GOLDEN["chatml"][1]
    # "" switches vicuna's default system text off.
    vicuna = _templated("vicuna", system_message="")
    assert vicuna.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True) == (
        B + "USER: Name a colour. ASSISTANT:"
    )
    assert jinja_string('a"b') == '"a\\U00000022b"'


@pytest.mark.parametrize("arch, expected", [("llama", "llama-3"), ("mistral", "mistral"), ("gemma", "gemma")])
def test_model_template_is_recognised_and_gains_generation_marks(arch, expected):
    tokenizer = _tokenizer(arch)
    assert "{%- generation" not in tokenizer.chat_template
    assert matching_format(tokenizer).name == expected
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the EOS mapping warning without a model
        get_chat_template(tokenizer, "model")
    assert format_of_template(tokenizer.chat_template).name == expected
    assert "{%- generation -%}" in tokenizer.chat_template


def test_model_template_with_its_own_default_system_text_is_recognised():
    # ChatML as SmolLM2 writes it: a system turn of its own when the conversation has none.
    tokenizer = _templated("chatml")  # gains <|im_start|> and <|im_end|>
    tokenizer.chat_template = (
        "{{ bos_token }}{% for message in messages %}"
        "{% if loop.first and messages[0]['role'] != 'system' %}"
        "{{ '<|im_start|>system\\nYou are a patient sloth, 3 toes.<|im_end|>\\n' }}{% endif %}"
        "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    own = tokenizer.chat_template
    fmt = matching_format(tokenizer)
    assert fmt.name == "chatml" and fmt.default_system == "You are a patient sloth, 3 toes."
    get_chat_template(tokenizer, "model")
    assert format_of_template(tokenizer.chat_template).name == "chatml"
    for messages, prompt in ((TWO_EXCHANGES, False), (WITH_SYSTEM, False), (PROMPT, True)):
        expected = tokenizer.apply_chat_template(
            messages, chat_template=own, tokenize=False, add_generation_prompt=prompt
        )
        assert (
            tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt) == expected
        )
    # A template whose own system text is not where the format puts one matches nothing.
    tokenizer.chat_template = own.replace("<|im_start|>system\\n", "<|im_start|>system:")
    assert matching_format(tokenizer) is None


def test_model_template_without_a_match_is_kept():
    tokenizer = _tokenizer()
    own = (
        "{% for m in messages %}<|start_header_id|>{{ m['role'] }}: {{ m['content'] }}<|eot_id|>{% endfor %}"
    )
    tokenizer.chat_template = own
    tokenizer.eos_token = B
    with pytest.warns(UserWarning, match="pass model="):
        get_chat_template(tokenizer, "model")
    assert tokenizer.chat_template == own
    assert tokenizer.eos_token == "<|eot_id|>"  # the special token after a reply


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"chat_template": "llama-9"}, "unknown chat template 'llama-9'; accepted: chatml, vicuna"),
        ({"chat_template": "unsloth"}, "'unsloth' is not available: it is Unsloth's own house layout"),
        ({"mapping": {"speaker": "from"}}, "unknown keys \\['speaker'\\]"),
        ({"mapping": {"role": "fr'om"}}, "must be a field or role name"),
        ({"mapping": {"user": "x", "assistant": "x"}}, "the same name"),
    ],
)
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        get_chat_template(_tokenizer(), **{"chat_template": "chatml", **kwargs})


@pytest.mark.parametrize(
    "name, messages, match",
    [
        ("chatml", [{"role": "tool", "content": "x"}], "role tool is not accepted here"),
        ("mistral", [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], "must alternate"),
        ("gemma", [{"role": "assistant", "content": "a"}], "must alternate"),
    ],
)
def test_template_rejects_wrong_roles(name, messages, match):
    from jinja2 import TemplateError

    tokenizer = _templated(name)
    with pytest.raises(TemplateError, match=match):
        tokenizer.apply_chat_template(messages, tokenize=False)
