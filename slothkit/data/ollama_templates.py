"""An Ollama Modelfile for a GGUF file: FROM, TEMPLATE (the chat format in Go-template form) and
stop tokens, so that `ollama create my-model -f Modelfile` gives a chat model.

The Hugging Face chat template is Jinja; Ollama's is a Go template over .System, .Prompt and
.Response (one user turn and the answer; Ollama repeats it for each turn of a conversation).
Jinja cannot be translated mechanically, so the known formats are recognised by their markers
and written from their turns (slothkit.data.turn_layouts, the markers slothkit's Jinja bodies
write too), rendering a (system, user) prompt exactly as the HF template does (BOS excluded:
llama.cpp adds it when the GGUF says add_bos; slothkit.export.gguf.modelfile writes the file):

    marker in the chat template   format
    <|channel|>final<|message|>   gpt-oss (OpenAI harmony, over Ollama's .Messages: its system
                                  message dated by Ollama's currentDate, reasoning "medium";
                                  the system text as the developer message; stops at <|return|>
                                  and <|call|>)
    <|start_header_id|>           Llama 3
    [INST]                        Mistral / Llama 2 ([INST] ... [/INST], system folded into the first turn)
    <|turn>                       Gemma 4 (a system turn, assistant called "model")
    <start_of_turn>               Gemma (system folded into the first turn, assistant called "model")
    qwen3-thinking, qwen3.5       ChatML, the generation prompt opening <think>
    (slothkit's tags)
    <|im_start|>                  ChatML

A chat template made from a {SYSTEM}/{INPUT}/{OUTPUT} prompt (slothkit.data.prompt_templates,
Unsloth's Ollama notebooks) is written from the pieces it carries, its default system text
as the Modelfile's SYSTEM.  Anything else (or no chat template) gets a plain
"### Instruction / ### Response" template; Ollama users with such a model should replace
it with their own.

Stop tokens: the tokenizer's eos, every other id generation stops at (slothkit.export.generation_config),
and the format's turn markers, so generation ends at the end of the assistant's turn.

Where the HF template ends a turn with another token than the format's own (the
tokenizer's EOS standing in for a turn-end token its vocabulary lacks, as
get_chat_template writes Llama 3's <|eot_id|> on SmolLM2: <|im_end|>), the Go template
ends turns with that token too, and it is a stop token, since the model learnt to end its
replies with it.
"""

from __future__ import annotations

import dataclasses

from slothkit.data import turn_layouts as turns
from slothkit.data.prompt_templates import PromptTemplate, prompt_template_of
from slothkit.data.turn_end_token import end_of_turn_token_id
from slothkit.data.turn_layouts import TurnLayout


@dataclasses.dataclass(frozen=True)
class OllamaFormat:
    name: str
    marker: str | None  # recognised by this text in the HF chat template
    template: str  # Go template; "{eos}" is replaced by the tokenizer's eos text
    stops: tuple[str, ...]
    turn_end: str | None = None  # the token closing each turn in `template`; None: {eos}


def go_template(layout: TurnLayout, reply_opening: str = "") -> str:
    """One exchange of `layout` (slothkit.data.turn_layouts) as a Go template: the system
    turn (or the system text folded into the user turn), the user turn, then the reply
    after `reply_opening`, closed by the turn end or {eos}."""
    user, assistant = layout.user, layout.assistant
    if layout.system is None:
        opening = (
            user.open
            + "{{ if .System }}{{ .System }}"
            + layout.system_fold
            + "{{ end }}{{ .Prompt }}"
            + user.close
        )
    else:
        opening = (
            "{{ if .System }}" + layout.system.open + "{{ .System }}" + layout.system.close + "{{ end }}"
            "{{ if .Prompt }}" + user.open + "{{ .Prompt }}" + user.close + "{{ end }}"
        )
    close = "{eos}" if layout.turn_end is None else assistant.close
    return opening + assistant.open + reply_opening + "{{ .Response }}" + close


def _marked(name: str, marker: str, layout: TurnLayout, reply_opening: str = "") -> OllamaFormat:
    """A format whose stops are its special tokens, or for plain-text markers ([INST]) the
    markers around the user's text."""
    stops = layout.special_tokens or (layout.user.open.strip(), layout.user.close.strip())
    return OllamaFormat(name, marker, go_template(layout, reply_opening), stops, layout.turn_end)


