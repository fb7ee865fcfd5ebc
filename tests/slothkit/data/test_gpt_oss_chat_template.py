"""get_chat_template(tokenizer, "gpt-oss") renders conversations exactly as gpt-oss's own
chat template (reference_templates/gpt_oss_chat_template.jinja) does, and its replies are
what train_on_responses_only keeps."""

import copy
import pathlib
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from slothkit.data import FORMATS, get_chat_template
from slothkit.data.chat_formats import format_of_template
from slothkit.data.responses_only import ResponseMasker, infer_markers, probe_markers
from slothkit.testing import tiny_model_path
from slothkit.testing.tiny_chat_templates import tiny_chat_template

REFERENCE = (
    pathlib.Path(__file__).parent / "reference_templates" / "gpt_oss_chat_template.jinja"
).read_text()
HARMONY_TOKENS = ("<|start|>", "<|message|>", "<|channel|>", "<|end|>", "<|return|>")

CONVERSATIONS = {
    "one exchange": [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
    ],
    "system": [
        {"role": "system", "content": "Be brief.\nAnswer in English."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
    ],
    "developer": [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
    ],
    "reasoning": [
        {"role": "user", "content": "What is 17 * 3?"},
        {"role": "assistant", "thinking": "17 * 3 = 51.\nCheck: 50 + 1.", "content": "51"},
    ],
    "multi-turn reasoning": [
        {"role": "system", "content": "Show your work briefly."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "thinking": "A greeting; greet back.", "content": "Hello!"},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3 + 3?"},
        {"role": "assistant", "thinking": "Three and three.", "content": "6"},
    ],
    "ends with a user turn": [
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "thinking": "Greet.", "content": "Hello!"},
        {"role": "user", "content": "What is 2 + 2?"},
    ],
    "empty system text": [
        {"role": "system", "content": ""},
        {"role": "user", "content": "Name a colour."},
    ],
}


def _tokenizer(add_missing_tokens=True):
    """The tiny Qwen tokenizer (no BOS, as gpt-oss's) with the gpt-oss format."""
    path = str(tiny_model_path("qwen2"))
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the embeddings-grew / mapped-token notices
        return get_chat_template(tokenizer, "gpt-oss", model=model, add_missing_tokens=add_missing_tokens)


@pytest.fixture(scope="module")
def tokenizer():
    return _tokenizer()


def _both(tokenizer, messages, **kwargs):
    ours = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    reference = tokenizer.apply_chat_template(messages, tokenize=False, chat_template=REFERENCE, **kwargs)
    return ours, reference


@pytest.mark.parametrize("add_generation_prompt", [False, True])
@pytest.mark.parametrize("case", list(CONVERSATIONS))
def test_renders_as_gpt_oss_own_template(tokenizer, case, add_generation_prompt):
    messages = CONVERSATIONS[case]
    ours, reference = _both(tokenizer, messages, add_generation_prompt=add_generation_prompt)
    assert ours == reference


@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_the_tiny_fixtures_template_renders_as_gpt_oss_own(tokenizer, add_generation_prompt):
    """The template a tiny gpt-oss fixture ships (slothkit.testing.tiny_chat_templates)."""
    own = tiny_chat_template("gpt-oss")
    for case, messages in CONVERSATIONS.items():
        for kwargs in ({}, {"reasoning_effort": "low", "model_identity": "You are Sloth."}):
            render = dict(tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs)
            ours = tokenizer.apply_chat_template(messages, chat_template=own, **render)
            assert ours == tokenizer.apply_chat_template(messages, chat_template=REFERENCE, **render), case


@pytest.mark.parametrize(
    "kwargs",
    [{"reasoning_effort": "high"}, {"reasoning_effort": "low"}, {"model_identity": "You are Sloth."}],
)
def test_reasoning_effort_and_identity_as_gpt_oss_own_template(tokenizer, kwargs):
    ours, reference = _both(tokenizer, CONVERSATIONS["system"][:2], add_generation_prompt=True, **kwargs)
    assert ours == reference and next(iter(kwargs.values())) in ours


