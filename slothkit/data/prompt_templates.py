"""A chat template written as one exchange with ``{SYSTEM}``, ``{INPUT}`` and ``{OUTPUT}``
fields, as Unsloth's Ollama notebooks write it:

    apply_chat_template(dataset, tokenizer, chat_template='''Below are some instructions ...

    ### Instruction:
    {INPUT}

    ### Response:
    {OUTPUT}''')

A conversation of several exchanges repeats the user and assistant parts, so the text is
cut into these pieces (``PromptTemplate``):

    header           written once, before the first user turn: a leading BOS, the preamble
                     up to its last blank line, or with {SYSTEM} the text around the system
                     text, including the turn end that closes it when the template closes
                     the system turn as it closes a reply (ChatML's <|im_end|>, Llama 3's
                     <|eot_id|>)
    separator        the whitespace between the header and a user turn, and between exchanges
    user_prefix      the rest of the text before {INPUT}: what opens each user turn
    response_prefix  the text between {INPUT} and {OUTPUT}: what opens each reply (the
                     generation prompt)
    turn_end         the text after {OUTPUT}; the tokenizer's EOS follows it unless it ends
                     with it, so that the model learns to stop

The Jinja template carries the pieces in its first line, so that the Ollama Modelfile
(slothkit.data.ollama_templates) writes the same layout after a save and reload.
"""

from __future__ import annotations

import dataclasses
import json
import re

FIELDS = ("{SYSTEM}", "{INPUT}", "{OUTPUT}")
TAG = "{#- slothkit prompt template: "
_TAG_PATTERN = re.compile(r"^\{#- slothkit prompt template: (\{.*?\}) -#\}")


@dataclasses.dataclass(frozen=True)
class PromptTemplate:
    header_before_system: str  # the header's text before the system text (all of it without {SYSTEM})
    has_system: bool
    header_after_system: str  # the header's text after the system text
    separator: str
    user_prefix: str
    response_prefix: str
    turn_end: str  # including the EOS when the template's own text does not end with it
    default_system: str | None


def is_prompt_template(text) -> bool:
    """A string with {INPUT} and {OUTPUT} fields, not a format name or a Jinja template."""
    return isinstance(text, str) and "{INPUT}" in text and "{OUTPUT}" in text and "{%" not in text


def parse_prompt_template(text: str, eos_token: str | None, bos_token: str | None = None,
                          default_system: str | None = None) -> PromptTemplate:  # fmt: skip
    """The pieces of a {SYSTEM}/{INPUT}/{OUTPUT} template (module docstring).

    Raises:
        ValueError: a field missing, repeated or out of order, naming what to write.
    """
    counts = {field: text.count(field) for field in FIELDS}
    if counts["{INPUT}"] != 1 or counts["{OUTPUT}"] != 1 or counts["{SYSTEM}"] > 1:
        raise ValueError(
            "a prompt chat template holds {INPUT} and {OUTPUT} once each (and {SYSTEM} at most once); "
            f"this one has {counts}"
        )
    before_input, after_input = text.split("{INPUT}")
    if "{OUTPUT}" not in after_input or "{SYSTEM}" in after_input:
        raise ValueError("a prompt chat template writes {SYSTEM}, then {INPUT}, then {OUTPUT}, in that order")
    response_prefix, turn_end = after_input.split("{OUTPUT}")
    if eos_token and not turn_end.rstrip().endswith(eos_token):
        turn_end += eos_token
    if "{SYSTEM}" in before_input:
        before_system, after_system = before_input.split("{SYSTEM}")
        closing = turn_end.removesuffix(eos_token or "").strip()
        if not (closing and after_system.startswith(closing)):
            closing = ""
        rest = after_system[len(closing) :]
        separator = rest[: len(rest) - len(rest.lstrip())]
        return PromptTemplate(
            before_system,
            True,
            closing,
            separator,
            rest[len(separator) :],
            response_prefix,
            turn_end,
            default_system,
        )
    header, rest = "", before_input
    if bos_token and rest.startswith(bos_token):
        header, rest = bos_token, rest[len(bos_token) :]
    cut = rest.rstrip("\n").rfind("\n\n")
    if cut >= 0:
        header, separator, rest = header + rest[:cut], "\n\n", rest[cut + 2 :]
    else:
        separator = ""
    return PromptTemplate(header, False, "", separator, rest, response_prefix, turn_end, default_system)


def jinja_template(template: PromptTemplate) -> str:
    """The chat template that renders conversations in `template`'s layout, its pieces in
    the first line.  A system message needs a template with {SYSTEM}."""
    from slothkit.data.chat_formats import jinja_string

    pieces = json.dumps(dataclasses.asdict(template), ensure_ascii=True)
    default = jinja_string(template.default_system) if template.default_system is not None else "''"
    return (
        TAG + pieces.replace("#}", "#\\u007d") + " -#}\n"
        "{%- set ns = namespace(system=" + default + ", written=false) -%}\n"
        "{%- if messages and messages[0]['role'] == 'system' -%}\n"
        + (
            "    {%- set ns.system = messages[0]['content'] -%}\n"
            if template.has_system
            else "    {{- raise_exception('this chat template, made from a prompt without {SYSTEM}, has no place "
            "for a system message') -}}\n"
        )
        + "{%- endif -%}\n"
        "{{- "
        + jinja_string(template.header_before_system)
        + " -}}\n"
        + (
            "{{- ns.system + " + jinja_string(template.header_after_system) + " -}}\n"
            "{%- set ns.written = true -%}\n"
            if template.has_system
            else ""
        )
        + ("{%- set ns.written = true -%}\n" if template.header_before_system else "")
        + "{%- for message in messages -%}\n"
        "    {%- if message['role'] == 'user' -%}\n"
        "        {{- ("
        + jinja_string(template.separator)
        + " if ns.written else '') + "
        + jinja_string(template.user_prefix)
        + " + message['content'] -}}\n"
        "        {%- set ns.written = true -%}\n"
        "    {%- elif message['role'] == 'assistant' -%}\n"
        "        {{- " + jinja_string(template.response_prefix) + " -}}\n"
        "        {%- generation -%}\n"
        "            {{- message['content'] + " + jinja_string(template.turn_end) + " -}}\n"
        "        {%- endgeneration -%}\n"
        "    {%- endif -%}\n"
        "{%- endfor -%}\n"
        "{%- if add_generation_prompt -%}\n"
        "    {{- " + jinja_string(template.response_prefix) + " -}}\n"
        "{%- endif -%}\n"
    )


def prompt_template_of(chat_template) -> PromptTemplate | None:
    """The pieces a chat template made here carries in its first line, else None."""
    if not isinstance(chat_template, str):
        return None
    found = _TAG_PATTERN.match(chat_template)
    if found is None:
        return None
    return PromptTemplate(**json.loads(found.group(1)))
