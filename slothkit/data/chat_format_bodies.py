"""The Jinja bodies of slothkit's chat formats (slothkit.data.chat_formats), one per format.

Each body renders the turns only: `system` is a string or none, `turns` the messages after a
leading system message, and `message[content_key]`, `message[role_key] == user_role` read
the dataset's names; chat_formats.template_source puts the shared prelude (names, default
system text, role checks, BOS) in front. Every assistant reply sits inside
``{% generation %}...{% endgeneration %}`` (the assistant-token masks).

The formats with marked turns write the markers of their layout (slothkit.data.turn_layouts),
which the Ollama Modelfile (slothkit.data.ollama_templates) writes too: _marked_turns for
those with a system turn (ChatML, Qwen3, Qwen3 thinking and Qwen3.5, which add to ChatML's
blocks rather than repeat them; Llama 3, Phi-3, Phi-4), _folded_system_turns for those that
put the system text into the first user turn (Gemma, Mistral).  GPT_OSS writes harmony's
messages (its layout's turns, a message per channel); GEMMA_4 its turns and thought channel.
"""

from slothkit.data.turn_layouts import CHATML as CHATML_TURNS
from slothkit.data.turn_layouts import (
    EMPTY_THINKING,
    GEMMA_4_THINK,
    GEMMA_4_THOUGHT_CLOSING,
    GEMMA_4_THOUGHT_OPENING,
    HARMONY_ANALYSIS,
    HARMONY_DEFAULT_EFFORT,
    HARMONY_FINAL,
    HARMONY_IDENTITY,
    HARMONY_SYSTEM,
    HARMONY_SYSTEM_TEXT,
    THINKING_CLOSING,
    THINKING_OPENING,
    TurnLayout,
    filled,
    quoted,
)
from slothkit.data.turn_layouts import GEMMA as GEMMA_TURNS
from slothkit.data.turn_layouts import GEMMA_4 as GEMMA_4_TURNS
from slothkit.data.turn_layouts import HARMONY as HARMONY_TURNS
from slothkit.data.turn_layouts import INST as INST_TURNS
from slothkit.data.turn_layouts import LLAMA_3 as LLAMA_3_TURNS
from slothkit.data.turn_layouts import PHI_3 as PHI_3_TURNS
from slothkit.data.turn_layouts import PHI_4 as PHI_4_TURNS


def _emit(depth: int, expression: str) -> str:
    return "    " * depth + "{{- " + expression + " -}}\n"


def _marked_turns(
    layout: TurnLayout,
    *,
    trim: bool = False,
    trim_reply: bool | None = None,
    last_user: bool = False,
    reply_setup: str = "",
    reply_opening: str = "",
    reply: str = "message[content_key]",
    prompt: str | None = None,
    prompt_after: str = "",
) -> str:
    """The body of a format whose every turn is marked, system turn included (layout.system).

    trim: strip the system text and each message (the reply too unless trim_reply is False:
    a reply_setup that trims it itself); last_user: set ns.last_user to the index
    of the last user turn; reply_setup: statements before an assistant turn; reply_opening:
    statements inside its generation block, before the reply; reply: the reply's expression;
    prompt: the generation prompt's text (default the assistant turn's opening);
    prompt_after: statements after it.
    """
    trimmed = " | trim" if trim else ""
    reply_trimmed = trimmed if trim_reply is None or trim_reply else ""
    system, user, assistant = layout.system, layout.user, layout.assistant
    body = "\n{%- if system is not none -%}\n"
    body += _emit(1, f"{quoted(system.open)} + system{trimmed} + {quoted(system.close)}")
    body += "{%- endif -%}\n"
    if last_user:
        body += _LAST_USER
    body += "{%- for message in turns -%}\n    {%- if message[role_key] == user_role -%}\n"
    body += _emit(2, f"{quoted(user.open)} + message[content_key]{trimmed} + {quoted(user.close)}")
    body += "    {%- else -%}\n" + reply_setup
    body += _emit(2, quoted(assistant.open))
    body += "        {%- generation -%}\n" + reply_opening
    body += _emit(3, f"{reply}{reply_trimmed} + {quoted(assistant.close)}")
    body += "        {%- endgeneration -%}\n    {%- endif -%}\n{%- endfor -%}\n"
    body += "{%- if add_generation_prompt -%}\n"
    body += _emit(1, quoted(assistant.open if prompt is None else prompt)) + prompt_after
    return body + "{%- endif -%}\n"