def _harmony() -> OllamaFormat:
    """gpt-oss: harmony's system message once, then every message of the conversation (Ollama's
    .Messages: a template of one exchange would repeat the system message before each), past
    answers in the final channel closed by <|end|> as gpt-oss's own template writes them.
    The reply runs on from "<|start|>assistant" with its channels; generation stops at
    <|return|> (the answer's end) or <|call|> (a tool call), not at the <|end|> closing its
    reasoning."""
    layout = turns.HARMONY
    developer, user, assistant = layout.system, layout.user, layout.assistant
    system = turns.HARMONY_SYSTEM_TEXT.format(
        identity=turns.HARMONY_IDENTITY, date="{{ currentDate }}", effort=turns.HARMONY_DEFAULT_EFFORT
    )
    template = (
        turns.HARMONY_SYSTEM.open
        + system
        + turns.HARMONY_SYSTEM.close
        + '{{ range .Messages }}{{ if eq .Role "system" }}'
        + developer.open
        + "{{ .Content }}"
        + developer.close
        + '{{ else if eq .Role "user" }}'
        + user.open
        + "{{ .Content }}"
        + user.close
        + '{{ else if eq .Role "assistant" }}'
        + assistant.open
        + turns.HARMONY_FINAL
        + "{{ .Content }}"
        + assistant.close
        + "{{ end }}{{ end }}"
        + assistant.open
    )
    return OllamaFormat("gpt-oss", turns.HARMONY_FINAL, template, ("<|return|>", "<|call|>"), layout.turn_end)


CHAT_FORMATS = (
    _harmony(),
    _marked("llama3", "<|start_header_id|>", turns.LLAMA_3),
    _marked("mistral", "[INST]", turns.INST),
    _marked("gemma4", "<|turn>", turns.GEMMA_4),
    _marked("gemma", "<start_of_turn>", turns.GEMMA),
    # get_chat_template(tokenizer, "qwen3-thinking" or "qwen3.5"): ChatML whose generation
    # prompt opens the thinking block (recognised by the tag slothkit's template starts with).
    _marked("qwen3-thinking", "slothkit chat template: qwen3-thinking", turns.CHATML, turns.THINKING_OPENING),
    _marked("qwen3.5", "slothkit chat template: qwen3.5", turns.CHATML, turns.THINKING_OPENING),
    _marked("chatml", "<|im_start|>", turns.CHATML),
)
GENERIC_FORMAT = OllamaFormat(
    "generic",
    None,
    "{{ if .System }}{{ .System }}\n\n{{ end }}{{ if .Prompt }}### Instruction:\n{{ .Prompt }}\n\n{{ end }}"
    "### Response:\n{{ .Response }}{eos}",
    ("### Instruction:",),
)


def chat_format(chat_template: str | None) -> OllamaFormat:
    """The known format whose marker appears in `chat_template`, else the generic one."""
    for fmt in CHAT_FORMATS:
        if chat_template and fmt.marker in chat_template:
            return fmt
    return GENERIC_FORMAT


def prompt_chat_format(pieces: PromptTemplate, bos_token: str | None) -> OllamaFormat:
    """The Go template of a chat template made from a {SYSTEM}/{INPUT}/{OUTPUT} prompt
    (slothkit.data.prompt_templates): the same pieces, one exchange, BOS left to llama.cpp."""
    header = pieces.header_before_system
    if bos_token:
        header = header.removeprefix(bos_token)
    if pieces.has_system:
        opening = header + "{{ .System }}" + pieces.header_after_system + pieces.separator
    else:
        opening = header + (pieces.separator if header else "")
    template = (
        opening
        + pieces.user_prefix
        + "{{ .Prompt }}"
        + pieces.response_prefix
        + "{{ .Response }}"
        + pieces.turn_end
    )
    stops = tuple(
        dict.fromkeys(text for text in (pieces.user_prefix.strip(), pieces.turn_end.strip()) if text)
    )
    return OllamaFormat("prompt", None, template, stops)


def render_modelfile(gguf_file: str, tokenizer, stop_token_ids: list[int] | None = None) -> str:
    """The text of a Modelfile for `gguf_file` (a path relative to the Modelfile's folder)."""
    template = getattr(tokenizer, "chat_template", None)
    pieces = prompt_template_of(template)
    if pieces is not None:
        fmt = prompt_chat_format(pieces, tokenizer.bos_token)
    else:
        fmt = chat_format(template if isinstance(template, str) else None)
    eos = tokenizer.eos_token or ""
    stops = [eos] if eos else []
    for token_id in stop_token_ids or []:
        text = tokenizer.convert_ids_to_tokens(int(token_id))
        if text:
            stops.append(text)
    template, format_stops = fmt.template.replace("{eos}", eos), list(fmt.stops)
    written = _written_turn_end(tokenizer)
    if fmt.turn_end is not None and written is not None and written != fmt.turn_end:
        template = template.replace(fmt.turn_end, written)
        format_stops = [written if stop == fmt.turn_end else stop for stop in format_stops]
    stops.extend(format_stops)
    lines = [f"FROM ./{gguf_file}", f'TEMPLATE """{template}"""']
    if pieces is not None and pieces.default_system:
        lines.append(f'SYSTEM """{pieces.default_system}"""')
    seen = set()
    for stop in stops:
        if stop and stop not in seen:
            seen.add(stop)
            lines.append(f"PARAMETER stop {_quote(stop)}")
    return "\n".join(lines) + "\n"


def _written_turn_end(tokenizer) -> str | None:
    """The token the HF chat template writes after an assistant's reply, if any."""
    token_id = end_of_turn_token_id(tokenizer)
    return None if token_id is None else tokenizer.convert_ids_to_tokens(token_id)


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
