"""A {SYSTEM}/{INPUT}/{OUTPUT} prompt as a chat template (slothkit.data.prompt_templates):
the text of multi-turn conversations, the generation prompt, the assistant mask, the
Ollama Modelfile, and the layout kept through a save."""

import pytest
from datasets import Dataset
from transformers import AutoTokenizer

from slothkit.data import apply_chat_template, standardize_sharegpt, to_sharegpt
from slothkit.data.conversations import install_prompt_template
from slothkit.data.ollama_templates import render_modelfile
from slothkit.testing import tiny_model_path

E = "<|end_of_text|>"  # the tiny Llama tokenizer's EOS
ALPACA_LIKE = "Solve each task.\n\n### Instruction:\n{INPUT}\n\n### Response:\n{OUTPUT}"
LLAMA3 = (
    "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n{SYSTEM}<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\n{INPUT}<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n{OUTPUT}<|eot_id|>"
)
CHATML = (
    "<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{INPUT}<|im_end|>\n"
    "<|im_start|>assistant\n{OUTPUT}<|im_end|>"
)
PLAIN = "{SYSTEM}\nUSER: {INPUT}\nASSISTANT: {OUTPUT}"
TWO = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "2 + 2?"},
    {"role": "assistant", "content": "4"},
]
SYSTEM = [{"role": "system", "content": "Be brief."}]

# Two exchanges (with the system message where the prompt has {SYSTEM}), then the
# generation prompt after one user turn, written out by hand.
GOLDEN = {
    ALPACA_LIKE: (
        "Solve each task.\n\n### Instruction:\nHi\n\n### Response:\nHello!"
        + E
        + "\n\n### Instruction:\n2 + 2?"
        "\n\n### Response:\n4" + E,
        "Solve each task.\n\n### Instruction:\nHi\n\n### Response:\n",
    ),
    LLAMA3: (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
        "Hello!<|eot_id|>" + E + "<|start_header_id|>user<|end_header_id|>\n\n2 + 2?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n4<|eot_id|>" + E,
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
    ),
    CHATML: (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        "Hello!<|im_end|>"
        + E
        + "\n<|im_start|>user\n2 + 2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>"
        + E,
        "<|im_start|>system\n<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    ),
    PLAIN: (
        "Be brief.\nUSER: Hi\nASSISTANT: Hello!" + E + "\nUSER: 2 + 2?\nASSISTANT: 4" + E,
        "\nUSER: Hi\nASSISTANT: ",
    ),
}


def _tokenizer(prompt, default_system=None):
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_path("llama")))
    install_prompt_template(tokenizer, prompt, default_system)
    return tokenizer


