"""get_chat_template(tokenizer, "qwen3.5") and (tokenizer, "gemma-4") render conversations
exactly as the models' own chat templates (reference_templates/qwen3_5_chat_template.jinja,
gemma_4_chat_template.jinja) do, thinking switch included, and train_on_responses_only keeps
what the assistant masks keep."""

import copy
import pathlib
import random
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from slothkit.data import FORMATS, get_chat_template
from slothkit.data.chat_formats import format_named
from slothkit.data.chat_templates import matching_format
from slothkit.data.responses_only import ResponseMasker, probe_markers
from slothkit.testing import tiny_model_path

REFERENCES = pathlib.Path(__file__).parent / "reference_templates"
# format: (its model's own template, the tiny tokenizer it is installed on: Qwen's has no
# BOS, as Qwen3.5's; the tiny Gemma one puts its BOS first, as Gemma 4's)
FAMILIES = {
    "qwen3.5": ("qwen3_5_chat_template.jinja", "qwen2"),
    "gemma-4": ("gemma_4_chat_template.jinja", "gemma"),
}
# Both templates read a reply's reasoning from the message: slothkit as `thinking`, Qwen3.5
# and Gemma 4 as `reasoning_content`; the conversations carry both.
CONVERSATIONS = {
    "one exchange": [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
    ],
    "system, spaces around every text": [
        {"role": "system", "content": "  Be brief.\nAnswer in English.\n"},
        {"role": "user", "content": "\n Name a colour. "},
        {"role": "assistant", "content": " Blue.\n\n"},
    ],
    "developer message": [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
    ],
    "reasoning as a field": [
        {"role": "user", "content": "What is 17 * 3?"},
        {
            "role": "assistant",
            "thinking": "17 * 3 = 51.",
            "reasoning_content": "17 * 3 = 51.",
            "content": "51",
        },
    ],
    "reasoning in the text": [
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "<think>\nGreet back.\n</think>\n\nHello!"},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "<think>\n\nTwo and two.\n\n</think>\n\n\n4"},
    ],
    "past reasoning in a thought channel": [
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "<|channel>thought\nGreet back.<channel|>Hello!"},
        {"role": "user", "content": "And 3 + 3?"},
        {
            "role": "assistant",
            "thinking": "Three and three.",
            "reasoning_content": "Three and three.",
            "content": "6",
        },
    ],
    "ends with a user turn": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "What is 2 + 2?"},
    ],
}
THINKING = [{}, {"enable_thinking": True}, {"enable_thinking": False}]


def _random_conversation(rng: random.Random) -> list[dict]:
    """Alternating turns of random words with random spaces and newlines around them, an
    optional system text and reasoning on some replies."""

    def text():
        words = " ".join(
            rng.choice(["blue", "2 + 2", "Hello!", "why?", "ok", "x\ny"]) for _ in range(rng.randint(1, 5))
        )
        return rng.choice(["", " ", "\n", " \n"]) + words + rng.choice(["", " ", "\n\n"])

    messages = [{"role": "system", "content": text()}] if rng.random() < 0.5 else []
    for _ in range(rng.randint(1, 3)):
        messages.append({"role": "user", "content": text()})
        reply = {"role": "assistant", "content": text()}
        if rng.random() < 0.5:
            reply["thinking"] = reply["reasoning_content"] = text().strip()
        messages.append(reply)
    return messages


def _tokenizer(name):
    """The tiny tokenizer of FAMILIES[name] with the format, its markers added as tokens."""
    path = str(tiny_model_path(FAMILIES[name][1]))
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the embeddings-grew notice
        return get_chat_template(tokenizer, name, model=model, add_missing_tokens=True)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    name = request.param
    return name, _tokenizer(name), (REFERENCES / FAMILIES[name][0]).read_text()


def _both(family, messages, **kwargs):
    _, tokenizer, reference = family
    ours = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    return ours, tokenizer.apply_chat_template(messages, tokenize=False, chat_template=reference, **kwargs)