def test_the_facts_of_harmony_hold(tokenizer):
    """What the comparison rests on, spelled out on one rendering."""
    import datetime

    text, _ = _both(tokenizer, CONVERSATIONS["multi-turn reasoning"])
    today = datetime.date.today().isoformat()
    assert text.startswith(
        "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
        f"Knowledge cutoff: 2024-06\nCurrent date: {today}\n\nReasoning: medium\n\n"
    )
    assert "<|start|>developer<|message|># Instructions\n\nShow your work briefly.\n\n<|end|>" in text
    assert "A greeting" not in text  # a past turn's reasoning is dropped
    assert text.endswith(
        "<|start|>assistant<|channel|>final<|message|>4<|end|><|start|>user<|message|>And 3 + 3?<|end|>"
        "<|start|>assistant<|channel|>analysis<|message|>Three and three.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>6<|return|>"
    )
    prompt, _ = _both(tokenizer, CONVERSATIONS["multi-turn reasoning"][:-1], add_generation_prompt=True)
    assert prompt.endswith("And 3 + 3?<|end|><|start|>assistant") and "Three" not in prompt
    for token in HARMONY_TOKENS:
        assert len(tokenizer(token, add_special_tokens=False)["input_ids"]) == 1
    assert tokenizer.eos_token == "<|return|>"  # generation stops where a training text ends


def test_tools_are_refused_with_the_way_out(tokenizer):
    from jinja2 import TemplateError

    tools = [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {}}}]
    with pytest.raises(
        TemplateError,
        match="without tools; for tools and tool calls keep the tokenizer's own gpt-oss template",
    ):
        tokenizer.apply_chat_template(CONVERSATIONS["system"], tokenize=False, tools=tools)


def test_gpt_oss_own_template_is_recognised_and_probed(tokenizer):
    """A tokenizer carrying gpt-oss's own template: train_on_responses_only finds the same
    markers in it, and get_chat_template(tokenizer, "model") recognises it as gpt-oss (so
    that it gains the generation marks)."""
    own = copy.deepcopy(tokenizer)
    own.chat_template = REFERENCE
    fmt = FORMATS["gpt-oss"]
    assert probe_markers(own) == (fmt.instruction_part, fmt.response_part)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # pass model= (nothing is added here)
        get_chat_template(own, "model")
    assert format_of_template(own.chat_template) is fmt


def _kept(ids, keep, tokenizer):
    return tokenizer.decode([i for i, k in zip(ids, keep) if k])


@pytest.mark.parametrize("add_missing_tokens", [True, None], ids=["added", "as-text"])
def test_responses_only_keeps_exactly_the_assistant_messages(add_missing_tokens):
    tokenizer = _tokenizer(add_missing_tokens)
    fmt = FORMATS["gpt-oss"]
    assert (fmt.instruction_part, fmt.response_part) == ("<|start|>user<|message|>", "<|start|>assistant")
    assert infer_markers(tokenizer) == probe_markers(tokenizer) == (fmt.instruction_part, fmt.response_part)
    masker = ResponseMasker(tokenizer, fmt.instruction_part, fmt.response_part)
    end = tokenizer.eos_token  # <|return|>, or the tiny tokenizer's EOS standing in for it
    for case, messages in CONVERSATIONS.items():
        encoded = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        ids = torch.tensor(encoded["input_ids"])
        keep = masker.keep_row(ids)
        assert keep.tolist() == [bool(m) for m in encoded["assistant_masks"]], case
    ids = torch.tensor(
        tokenizer.apply_chat_template(CONVERSATIONS["multi-turn reasoning"], tokenize=True, return_dict=True)[
            "input_ids"
        ]
    )
    # Each message after its "<|start|>assistant": channel, text and close; no user or system text.
    assert _kept(ids, masker.keep_row(ids), tokenizer) == (
        "<|channel|>final<|message|>Hello!<|end|><|channel|>final<|message|>4<|end|>"
        "<|channel|>analysis<|message|>Three and three.<|end|><|channel|>final<|message|>6" + end
    )


def test_unsloths_gpt_oss_markers_keep_the_final_answers_only(tokenizer):
    """Unsloth's gpt-oss notebooks pass the final channel's header as response_part: the
    answers are trained, the reasoning is not."""
    masker = ResponseMasker(
        tokenizer, "<|start|>user<|message|>", "<|start|>assistant<|channel|>final<|message|>"
    )
    encoded = tokenizer.apply_chat_template(
        CONVERSATIONS["multi-turn reasoning"], tokenize=True, return_dict=True
    )
    ids = torch.tensor(encoded["input_ids"])
    assert _kept(ids, masker.keep_row(ids), tokenizer) == "Hello!<|end|>4<|end|>6<|return|>"