def _folded_system_turns(
    layout: TurnLayout, *, trim: bool = False, reply: str = "message[content_key]"
) -> str:
    """The body of a format without a system turn (layout.system None): the system text goes
    before the first user text. trim and reply as for _marked_turns; a reply without an
    opening marker (INST) has no generation prompt: the user turn prompts it."""
    trimmed = " | trim" if trim else ""
    user, assistant = layout.user, layout.assistant
    close = "eos_token" if layout.turn_end is None else quoted(assistant.close)
    body = "\n{%- for message in turns -%}\n    {%- if message[role_key] == user_role -%}\n"
    body += f"        {{%- set prefix = system{trimmed} + {quoted(layout.system_fold)} if loop.first and system else '' -%}}\n"
    body += _emit(2, f"{quoted(user.open)} + prefix + message[content_key]{trimmed} + {quoted(user.close)}")
    body += "    {%- else -%}\n"
    if assistant.open:
        body += _emit(2, quoted(assistant.open))
    body += "        {%- generation -%}\n"
    body += _emit(3, f"{reply}{trimmed} + {close}")
    body += "        {%- endgeneration -%}\n    {%- endif -%}\n{%- endfor -%}\n"
    if assistant.open:
        body += "{%- if add_generation_prompt -%}\n" + _emit(1, quoted(assistant.open)) + "{%- endif -%}\n"
    return body


# The index of the last user turn: the current exchange's answers follow it.
_LAST_USER = r"""{%- set ns = namespace(last_user=-1) -%}
{%- for message in turns -%}
    {%- if message[role_key] == user_role -%}
        {%- set ns.last_user = loop.index0 -%}
    {%- endif -%}
{%- endfor -%}
"""

CHATML = _marked_turns(CHATML_TURNS)

# Qwen3's: the model writes its reasoning between <think> and </think> before the answer
# of the current exchange (the turns after the last user turn); an answer given there
# without reasoning is rendered with an empty block, as Qwen3's own template renders it,
# and is trained that way. Earlier answers are rendered plain.
QWEN3 = _marked_turns(
    CHATML_TURNS,
    last_user=True,
    reply_opening=(
        "            {%- if loop.index0 > ns.last_user and '<think>' not in message[content_key] -%}\n"
        + _emit(4, quoted(EMPTY_THINKING))
        + "            {%- endif -%}\n"
    ),
    prompt_after=(
        "    {%- if enable_thinking is defined and enable_thinking is false -%}\n"
        + _emit(2, quoted(EMPTY_THINKING))
        + "    {%- endif -%}\n"
    ),
)

# Qwen3's thinking-only models (Qwen3-*-Thinking-2507): the generation prompt opens the
# thinking block itself, so the model writes its reasoning, "</think>" and the answer.  An
# answer after the last user turn is written <think>\n{reasoning}\n</think>\n\n{answer},
# its reasoning what stood before "</think>" in the message (none: an empty block);
# earlier answers keep only what follows their "</think>", as Qwen's own template drops
# the reasoning of past turns.  enable_thinking has no effect.
QWEN3_THINKING = _marked_turns(
    CHATML_TURNS,
    last_user=True,
    reply_setup=r"""        {%- set answer = message[content_key] -%}
        {%- set reasoning = '' -%}
        {%- if '</think>' in answer -%}
            {%- set reasoning = answer.split('</think>')[0].split('<think>')[-1].strip('\n') -%}
            {%- set answer = answer.split('</think>')[-1].lstrip('\n') -%}
        {%- endif -%}
""",
    reply_opening=(
        "            {%- if loop.index0 > ns.last_user -%}\n"
        + _emit(4, f"{quoted(THINKING_OPENING)} + reasoning + {quoted(THINKING_CLOSING)}")
        + "            {%- endif -%}\n"
    ),
    reply="answer",
    prompt=CHATML_TURNS.assistant.open + THINKING_OPENING,
)

