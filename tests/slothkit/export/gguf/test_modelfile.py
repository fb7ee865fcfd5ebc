"""Ollama Modelfiles (slothkit.data.ollama_templates): the Go template renders a prompt exactly as the
HF chat template does, and generation stops at the end of the assistant's turn."""

import datetime
import re

import pytest
from transformers import AutoTokenizer

from slothkit.data.ollama_templates import (
    CHAT_FORMATS,
    GENERIC_FORMAT,
    chat_format,
    render_modelfile,
)
from slothkit.testing import build_tiny_tokenizer, tiny_model_path


def render_go_template(template: str, **values) -> str:
    """The part of Go's text/template that the Modelfile templates use: {{ if .X }}...{{ end }}
    (not nested), {{ .X }} and Ollama's {{ currentDate }} (YYYY-MM-DD). Ollama renders the turn
    being answered with .Response empty and stops there, so the prompt is everything before
    {{ .Response }}."""
    template = template.split("{{ .Response }}")[0]
    template = template.replace("{{ currentDate }}", datetime.date.today().isoformat())
    template = re.sub(
        r"\{\{ if \.(\w+) \}\}(.*?)\{\{ end \}\}",
        lambda m: m.group(2) if values.get(m.group(1)) else "",
        template,
        flags=re.DOTALL,
    )
    assert "{{" not in re.sub(r"\{\{ \.(\w+) \}\}", "", template), "unsupported template syntax"
    return re.sub(r"\{\{ \.(\w+) \}\}", lambda m: values.get(m.group(1), ""), template)


def parse(modelfile: str) -> dict:
    template = re.search(r'^TEMPLATE """(.*?)"""$', modelfile, flags=re.DOTALL | re.MULTILINE).group(1)
    stops = [
        s.encode().decode("unicode_escape")
        for s in re.findall(r'^PARAMETER stop "(.*)"$', modelfile, flags=re.MULTILINE)
    ]
    return {"from": modelfile.splitlines()[0], "template": template, "stops": stops}


END_OF_TURN = {"llama": "<|eot_id|>", "mistral": "</s>", "gemma": "<end_of_turn>"}


@pytest.mark.parametrize("system", [None, "You are terse."])
@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma"])
def test_template_renders_the_prompt_as_the_hf_chat_template(arch, system):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path(arch))
    text = render_modelfile("m.Q4_K_M.gguf", tokenizer, [tokenizer.convert_tokens_to_ids(END_OF_TURN[arch])])
    parsed = parse(text)
    assert parsed["from"] == "FROM ./m.Q4_K_M.gguf"
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": "Plan a garden."}
    ]
    hf = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    # llama.cpp adds BOS itself (the GGUF says add_bos), so the template leaves it out
    assert hf.startswith(tokenizer.bos_token)
    assert (
        render_go_template(parsed["template"], System=system, Prompt="Plan a garden.")
        == hf[len(tokenizer.bos_token) :]
    )
    assert END_OF_TURN[arch] in parsed["stops"] and tokenizer.eos_token in parsed["stops"]
    assert len(parsed["stops"]) == len(set(parsed["stops"]))


@pytest.mark.parametrize("system", [None, "You are terse."])
@pytest.mark.parametrize(
    "name, arch",
    [
        ("llama-3", "mistral"),
        ("chatml", "mistral"),
        ("qwen3-thinking", "mistral"),
        ("qwen3.5", "mistral"),
        ("gemma", "llama"),
        ("gemma-4", "llama"),
    ],
)
def test_a_turn_end_written_as_the_eos_ends_the_turns_and_stops(name, arch, system):
    """get_chat_template writes a turn end the tokenizer lacks as its EOS (Llama 3's
    <|eot_id|> as the tiny Mistral's </s>): the Go template writes that EOS where the format
    ends a turn, its prompt is the HF template's, and the EOS is a stop."""
    import warnings

    from slothkit.data import FORMATS, get_chat_template

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path(arch))
    own_turn_end = FORMATS[name].turn_end
    assert own_turn_end not in tokenizer.get_vocab()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the notice of what was mapped
        get_chat_template(tokenizer, name)
    parsed = parse(render_modelfile("m.gguf", tokenizer, [tokenizer.eos_token_id]))
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": "Plan a garden."}
    ]
    hf = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert render_go_template(parsed["template"], System=system, Prompt="Plan a garden.") == (
        hf.removeprefix(tokenizer.bos_token)
    )
    reply = [*messages, {"role": "assistant", "content": "Dig."}]
    hf_reply = tokenizer.apply_chat_template(reply, tokenize=False)
    after_response = parsed["template"].split("{{ .Response }}")[1]
    assert hf_reply.endswith("Dig." + after_response) and after_response.startswith(tokenizer.eos_token)
    assert own_turn_end not in parsed["template"] and tokenizer.eos_token in parsed["stops"]


