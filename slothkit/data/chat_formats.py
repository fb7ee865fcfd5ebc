"""The chat formats slothkit can install on a tokenizer, as data.

Each format is written from its authors' public description:

    name      turn layout (u: user text, a: assistant text, s: system text)              source
    chatml    <|im_start|>system\\ns<|im_end|>\\n<|im_start|>user\\nu<|im_end|>\\n          OpenAI ChatML, as used by
              <|im_start|>assistant\\na<|im_end|>\\n                                      Qwen and OpenHermes
    vicuna    s USER: u ASSISTANT: a</s>USER: ...                                        FastChat "vicuna_v1.1"
    zephyr    <|system|>\\ns</s>\\n<|user|>\\nu</s>\\n<|assistant|>\\na</s>\\n              HuggingFaceH4/zephyr-7b-beta
    alpaca    s\\n\\n### Instruction:\\nu\\n\\n### Response:\\na</s>\\n\\n                  Stanford Alpaca prompt
    llama-3   <|start_header_id|>user<|end_header_id|>\\n\\nu<|eot_id|>...                Meta Llama 3 Instruct
    gemma     <start_of_turn>user\\nu<end_of_turn>\\n                                    Gemma instruct (system text
              <start_of_turn>model\\na<end_of_turn>\\n                                   goes before the first user
                                                                                         text, as Gemma 3 does)
    mistral   [INST] u [/INST] a</s>[INST] ...                                           Mistral Instruct v1 (the
                                                                                         mistral-common "v1" tokenizer;
                                                                                         system text before the first
                                                                                         user text)
    llama-2   [INST] <<SYS>>\ns\n<</SYS>>\n\nu [/INST] a </s><s>[INST] u [/INST] ...     Meta Llama 2 Chat
    qwen-2.5  ChatML, with "You are Qwen, created by Alibaba Cloud. You are a helpful      Qwen2.5 Instruct
              assistant." as the system text of conversations that have none
    qwen3     ChatML; an answer after the last user turn opens with an empty               Qwen3 (hybrid thinking)
              <think>\n\n</think>\n\n unless it holds its own; the generation prompt
              closes one itself with enable_thinking=False
    qwen3-thinking  ChatML; the generation prompt is <|im_start|>assistant\n<think>\n;      Qwen3 Thinking-2507
              the answer after the last user turn is <think>\n{reasoning}\n</think>\n\n{answer},
              earlier answers lose their reasoning ("qwen3-instruct", Instruct-2507, is chatml)
    qwen3.5   ChatML, every text trimmed; as qwen3-thinking, the generation prompt      Qwen3.5 (4B and larger)
              opens <think>\n unless enable_thinking=False, which closes it
              (<think>\n\n</think>\n\n); a message's `thinking` is its reasoning
    phi-3     <|system|>\ns<|end|>\n<|user|>\nu<|end|>\n<|assistant|>\na<|end|>\n         Microsoft Phi-3 / 3.5 Instruct
    phi-4     <|im_start|>user<|im_sep|>u<|im_end|><|im_start|>assistant<|im_sep|>a<|im_end|>  Microsoft Phi-4
    vicuna_old s\n### Human: u\n### Assistant: a</s>\n### Human: ...                     FastChat's first Vicuna
                                                                                         layout ("### Human:" /
                                                                                         "### Assistant:" turns)
    gpt-oss   <|start|>system<|message|>(identity, cutoff, date, reasoning effort)<|end|> OpenAI harmony (gpt-oss),
              <|start|>developer<|message|># Instructions\n\ns\n\n<|end|>                as gpt-oss's own template
              <|start|>user<|message|>u<|end|>                                          renders conversations
              <|start|>assistant<|channel|>final<|message|>a<|end|>                     without tools
              the last answer: its `thinking` as <|start|>assistant<|channel|>analysis<|message|>r<|end|>,
              then the answer closed by <|return|>; earlier answers lose their thinking;
              a leading "developer" message is the system text
    gemma-4   <|turn>system\ns<turn|>\n<|turn>user\nu<turn|>\n<|turn>model\na<turn|>\n     Gemma 4 instruct, as its own
              enable_thinking=True opens the system turn with <|think|>\n; the last        template renders
              answer's `thinking` goes first in <|channel>thought\n...\n<channel|>;     conversations without tools
              a leading "developer" message is the system text

Every template starts with the tokenizer's BOS when the tokenizer puts one in front of
plain text (the model was pre-trained on documents that start with it), and nowhere else
but in llama-2, whose every later exchange opens with BOS too, as Meta's format has it.

Every assistant reply is wrapped in ``{% generation %}...{% endgeneration %}`` so that
``apply_chat_template(..., return_assistant_tokens_mask=True)`` (TRL's
``assistant_only_loss``) marks exactly the reply, its end-of-turn token and the separator
up to the next turn: the same tokens that ``train_on_responses_only`` keeps with the
format's ``instruction_part`` / ``response_part`` markers.

A template is assembled from a prelude generated here (the dataset's field and role names,
the default system message, whether to emit BOS, and the checks every format shares) and
the format's own body (chat_format_bodies.py).  The first line names the format, so that
the markers can be found again from ``tokenizer.chat_template`` after a save and reload.
"""