# Qwen3.5's (Qwen3.5-4B and larger): Qwen3 Thinking's blocks, with every text trimmed, the
# reasoning read from the message's `thinking` where it has one (else from before "</think>"
# in its text), and a switch: enable_thinking=False closes the block in the generation
# prompt so that the model answers at once.
QWEN3_5 = _marked_turns(
    CHATML_TURNS,
    trim=True,
    trim_reply=False,
    last_user=True,
    reply_setup=r"""        {%- set answer = message[content_key] | trim -%}
        {%- set reasoning = '' -%}
        {%- if message['thinking'] is string -%}
            {%- set reasoning = message['thinking'] -%}
        {%- elif '</think>' in answer -%}
            {%- set reasoning = answer.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') -%}
            {%- set answer = answer.split('</think>')[-1].lstrip('\n') -%}
        {%- endif -%}
""",
    reply_opening=(
        "            {%- if loop.index0 > ns.last_user -%}\n"
        + _emit(4, f"{quoted(THINKING_OPENING)} + reasoning | trim + {quoted(THINKING_CLOSING)}")
        + "            {%- endif -%}\n"
    ),
    reply="answer",
    prompt_after=(
        "    {%- if enable_thinking is defined and enable_thinking is false -%}\n"
        + _emit(2, quoted(EMPTY_THINKING))
        + "    {%- else -%}\n"
        + _emit(2, quoted(THINKING_OPENING))
        + "    {%- endif -%}\n"
    ),
)


def _gemma_4() -> str:
    """Gemma 4's turns, as its own template writes conversations without tools: a system turn
    for the system text, opened by <|think|> when enable_thinking is on (a system turn of its
    own if the conversation has no system text); every text trimmed; a reply after the last
    user turn preceded by its `thinking` in the thought channel, and every reply rid of the
    channel blocks its text holds ("<|channel>...<channel|>"), as the model's own template
    drops past reasoning."""
    layout = GEMMA_4_TURNS
    system, user, assistant = layout.system, layout.user, layout.assistant
    body = "\n{%- set thinking_on = enable_thinking is defined and enable_thinking -%}\n"
    body += "{%- if system is not none or thinking_on -%}\n"
    body += _emit(1, quoted(system.open))
    body += "    {%- if thinking_on -%}\n" + _emit(2, quoted(GEMMA_4_THINK)) + "    {%- endif -%}\n"
    body += "    {%- if system is not none -%}\n" + _emit(2, "system | trim") + "    {%- endif -%}\n"
    body += _emit(1, quoted(system.close)) + "{%- endif -%}\n" + _LAST_USER
    body += "{%- for message in turns -%}\n    {%- if message[role_key] == user_role -%}\n"
    body += _emit(2, f"{quoted(user.open)} + message[content_key] | trim + {quoted(user.close)}")
    body += "    {%- else -%}\n"
    body += "        {%- set current = loop.index0 > ns.last_user -%}\n"
    body += "        {%- set answer = namespace(text='') -%}\n"
    body += "        {%- for piece in message[content_key].split('<channel|>') -%}\n"
    body += "            {%- set answer.text = answer.text + piece.split('<|channel>')[0] -%}\n"
    body += "        {%- endfor -%}\n"
    body += _emit(2, quoted(assistant.open))
    body += "        {%- generation -%}\n"
    body += "            {%- if current and message['thinking'] -%}\n"
    body += _emit(
        4, f"{quoted(GEMMA_4_THOUGHT_OPENING)} + message['thinking'] + {quoted(GEMMA_4_THOUGHT_CLOSING)}"
    )
    body += "            {%- endif -%}\n"
    body += _emit(3, f"answer.text | trim + {quoted(assistant.close)}")
    body += "        {%- endgeneration -%}\n    {%- endif -%}\n{%- endfor -%}\n"
    body += "{%- if add_generation_prompt -%}\n" + _emit(1, quoted(assistant.open)) + "{%- endif -%}\n"
    return body


