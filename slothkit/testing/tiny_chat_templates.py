"""The chat templates of the tiny fixtures: each family's own template as its instruct models
ship it (HF's `messages`, roles by their names), in the turns of the format its record names
(`tiny.chat_format`, a slothkit.data format), whose markers come from slothkit.data.turn_layouts,
where slothkit's own template of the format and its Ollama Modelfile read them too.

    format     as the templates of                  besides the turns
    llama-3    Llama 3 Instruct                     BOS, each message trimmed
    qwen-2.5   Qwen2.5 Instruct                     Qwen's default system text
    qwen3      Qwen3                                an empty think block in the current answer;
                                                    enable_thinking=False closes one in the prompt
    gemma      Gemma (2, 3) instruct                BOS, system text in the first user turn,
                                                    roles checked
    mistral    Mistral Instruct                     BOS, system text in the first user turn,
                                                    turns must alternate
    phi-3      Phi-3 Instruct                       BOS, <|endoftext|> after a finished conversation
    gpt-oss    gpt-oss (OpenAI harmony, no tools)   harmony's system message (model_identity,
                                                    today's date, reasoning_effort); a leading
                                                    system or developer message as the developer
                                                    message; the last answer's thinking
"""

from __future__ import annotations

from slothkit.data import turn_layouts as turns
from slothkit.data.chat_formats import FORMATS
from slothkit.data.turn_layouts import quoted


def _emit(depth: int, expression: str) -> str:
    return "    " * depth + "{{- " + expression + " -}}\n"


def _header(layout: turns.TurnLayout, role: str) -> str:
    """The expression opening a turn of `role` (a Jinja expression) in a headed layout."""
    start, end = layout.header
    return f"{quoted(start)} + {role} + {quoted(end)}"


def _generation_prompt(opening: str, after: str = "") -> str:
    return "{%- if add_generation_prompt -%}\n" + _emit(1, quoted(opening)) + after + "{%- endif -%}\n"


# The leading system message split off as a prefix of the first user turn.
_SYSTEM_PREFIX = r"""{%- if messages and messages[0]['role'] == 'system' -%}
    {%- set system_prefix = messages[0]['content'] | trim + @FOLD@ -%}
    {%- set conversation = messages[1:] -%}
{%- else -%}
    {%- set system_prefix = '' -%}
    {%- set conversation = messages -%}
{%- endif -%}
{{- bos_token -}}
"""


def _llama_3() -> str:
    layout = turns.LLAMA_3
    return (
        "{{- bos_token -}}\n{%- for message in messages -%}\n"
        + _emit(1, _header(layout, "message['role']"))
        + _emit(1, f"message['content'] | trim + {quoted(layout.assistant.close)}")
        + "{%- endfor -%}\n"
        + _generation_prompt(layout.assistant.open)
    )


def _qwen_2_5() -> str:
    layout, default_system = turns.CHATML, FORMATS["qwen-2.5"].default_system
    system = layout.system
    return (
        "{%- if messages and messages[0]['role'] == 'system' -%}\n"
        + _emit(1, f"{quoted(system.open)} + messages[0]['content'] + {quoted(system.close)}")
        + "    {%- set conversation = messages[1:] -%}\n{%- else -%}\n"
        + _emit(1, quoted(system.open + default_system + system.close))
        + "    {%- set conversation = messages -%}\n{%- endif -%}\n{%- for message in conversation -%}\n"
        + _emit(
            1,
            _header(layout, "message['role']") + f" + message['content'] + {quoted(layout.assistant.close)}",
        )
        + "{%- endfor -%}\n"
        + _generation_prompt(layout.assistant.open)
    )