from __future__ import annotations

import dataclasses
import re

from slothkit.data import chat_format_bodies as bodies
from slothkit.data import turn_layouts as turns

TEMPLATE_TAG = "{#- slothkit chat template: "
_TAG_PATTERN = re.compile(r"^\{#- slothkit chat template: ([a-z0-9._-]+) -#\}")

# Keys of `mapping`: the names the dataset uses for these five things.
MAPPING_KEYS = ("role", "content", "user", "assistant", "system")
DEFAULT_MAPPING = {key: key for key in MAPPING_KEYS}
_NAME_PATTERN = re.compile(r"[A-Za-z0-9_. -]+")


@dataclasses.dataclass(frozen=True)
class ChatFormat:
    name: str
    body: str  # Jinja for the turns; reads `system`, `turns` and the mapped names
    instruction_part: str  # opens a user turn: a trainable span ends where it starts
    response_part: str  # opens an assistant turn: a trainable span starts where it ends
    turn_end: str | None  # token closing an assistant turn; None: the tokenizer's EOS
    special_tokens: tuple[str, ...]  # markers the format's own tokenizers hold as single tokens
    default_system: str | None  # system text used when a conversation has none
    alternate: bool  # turns must alternate user, assistant, user, ...
    source: str
    also_system: tuple[str, ...] = ()  # roles besides the system role a leading system message may have


def _markers(layout: turns.TurnLayout, also: tuple[str, ...] = ()) -> dict:
    """A marked format's instruction_part, response_part, turn_end and special tokens, read
    from its turns (slothkit.data.turn_layouts). A reply without an opening marker (INST)
    starts where the user turn closes; the parts lose the spaces around them ("[INST] "),
    which tokenisers join to the next word."""
    return {
        "instruction_part": layout.user.open.strip(" "),
        "response_part": (layout.assistant.open or layout.user.close).strip(" "),
        "turn_end": layout.turn_end,
        "special_tokens": layout.special_tokens + also,
    }