GEMMA_4 = _gemma_4()

# FastChat's ADD_COLON_TWO style: system + " ", then "USER: u" + " " and
# "ASSISTANT: a" + "</s>"; an open assistant turn is "ASSISTANT:".
VICUNA = r"""
{%- if system -%}
    {{- system + ' ' -}}
{%- endif -%}
{%- for message in turns -%}
    {%- if message[role_key] == user_role -%}
        {{- 'USER: ' + message[content_key] + ' ' -}}
    {%- else -%}
        {{- 'ASSISTANT:' -}}
        {%- generation -%}
            {{- ' ' + message[content_key] + eos_token -}}
        {%- endgeneration -%}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- 'ASSISTANT:' -}}
{%- endif -%}
"""

ZEPHYR = r"""
{%- if system is not none -%}
    {{- '<|system|>\n' + system + eos_token + '\n' -}}
{%- endif -%}
{%- for message in turns -%}
    {%- if message[role_key] == user_role -%}
        {{- '<|user|>\n' + message[content_key] + eos_token + '\n' -}}
    {%- else -%}
        {{- '<|assistant|>\n' -}}
        {%- generation -%}
            {{- message[content_key] + eos_token + '\n' -}}
        {%- endgeneration -%}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|assistant|>\n' -}}
{%- endif -%}
"""

# One turn is Stanford Alpaca's prompt exactly ("<preamble>\n\n### Instruction:\n...\n\n
# ### Response:\n") followed by the response and EOS; further turns repeat the two headers.
ALPACA = r"""
{%- if system -%}
    {{- system + '\n\n' -}}
{%- endif -%}
{%- for message in turns -%}
    {%- if message[role_key] == user_role -%}
        {{- '### Instruction:\n' + message[content_key] + '\n\n' -}}
    {%- else -%}
        {{- '### Response:\n' -}}
        {%- generation -%}
            {{- message[content_key] + eos_token + '\n\n' -}}
        {%- endgeneration -%}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '### Response:\n' -}}
{%- endif -%}
"""

LLAMA_3 = _marked_turns(LLAMA_3_TURNS, trim=True)

GEMMA = _folded_system_turns(GEMMA_TURNS, trim=True)

# The prompt of an open assistant turn is the user turn itself: no generation prompt.
MISTRAL = _folded_system_turns(INST_TURNS, reply="' ' + message[content_key]")

# Meta's layout: the system text inside the first [INST], every later exchange opened by
# BOS (when the tokenizer has one), each reply followed by " " and EOS.
LLAMA_2 = r"""
{%- for message in turns -%}
    {%- if message[role_key] == user_role -%}
        {%- if not loop.first and bos_token -%}
            {{- bos_token -}}
        {%- endif -%}
        {%- set prefix = '<<SYS>>\n' + system + '\n<</SYS>>\n\n' if loop.first and system else '' -%}
        {{- '[INST] ' + prefix + message[content_key] | trim + ' [/INST]' -}}
    {%- else -%}
        {%- generation -%}
            {{- ' ' + message[content_key] | trim + ' ' + eos_token -}}
        {%- endgeneration -%}
    {%- endif -%}
{%- endfor -%}
"""

PHI_3 = _marked_turns(PHI_3_TURNS)

# Phi-4: ChatML's tokens with <|im_sep|> after the role and no newline anywhere.
PHI_4 = _marked_turns(PHI_4_TURNS)