def _qwen3() -> str:
    layout = turns.CHATML
    empty = _emit(2, quoted(turns.EMPTY_THINKING))
    think = turns.THINKING_OPENING.strip()
    return (
        "{%- set ns = namespace(last_user=-1) -%}\n{%- for message in messages -%}\n"
        "    {%- if message['role'] == 'user' -%}\n        {%- set ns.last_user = loop.index0 -%}\n"
        "    {%- endif -%}\n{%- endfor -%}\n{%- for message in messages -%}\n"
        + _emit(1, _header(layout, "message['role']"))
        + "    {%- if message['role'] == 'assistant' and loop.index0 > ns.last_user and "
        + f"{quoted(think)} not in message['content'] -%}}\n"
        + empty
        + "    {%- endif -%}\n"
        + _emit(1, f"message['content'] + {quoted(layout.assistant.close)}")
        + "{%- endfor -%}\n"
        + _generation_prompt(
            layout.assistant.open,
            "    {%- if enable_thinking is defined and enable_thinking is false -%}\n"
            + _emit(2, quoted(turns.EMPTY_THINKING))
            + "    {%- endif -%}\n",
        )
    )


def _gemma() -> str:
    layout = turns.GEMMA
    start, end = layout.header
    model = layout.assistant.open.removeprefix(start).removesuffix(end)
    return (
        _SYSTEM_PREFIX.replace("@FOLD@", quoted(layout.system_fold))
        + "{%- for message in conversation -%}\n    {%- if message['role'] not in ['user', 'assistant'] -%}\n"
        + _emit(
            2, "raise_exception('Gemma accepts the roles system (first message only), user and assistant')"
        )
        + "    {%- endif -%}\n"
        + f"    {{%- set role = {quoted(model)} if message['role'] == 'assistant' else 'user' -%}}\n"
        + "    {%- set prefix = system_prefix if loop.first else '' -%}\n"
        + _emit(
            1, f"{_header(layout, 'role')} + prefix + message['content'] | trim + {quoted(layout.user.close)}"
        )
        + "{%- endfor -%}\n"
        + _generation_prompt(layout.assistant.open)
    )


def _mistral() -> str:
    layout = turns.INST
    return (
        _SYSTEM_PREFIX.replace("@FOLD@", quoted(layout.system_fold))
        + "{%- for message in conversation -%}\n"
        + "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
        + _emit(2, "raise_exception('Mistral turns must alternate user, assistant, user, ...')")
        + "    {%- endif -%}\n    {%- if message['role'] == 'user' -%}\n"
        + "        {%- set prefix = system_prefix if loop.first else '' -%}\n"
        + _emit(
            2,
            f"{quoted(layout.user.open)} + prefix + message['content'] | trim + {quoted(layout.user.close)}",
        )
        + "    {%- else -%}\n"
        + _emit(2, "' ' + message['content'] | trim + eos_token")
        + "    {%- endif -%}\n{%- endfor -%}\n"
    )


def _phi_3() -> str:
    layout = turns.PHI_3
    return (
        "{{- bos_token -}}\n{%- for message in messages -%}\n    {%- if message['role'] == 'system' -%}\n"
        + _emit(2, quoted(layout.system.open))
        + "    {%- elif message['role'] == 'user' -%}\n"
        + _emit(2, quoted(layout.user.open))
        + "    {%- else -%}\n"
        + _emit(2, quoted(layout.assistant.open))
        + "    {%- endif -%}\n"
        + _emit(1, f"message['content'] + {quoted(layout.assistant.close)}")
        + "{%- endfor -%}\n"
        + _generation_prompt(layout.assistant.open, "{%- else -%}\n" + _emit(1, "'<|endoftext|>'"))
    )