FORMATS: dict[str, ChatFormat] = {
    f.name: f
    for f in (
        ChatFormat(
            name="chatml",
            body=bodies.CHATML,
            **_markers(turns.CHATML),
            default_system=None,
            alternate=False,
            source="OpenAI ChatML (Qwen, OpenHermes)",
        ),
        ChatFormat(
            name="vicuna",
            body=bodies.VICUNA,
            instruction_part="USER:",
            response_part="ASSISTANT:",
            turn_end=None,
            special_tokens=(),
            default_system=(
                "A chat between a curious user and an artificial intelligence assistant. "
                "The assistant gives helpful, detailed, and polite answers to the user's questions."
            ),
            alternate=True,
            source='FastChat conversation template "vicuna_v1.1"',
        ),
        ChatFormat(
            name="zephyr",
            body=bodies.ZEPHYR,
            instruction_part="<|user|>\n",
            response_part="<|assistant|>\n",
            turn_end=None,
            special_tokens=(),  # plain text in Zephyr's own tokenizer
            default_system=None,
            alternate=False,
            source="HuggingFaceH4/zephyr-7b-beta chat template",
        ),
        ChatFormat(
            name="alpaca",
            body=bodies.ALPACA,
            instruction_part="### Instruction:\n",
            response_part="### Response:\n",
            turn_end=None,
            special_tokens=(),
            default_system=(
                "Below is an instruction that describes a task. "
                "Write a response that appropriately completes the request."
            ),
            alternate=True,
            source="Stanford Alpaca prompt (no-input variant)",
        ),
        ChatFormat(
            name="llama-3",
            body=bodies.LLAMA_3,
            **_markers(turns.LLAMA_3),
            default_system=None,
            alternate=False,
            source="Meta Llama 3 Instruct",
        ),
        ChatFormat(
            name="gemma",
            body=bodies.GEMMA,
            **_markers(turns.GEMMA),
            default_system=None,
            alternate=True,
            source="Gemma instruct (system text as Gemma 3 places it)",
        ),
        ChatFormat(
            name="mistral",
            body=bodies.MISTRAL,
            **_markers(turns.INST),  # plain text in the v1 tokenizer; control tokens from v3 on
            default_system=None,
            alternate=True,
            source="Mistral Instruct v1 (mistral-common's v1 tokenizer)",
        ),
        ChatFormat(
            name="llama-2",
            body=bodies.LLAMA_2,
            **_markers(turns.INST),  # plain text in Llama 2's tokenizer
            default_system=None,
            alternate=True,
            source="Meta Llama 2 Chat",
        ),
        ChatFormat(
            name="qwen-2.5",
            body=bodies.CHATML,
            **_markers(turns.CHATML),
            default_system="You are Qwen, created by Alibaba Cloud. You are a helpful assistant.",
            alternate=False,
            source="Qwen2.5 Instruct (ChatML with Qwen's default system text)",
        ),
        ChatFormat(
            name="qwen3",
            body=bodies.QWEN3,
            **_markers(turns.CHATML, also=("<think>", "</think>")),
            default_system=None,
            alternate=False,
            source="Qwen3 (ChatML with its thinking block)",
        ),
        ChatFormat(
            name="qwen3-thinking",
            body=bodies.QWEN3_THINKING,
            **_markers(turns.CHATML, also=("<think>", "</think>")),
            default_system=None,
            alternate=False,
            source="Qwen3 Thinking-2507 (ChatML; the generation prompt opens the thinking block)",
        ),
        ChatFormat(
            name="qwen3.5",
            body=bodies.QWEN3_5,
            **_markers(turns.CHATML, also=("<think>", "</think>")),
            default_system=None,
            alternate=False,
            source="Qwen3.5-4B and larger (ChatML; thinking on unless enable_thinking=False)",
        ),
        ChatFormat(
            name="phi-3",
            body=bodies.PHI_3,
            **_markers(turns.PHI_3),
            default_system=None,
            alternate=False,
            source="Microsoft Phi-3 / Phi-3.5 Instruct",
        ),
        ChatFormat(
            name="phi-4",
            body=bodies.PHI_4,
            **_markers(turns.PHI_4),
            default_system=None,
            alternate=False,
            source="Microsoft Phi-4",
        ),
        ChatFormat(
            name="vicuna_old",
            body=bodies.VICUNA_OLD,
            instruction_part="### Human:",
            response_part="### Assistant:",
            turn_end=None,
            special_tokens=(),
            default_system=(
                "A chat between a curious human and an artificial intelligence assistant. "
                "The assistant gives helpful, detailed, and polite answers to the human's questions."
            ),
            alternate=True,
            source="FastChat's first Vicuna conversation layout",
        ),
        ChatFormat(
            name="gpt-oss",
            body=bodies.GPT_OSS,
            **_markers(turns.HARMONY),
            default_system=None,
            alternate=False,
            source="OpenAI harmony, as gpt-oss's own chat template renders conversations without tools",
            also_system=("developer",),
        ),
        ChatFormat(
            name="gemma-4",
            body=bodies.GEMMA_4,
            **_markers(turns.GEMMA_4, also=turns.GEMMA_4_CHANNEL_TOKENS),
            default_system=None,
            # Gemma 4's own template merges consecutive replies into one turn; slothkit asks
            # for alternating turns rather than render those differently.
            alternate=True,
            source="Gemma 4 instruct (its own template without tools; thinking with enable_thinking=True)",
            also_system=("developer",),
        ),
    )
}

ALIASES = {
    "llama3": "llama-3",
    "llama-3.1": "llama-3",
    "llama-31": "llama-3",
    "llama-3.2": "llama-3",
    "llama-3.3": "llama-3",
    "gemma2": "gemma",
    "gemma-2": "gemma",
    "gemma3": "gemma",
    "gemma-3": "gemma",
    "llama": "llama-2",
    "llama2": "llama-2",
    "qwen2.5": "qwen-2.5",
    "qwen-25": "qwen-2.5",
    "qwen25": "qwen-2.5",
    "qwen-3": "qwen3",
    "qwen3-instruct": "chatml",  # Qwen3 Instruct-2507: ChatML, no thinking, no default system
    "qwen-3-instruct": "chatml",
    "qwen-3-thinking": "qwen3-thinking",
    "qwen-3.5": "qwen3.5",
    "qwen3_5": "qwen3.5",
    "qwen35": "qwen3.5",
    "gemma4": "gemma-4",
    "gemma_4": "gemma-4",
    "phi3": "phi-3",
    "phi-3.5": "phi-3",
    "phi-35": "phi-3",
    "phi4": "phi-4",
    "gpt_oss": "gpt-oss",
    "gptoss": "gpt-oss",
    "harmony": "gpt-oss",
}