# FastChat's first Vicuna layout (turns "### Human: " and "### Assistant: ", one per line),
# with EOS closing each reply so that generation stops there.
VICUNA_OLD = r"""
{%- if system -%}
    {{- system + '\n' -}}
{%- endif -%}
{%- for message in turns -%}
    {%- if message[role_key] == user_role -%}
        {{- '### Human: ' + message[content_key] + '\n' -}}
    {%- else -%}
        {{- '### Assistant:' -}}
        {%- generation -%}
            {{- ' ' + message[content_key] + eos_token + '\n' -}}
        {%- endgeneration -%}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '### Assistant:' -}}
{%- endif -%}
"""


def _harmony() -> str:
    """gpt-oss's harmony messages, as its own template writes them for conversations without
    tools: harmony's system message (identity, knowledge cutoff, today's date, reasoning
    effort: the `model_identity` and `reasoning_effort` arguments of apply_chat_template,
    default "medium"), the dataset's system text as the developer message, then the turns.
    An answer is a message in the final channel; the last turn of a training text (an
    answer, no generation prompt) ends with <|return|> and is preceded by its reasoning in
    the analysis channel when the message carries `thinking`. Earlier answers end with
    <|end|> and lose their reasoning.  Each message's "<|start|>assistant" opens the reply
    (response_part), so the generation block holds the rest of the message."""
    layout = HARMONY_TURNS
    developer, user, assistant = layout.system, layout.user, layout.assistant
    system_text = filled(
        HARMONY_SYSTEM_TEXT,
        identity="harmony.identity",
        date="strftime_now('%Y-%m-%d')",
        effort="harmony.effort",
    )

    def message(depth: int, channel: str, text: str, close: str) -> str:
        return (
            _emit(depth, quoted(assistant.open))
            + "    " * depth
            + "{%- generation -%}\n"
            + _emit(depth + 1, f"{quoted(channel)} + {text} + {quoted(close)}")
            + "    " * depth
            + "{%- endgeneration -%}\n"
        )

    body = "\n{%- if tools is defined and tools or builtin_tools is defined and builtin_tools -%}\n"
    body += _emit(
        1,
        "raise_exception('chat template gpt-oss: slothkit renders conversations without tools; "
        "for tools and tool calls keep the tokenizer\\'s own gpt-oss template (do not call get_chat_template on it)')",
    )
    body += "{%- endif -%}\n"
    body += f"{{%- set harmony = namespace(identity={quoted(HARMONY_IDENTITY)}, effort={quoted(HARMONY_DEFAULT_EFFORT)}) -%}}\n"
    body += "{%- if model_identity is defined -%}\n    {%- set harmony.identity = model_identity -%}\n{%- endif -%}\n"
    body += "{%- if reasoning_effort is defined -%}\n    {%- set harmony.effort = reasoning_effort -%}\n{%- endif -%}\n"
    body += _emit(0, f"{quoted(HARMONY_SYSTEM.open)} + {system_text} + {quoted(HARMONY_SYSTEM.close)}")
    body += "{%- if system -%}\n"
    body += _emit(1, f"{quoted(developer.open)} + system + {quoted(developer.close)}")
    body += "{%- endif -%}\n{%- for message in turns -%}\n    {%- if message[role_key] == user_role -%}\n"
    body += _emit(2, f"{quoted(user.open)} + message[content_key] + {quoted(user.close)}")
    body += (
        "    {%- elif loop.last and not add_generation_prompt -%}\n        {%- if 'thinking' in message -%}\n"
    )
    body += message(3, HARMONY_ANALYSIS, "message['thinking']", assistant.close)
    body += "        {%- endif -%}\n"
    body += message(2, HARMONY_FINAL, "message[content_key]", layout.turn_end)
    body += "    {%- else -%}\n"
    body += message(2, HARMONY_FINAL, "message[content_key]", assistant.close)
    body += "    {%- endif -%}\n{%- endfor -%}\n"
    body += "{%- if add_generation_prompt -%}\n" + _emit(1, quoted(assistant.open)) + "{%- endif -%}\n"
    return body


GPT_OSS = _harmony()