def _gpt_oss() -> str:
    layout = turns.HARMONY
    developer, user, assistant = layout.system, layout.user, layout.assistant
    system_text = turns.filled(
        turns.HARMONY_SYSTEM_TEXT, identity="identity", date="strftime_now('%Y-%m-%d')", effort="effort"
    )
    return (
        f"{{%- set identity = model_identity if model_identity is defined else {quoted(turns.HARMONY_IDENTITY)} -%}}\n"
        f"{{%- set effort = reasoning_effort if reasoning_effort is defined else {quoted(turns.HARMONY_DEFAULT_EFFORT)} -%}}\n"
        + _emit(
            0, f"{quoted(turns.HARMONY_SYSTEM.open)} + {system_text} + {quoted(turns.HARMONY_SYSTEM.close)}"
        )
        + "{%- if messages and messages[0]['role'] in ['system', 'developer'] -%}\n"
        "    {%- set developer_message = messages[0]['content'] -%}\n"
        "    {%- set conversation = messages[1:] -%}\n{%- else -%}\n"
        "    {%- set developer_message = '' -%}\n    {%- set conversation = messages -%}\n{%- endif -%}\n"
        "{%- if developer_message -%}\n"
        + _emit(1, f"{quoted(developer.open)} + developer_message + {quoted(developer.close)}")
        + "{%- endif -%}\n{%- for message in conversation -%}\n    {%- if message['role'] == 'user' -%}\n"
        + _emit(2, f"{quoted(user.open)} + message['content'] + {quoted(user.close)}")
        + "    {%- elif loop.last and not add_generation_prompt -%}\n        {%- if 'thinking' in message -%}\n"
        + _emit(
            3,
            f"{quoted(assistant.open + turns.HARMONY_ANALYSIS)} + message['thinking'] + {quoted(assistant.close)}",
        )
        + "        {%- endif -%}\n"
        + _emit(
            2,
            f"{quoted(assistant.open + turns.HARMONY_FINAL)} + message['content'] + {quoted(layout.turn_end)}",
        )
        + "    {%- else -%}\n"
        + _emit(
            2,
            f"{quoted(assistant.open + turns.HARMONY_FINAL)} + message['content'] + {quoted(assistant.close)}",
        )
        + "    {%- endif -%}\n{%- endfor -%}\n"
        + _generation_prompt(assistant.open)
    )


_WRITERS = {
    "llama-3": _llama_3,
    "qwen-2.5": _qwen_2_5,
    "qwen3": _qwen3,
    "gemma": _gemma,
    "mistral": _mistral,
    "phi-3": _phi_3,
    "gpt-oss": _gpt_oss,
}
CHAT_FORMATS = tuple(_WRITERS)


def tiny_chat_template(chat_format: str) -> str:
    """The Jinja chat template of a tiny fixture whose record names `chat_format`."""
    if chat_format not in _WRITERS:
        raise ValueError(
            f"no tiny fixture chat template in the format {chat_format!r}; written: {', '.join(_WRITERS)} "
            "(slothkit/testing/tiny_chat_templates.py)"
        )
    return _WRITERS[chat_format]().strip()


def with_image_parts(template: str, image_marker: str) -> str:
    """`template` taking messages whose content is a list of parts, as image-text processors
    do ({"type": "image"}, {"type": "text", "text": ...}): each such message is first
    rewritten as one string, its text parts in order with `image_marker` where an image
    stands (the text the processor expands into the image's tokens).  A string content
    renders as `template` renders it."""
    return (
        "{%- set image_parts = namespace(messages=[]) -%}\n"
        "{%- for message in messages -%}\n"
        "    {%- if message['content'] is string -%}\n"
        "        {%- set content = message['content'] -%}\n"
        "    {%- else -%}\n"
        "        {%- set joined = namespace(text='') -%}\n"
        "        {%- for part in message['content'] -%}\n"
        "            {%- if part['type'] == 'image' -%}\n"
        f"                {{%- set joined.text = joined.text + {quoted(image_marker)} -%}}\n"
        "            {%- elif part['type'] == 'text' -%}\n"
        "                {%- set joined.text = joined.text + part['text'] -%}\n"
        "            {%- endif -%}\n"
        "        {%- endfor -%}\n"
        "        {%- set content = joined.text -%}\n"
        "    {%- endif -%}\n"
        "    {%- set image_parts.messages = image_parts.messages + [{'role': message['role'], 'content': content}] -%}\n"
        "{%- endfor -%}\n"
        "{%- set messages = image_parts.messages -%}\n" + template
    )