_ACTION = re.compile(r"\{\{(.*?)\}\}", flags=re.DOTALL)


def render_go_messages(template: str, messages: list[dict]) -> str:
    """The part of Go's text/template that Ollama's .Messages templates here use:
    {{ range .Messages }}, {{ if eq .Role "r" }} / {{ else if eq .Role "r" }} / {{ end }},
    {{ .Content }} and Ollama's {{ currentDate }} (YYYY-MM-DD)."""
    pieces = _ACTION.split(template)  # text, action, text, action, ...

    def run(at: int, message: dict | None, stop: tuple[str, ...]) -> tuple[str, int]:
        out = ""
        while at < len(pieces):
            piece = pieces[at] if at % 2 == 0 else pieces[at].strip()
            at += 1
            if at % 2 == 1:
                out += piece
            elif piece.startswith(stop):
                return out, at - 1
            elif piece == "currentDate":
                out += datetime.date.today().isoformat()
            elif piece == ".Content":
                out += message["content"]
            elif piece == "range .Messages":
                start = at
                for each in messages:
                    text, at = run(start, each, ("end",))
                    out += text
                at += 1
            elif piece.startswith("if eq .Role"):
                chosen = False
                while True:
                    role = re.search(r'"(\w+)"', piece).group(1)
                    take = not chosen and message["role"] == role
                    text, at = run(at, message, ("else", "end"))
                    out, chosen = (out + text, True) if take else (out, chosen)
                    piece = pieces[at].strip()
                    at += 1
                    if piece == "end":
                        break
            else:
                raise AssertionError(f"unsupported template action {piece!r}")
        return out, at

    return run(0, None, ())[0]


@pytest.mark.parametrize("add_missing_tokens", [True, None], ids=["added", "as-text"])
@pytest.mark.parametrize("system", [None, "You are terse."])
def test_gpt_oss_template_renders_the_conversation_and_stops_at_the_answer_end(system, add_missing_tokens):
    """The harmony prompt as get_chat_template's gpt-oss template renders it (the system text as
    the developer message; harmony's system message once; past answers in the final channel),
    and generation stopping at <|return|> (or the EOS written for it) and <|call|>, not at the
    <|end|> of the reasoning."""
    import warnings

    from transformers import AutoModelForCausalLM

    from slothkit.data import get_chat_template

    path = tiny_model_path("qwen2")  # no BOS, as gpt-oss's tokenizer
    tokenizer = AutoTokenizer.from_pretrained(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the embeddings-grew / mapped-token notices
        model = AutoModelForCausalLM.from_pretrained(path)
        get_chat_template(tokenizer, "gpt-oss", model=model, add_missing_tokens=add_missing_tokens)
    parsed = parse(render_modelfile("m.gguf", tokenizer, [tokenizer.eos_token_id]))
    first = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": "Plan a garden."}
    ]
    for messages in (
        first,
        [*first, {"role": "assistant", "content": "Dig."}, {"role": "user", "content": "And then?"}],
    ):
        hf = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert render_go_messages(parsed["template"], messages) == hf
    answer_end = "<|return|>" if add_missing_tokens else tokenizer.eos_token
    assert (
        answer_end in parsed["stops"] and "<|call|>" in parsed["stops"] and "<|end|>" not in parsed["stops"]
    )


def test_each_known_format_is_recognised_by_its_marker():
    assert [chat_format(f"... {fmt.marker} ...").name for fmt in CHAT_FORMATS] == [
        "gpt-oss",
        "llama3",
        "mistral",
        "gemma4",
        "gemma",
        "qwen3-thinking",
        "qwen3.5",
        "chatml",
    ]
    assert (
        chat_format(None) is GENERIC_FORMAT and chat_format("{{ messages[0]['content'] }}") is GENERIC_FORMAT
    )


def test_unknown_chat_template_gets_the_generic_one():
    tokenizer = AutoTokenizer.from_pretrained(build_tiny_tokenizer("bpe"))
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    parsed = parse(render_modelfile("x.gguf", tokenizer))
    prompt = render_go_template(parsed["template"], System="Be kind.", Prompt="Hello?")
    assert prompt == "Be kind.\n\n### Instruction:\nHello?\n\n### Response:\n"
    assert parsed["stops"] == ["<|end_of_text|>", "### Instruction:"]


def test_quotes_and_backslashes_in_stop_tokens_are_escaped():
    class Tok:
        chat_template = None
        eos_token = 'say "bye"\\'

        def convert_ids_to_tokens(self, i):
            return "<eot>"

    text = render_modelfile("x.gguf", Tok(), [7])
    assert 'PARAMETER stop "say \\"bye\\"\\\\"' in text.splitlines()
    assert 'PARAMETER stop "<eot>"' in text.splitlines()