@pytest.mark.parametrize("add_generation_prompt", [False, True])
@pytest.mark.parametrize("case", list(CONVERSATIONS))
def test_renders_as_the_models_own_template(family, case, add_generation_prompt):
    if family[0] == "qwen3.5" and case == "developer message":  # Qwen3.5 knows no developer role
        from jinja2 import TemplateError

        for template in (None, family[2]):
            with pytest.raises(TemplateError):
                family[1].apply_chat_template(CONVERSATIONS[case], tokenize=False, chat_template=template)
        return
    for thinking in THINKING:
        ours, reference = _both(
            family, CONVERSATIONS[case], add_generation_prompt=add_generation_prompt, **thinking
        )
        assert ours == reference, (case, thinking)


def test_renders_random_conversations_as_the_models_own_template(family):
    rng = random.Random(35)
    for _ in range(40):
        messages = _random_conversation(rng)
        kwargs = rng.choice(THINKING)
        for prompt in (False, True):
            ours, reference = _both(family, messages, add_generation_prompt=prompt, **kwargs)
            assert ours == reference, (messages, kwargs, prompt)


def test_the_thinking_switch_as_each_family_writes_it():
    """What the comparison rests on, spelled out: Qwen3.5 opens the thinking block in its
    generation prompt unless thinking is off; Gemma 4 asks for thinking with <|think|> at the
    top of the system turn and writes the last reply's reasoning in its thought channel."""
    prompt = [{"role": "user", "content": "Name a colour."}]
    qwen = _tokenizer("qwen3.5")
    assert qwen.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\n<think>\n"
    )
    assert qwen.apply_chat_template(
        prompt, tokenize=False, add_generation_prompt=True, enable_thinking=False
    ).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    gemma = _tokenizer("gemma-4")
    assert gemma.apply_chat_template(
        prompt, tokenize=False, add_generation_prompt=True, enable_thinking=True
    ) == (
        gemma.bos_token
        + "<|turn>system\n<|think|>\n<turn|>\n<|turn>user\nName a colour.<turn|>\n<|turn>model\n"
    )
    text = gemma.apply_chat_template(CONVERSATIONS["past reasoning in a thought channel"], tokenize=False)
    assert "Greet back" not in text  # a past reply's reasoning is dropped
    assert text.endswith("<|turn>model\n<|channel>thought\nThree and three.\n<channel|>6<turn|>\n")
    for token in ("<|turn>", "<turn|>", "<|think|>", "<|channel>", "<channel|>"):
        assert len(gemma(token, add_special_tokens=False)["input_ids"]) == 1


def test_the_models_own_template_is_recognised_as_the_format(family):
    """get_chat_template(tokenizer, "model") on a tokenizer carrying the model's own template
    installs the format (with its generation marks); the thinking switch tells Qwen3.5's
    template from Qwen3 Thinking's, which writes the same text but for it."""
    name, tokenizer, reference = family
    own = copy.deepcopy(tokenizer)
    own.chat_template = reference
    assert matching_format(own) is FORMATS[name]


@pytest.mark.parametrize(
    "alias, name",
    [
        ("qwen3.5", "qwen3.5"),
        ("Qwen-3.5", "qwen3.5"),
        ("qwen3_5", "qwen3.5"),
        ("gemma-4", "gemma-4"),
        ("gemma4", "gemma-4"),
    ],
)
def test_the_names_users_type(alias, name):
    assert format_named(alias) is FORMATS[name]


def test_responses_only_keeps_exactly_the_assistant_messages(family):
    """The format's markers, and those probed from the model's own template, keep what the
    assistant masks keep: each reply with its reasoning and turn end, nothing else."""
    name, tokenizer, reference = family
    fmt = FORMATS[name]
    own = copy.deepcopy(tokenizer)
    own.chat_template = reference
    assert probe_markers(own) == probe_markers(tokenizer) == (fmt.instruction_part, fmt.response_part)
    masker = ResponseMasker(tokenizer, fmt.instruction_part, fmt.response_part)
    rng = random.Random(3)
    for messages in [*CONVERSATIONS.values(), *(_random_conversation(rng) for _ in range(10))]:
        messages = [m for m in messages if m["role"] != "developer"]
        encoded = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        keep = masker.keep_row(torch.tensor(encoded["input_ids"]))
        assert keep.tolist() == [bool(m) for m in encoded["assistant_masks"]], messages