# Names older notebooks use for formats slothkit does not ship, and what to write instead.
REFUSED = {
    "unsloth": "it is Unsloth's own house layout, which slothkit does not reproduce; pick a named format "
    "such as 'chatml' (for a base model any of them trains; the model then expects that one)",
}


def format_named(name: str) -> ChatFormat:
    key = ALIASES.get(name.lower(), name.lower()) if isinstance(name, str) else name
    if key in REFUSED:
        raise ValueError(f"chat template {name!r} is not available: {REFUSED[key]}")
    if key not in FORMATS:
        raise ValueError(
            f"unknown chat template {name!r}; accepted: {', '.join(FORMATS)} "
            "(or 'model' for the tokenizer's own template)"
        )
    return FORMATS[key]


def format_of_template(template: str | None) -> ChatFormat | None:
    """The slothkit format a template was built from (read from its first line), if any."""
    if not template:
        return None
    match = _TAG_PATTERN.match(template)
    return FORMATS.get(match.group(1)) if match else None


def check_mapping(mapping: dict | None) -> dict[str, str]:
    if mapping is None:
        return dict(DEFAULT_MAPPING)
    if not isinstance(mapping, dict):
        raise TypeError(
            f"mapping must be a dict such as {{'role': 'from', 'content': 'value'}}; got {mapping!r}"
        )
    unknown = set(mapping) - set(MAPPING_KEYS)
    if unknown:
        raise ValueError(
            f"mapping has unknown keys {sorted(unknown)}; accepted keys: {', '.join(MAPPING_KEYS)}"
        )
    merged = {**DEFAULT_MAPPING, **mapping}
    for key, value in merged.items():
        # The names are written into the template (and its error messages) verbatim.
        if not isinstance(value, str) or not _NAME_PATTERN.fullmatch(value):
            raise ValueError(
                f"mapping[{key!r}] must be a field or role name made of letters, digits, '_', '-', '.' "
                f"or spaces; got {value!r}"
            )
    roles = [merged["user"], merged["assistant"], merged["system"]]
    if len(set(roles)) != 3:
        raise ValueError(f"mapping gives the user, assistant and system roles the same name: {roles}")
    return merged


def jinja_string(value: str) -> str:
    """A Jinja string literal for any text.

    Jinja decodes literals with Python's unicode-escape codec, so every character outside
    plain ASCII punctuation and letters is written as \\UXXXXXXXX; this also keeps '{', '}',
    '%' and '#' out of the template's own syntax, and '@' out of template_source's fields.
    """
    safe = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,;:!?'()-_/+*=&$<>[]|^~`")
    return '"' + "".join(ch if ch in safe else f"\\U{ord(ch):08x}" for ch in value) + '"'