@pytest.mark.parametrize("prompt", list(GOLDEN), ids=["alpaca-like", "llama-3", "chatml", "plain"])
def test_conversations_repeat_the_exchange_and_prompt_for_a_reply(prompt):
    tokenizer = _tokenizer(prompt)
    conversation = (SYSTEM if "{SYSTEM}" in prompt else []) + TWO
    assert tokenizer.apply_chat_template(conversation, tokenize=False) == GOLDEN[prompt][0]
    assert (
        tokenizer.apply_chat_template(TWO[:1], tokenize=False, add_generation_prompt=True)
        == GOLDEN[prompt][1]
    )
    # The assistant mask covers each reply and its turn end, nothing else (a reply after
    # "ASSISTANT: " starts with the token that holds the space too, as in vicuna's format).
    encoded = tokenizer.apply_chat_template(
        conversation, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    kept = [t for t, keep in zip(encoded["input_ids"], encoded["assistant_masks"]) if keep]
    end = prompt.split("{OUTPUT}")[1] + E
    assert (
        tokenizer.decode(kept).replace(" Hello!", "Hello!").replace(" 4", "4") == "Hello!" + end + "4" + end
    )


def test_a_default_system_text_fills_conversations_without_one_and_the_modelfile():
    tokenizer = _tokenizer(CHATML, default_system="You are terse.")
    assert tokenizer.apply_chat_template(TWO[:2], tokenize=False).startswith(
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi"
    )
    modelfile = render_modelfile("m.gguf", tokenizer)
    assert 'SYSTEM """You are terse."""' in modelfile
    assert (
        'TEMPLATE """<|im_start|>system\n{{ .System }}<|im_end|>\n<|im_start|>user\n{{ .Prompt }}<|im_end|>\n'
        "<|im_start|>assistant\n{{ .Response }}<|im_end|>" + E + '"""'
    ) in modelfile


@pytest.mark.parametrize("prompt", list(GOLDEN), ids=["alpaca-like", "llama-3", "chatml", "plain"])
def test_the_modelfile_writes_one_exchange_as_the_template_does(prompt, tmp_path):
    """Ollama's template with .System, .Prompt and .Response filled is the chat template's
    rendering of that exchange (less the BOS, which llama.cpp adds), after a save and reload."""
    tokenizer = _tokenizer(prompt)
    tokenizer.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    modelfile = render_modelfile("m.gguf", reloaded)
    assert modelfile == render_modelfile("m.gguf", tokenizer) and modelfile.startswith("FROM ./m.gguf\n")
    go = modelfile.split('TEMPLATE """')[1].split('"""')[0]
    conversation = (SYSTEM if "{SYSTEM}" in prompt else []) + TWO[:2]
    filled = (
        go.replace("{{ .System }}", "Be brief.")
        .replace("{{ .Prompt }}", "Hi")
        .replace("{{ .Response }}", "Hello!")
    )
    assert filled == reloaded.apply_chat_template(conversation, tokenize=False).removeprefix(
        "<|begin_of_text|>"
    )
    assert f'PARAMETER stop "{E}"' in modelfile


def test_the_ollama_notebooks_data_path():
    """Unsloth's Llama-3 Ollama notebook: to_sharegpt, standardize_sharegpt, then
    apply_chat_template with a prompt, which leaves the Modelfile text on the tokenizer."""
    records = Dataset.from_list(
        [
            {"instruction": "Add 2 and 3.", "input": "", "output": "5"},
            {"instruction": "Name a colour.", "input": "warm", "output": "Red"},
        ]
    )
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_path("llama")))
    dataset = to_sharegpt(
        records, merged_prompt="{instruction}[[\nYour input is:\n{input}]]", output_column_name="output"
    )
    dataset = apply_chat_template(
        standardize_sharegpt(dataset), tokenizer=tokenizer, chat_template=ALPACA_LIKE
    )
    assert dataset["text"] == [
        "Solve each task.\n\n### Instruction:\nAdd 2 and 3.\n\n### Response:\n5" + E,
        "Solve each task.\n\n### Instruction:\nName a colour.\nYour input is:\nwarm\n\n### Response:\nRed"
        + E,
    ]
    assert tokenizer._ollama_modelfile.startswith("FROM {__FILE_LOCATION__}\nTEMPLATE")


def test_refusals_say_what_to_write():
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_path("llama")))
    with pytest.raises(ValueError, match="holds \\{INPUT\\} and \\{OUTPUT\\} once each"):
        install_prompt_template(tokenizer, "{INPUT} {INPUT} {OUTPUT}")
    with pytest.raises(ValueError, match="\\{SYSTEM\\}, then \\{INPUT\\}, then \\{OUTPUT\\}"):
        install_prompt_template(tokenizer, "{OUTPUT} then {INPUT}")
    with pytest.raises(ValueError, match="for a named format call get_chat_template"):
        install_prompt_template(tokenizer, "chatml")
    with pytest.raises(ValueError, match="default_system_message needs a \\{SYSTEM\\} field"):
        install_prompt_template(tokenizer, ALPACA_LIKE, "Be brief.")
    install_prompt_template(tokenizer, ALPACA_LIKE)
    with pytest.raises(Exception, match="has no place for a system message"):
        tokenizer.apply_chat_template(SYSTEM + TWO, tokenize=False)