# Shared by every format: the dataset's names, the default system text, each message's
# content as text (a list of typed parts, as transformers' multimodal chat messages and
# Unsloth's Gemma 3 notebooks write it, is joined from its text parts) and its `thinking`
# where it has one (the reasoning gpt-oss's format writes), the split of a leading system
# message from the turns, the role checks, and BOS.  @NAME@-style fields are
# filled in by template_source (names are restricted to characters safe in a Jinja string).
_PRELUDE = r"""{#- slothkit chat template: @NAME@ -#}
{%- set role_key = @ROLE_KEY@ -%}
{%- set content_key = @CONTENT_KEY@ -%}
{%- set user_role = @USER_ROLE@ -%}
{%- set assistant_role = @ASSISTANT_ROLE@ -%}
{%- set system_role = @SYSTEM_ROLE@ -%}
{%- set system_roles = [system_role]@ALSO_SYSTEM@ -%}
{%- set default_system = @DEFAULT_SYSTEM@ -%}
{%- macro text_of(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- else -%}
        {%- for part in content -%}
            {%- if part['type'] != 'text' -%}
                {{- raise_exception('chat template @NAME@: a message part of type ' ~ part['type'] ~ ' cannot be rendered; slothkit trains text models, whose messages hold text parts only') -}}
            {%- endif -%}
            {{- part['text'] -}}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- set text = namespace(messages=[]) -%}
{%- for message in messages -%}
    {%- if 'thinking' in message -%}
        {%- set text.messages = text.messages + [{role_key: message[role_key], content_key: text_of(message[content_key]), 'thinking': message['thinking']}] -%}
    {%- else -%}
        {%- set text.messages = text.messages + [{role_key: message[role_key], content_key: text_of(message[content_key])}] -%}
    {%- endif -%}
{%- endfor -%}
{%- if text.messages and text.messages[0][role_key] in system_roles -%}
    {%- set system = text.messages[0][content_key] -%}
    {%- set turns = text.messages[1:] -%}
{%- else -%}
    {%- set system = default_system -%}
    {%- set turns = text.messages -%}
{%- endif -%}
{%- for message in turns -%}
    {%- if message[role_key] not in [user_role, assistant_role] -%}
        {{- raise_exception('chat template @NAME@: message role ' ~ message[role_key] ~ ' is not accepted here; accepted roles: @ROLES@') -}}
    {%- endif -%}
@ALTERNATION@
{%- endfor -%}
@BOS@
"""

_ALTERNATION = r"""    {%- if (message[role_key] == user_role) != (loop.index0 % 2 == 0) -%}
        {{- raise_exception('chat template @NAME@: turns must alternate @ORDER@') -}}
    {%- endif -%}"""


def with_turn_end(fmt: ChatFormat, token: str) -> ChatFormat:
    """`fmt` writing `token` wherever it ends a turn: the tokenizer's EOS standing in for a
    turn-end token the tokenizer lacks (slothkit.data.marker_tokens).  Every body writes
    its turn end inside single-quoted string literals, where `token` goes escaped as
    jinja_string escapes it, its single quotes too."""
    if fmt.turn_end is None:
        raise ValueError(f"chat format {fmt.name!r} ends turns with the tokenizer's EOS already")
    literal = jinja_string(token)[1:-1].replace("'", "\\U00000027")
    return dataclasses.replace(fmt, body=fmt.body.replace(fmt.turn_end, literal), turn_end=token)


def template_source(
    fmt: ChatFormat, *, mapping: dict[str, str], system_message: str | None, use_bos: bool
) -> str:
    """The full Jinja template of `fmt` for the given field names, default system text and BOS rule."""
    default_system = fmt.default_system if system_message is None else system_message
    fields = {
        "@ALTERNATION@": _ALTERNATION if fmt.alternate else "",
        "@BOS@": "{{- bos_token -}}" if use_bos else "",
        "@NAME@": fmt.name,
        "@ROLE_KEY@": jinja_string(mapping["role"]),
        "@CONTENT_KEY@": jinja_string(mapping["content"]),
        "@USER_ROLE@": jinja_string(mapping["user"]),
        "@ASSISTANT_ROLE@": jinja_string(mapping["assistant"]),
        "@SYSTEM_ROLE@": jinja_string(mapping["system"]),
        "@DEFAULT_SYSTEM@": "none" if default_system is None else jinja_string(default_system),
        "@ALSO_SYSTEM@": "".join(f" + [{jinja_string(role)}]" for role in fmt.also_system),
        "@ROLES@": f"{' or '.join((mapping['system'], *fmt.also_system))} (first message only), "
        f"{mapping['user']}, {mapping['assistant']}",
        "@ORDER@": f"{mapping['user']}, {mapping['assistant']}, {mapping['user']}, ...",
    }
    prelude = _PRELUDE
    for field, value in fields.items():  # the first two bring @NAME@ and @ORDER@ with them
        prelude = prelude.replace(field, value)
    return prelude + fmt.body.strip() + "\n"


_MAPPED_NAME = re.compile(
    r'\{%- set (role_key|content_key|user_role|assistant_role|system_role) = "([^"]*)" -%\}'
)
_MAPPED_KEYS = {
    "role_key": "role",
    "content_key": "content",
    "user_role": "user",
    "assistant_role": "assistant",
    "system_role": "system",
}


def mapping_of_template(template: str | None) -> dict[str, str] | None:
    """The dataset names a slothkit template was built for (None for other templates)."""
    if format_of_template(template) is None:
        return None
    found = dict(_MAPPED_NAME.findall(template))
    return {name: found[variable] for variable, name in _MAPPED_KEYS.items()}
