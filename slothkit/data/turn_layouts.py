"""How each chat format with marked turns writes a turn: the one place its markers are written.

A turn is the text before a message (open) and the text after it (close: the format's turn
end and the separator up to the next turn). Formats without a system turn put the system text
before the first user text, followed by `system_fold`:

    layout     system                                   user / assistant open             close
    CHATML     <|im_start|>system\\n                      <|im_start|>user\\n / assistant\\n  <|im_end|>\\n
    LLAMA_3    <|start_header_id|>system<|end_header_id|>\\n\\n   (same header, user / assistant)  <|eot_id|>
    GEMMA      folded into the first user turn          <start_of_turn>user\\n / model\\n   <end_of_turn>\\n
    GEMMA_4    <|turn>system\\n                           <|turn>user\\n / <|turn>model\\n  <turn|>\\n
    PHI_3      <|system|>\\n                              <|user|>\\n / <|assistant|>\\n      <|end|>\\n
    PHI_4      <|im_start|>system<|im_sep|>             <|im_start|>user<|im_sep|> / ...  <|im_end|>
    INST       folded into the first user turn          [INST] ... [/INST] / (none)      the tokenizer's EOS
    HARMONY    <|start|>developer<|message|># Instructions\\n\\n  <|start|>user<|message|> /     <|end|> (the last
               (after harmony's own system message)     <|start|>assistant + channel     reply: <|return|>)

Readers: slothkit.data.chat_format_bodies (the Jinja bodies get_chat_template installs),
slothkit.data.chat_formats (each format's instruction_part, response_part, turn_end and
special tokens), slothkit.data.ollama_templates (the Go templates of Ollama's Modelfile)
and slothkit.testing.tiny_chat_templates (the tiny fixtures' own templates, in the layout
their record's `tiny.chat_format` names).
"""

from __future__ import annotations

import dataclasses
import re


@dataclasses.dataclass(frozen=True)
class Turn:
    open: str  # written before the message's text
    close: str  # written after it: the turn end and the separator up to the next turn


@dataclasses.dataclass(frozen=True)
class TurnLayout:
    system: Turn | None  # None: the system text goes before the first user text
    user: Turn
    assistant: Turn
    turn_end: str | None  # the token that ends each turn; None: the tokenizer's EOS
    special_tokens: tuple[str, ...]  # the markers the format's own tokenizers hold as single tokens
    system_fold: str = "\n\n"  # after a folded system text (system None)
    # (start, end) around the role's name where every turn opens with it (ChatML, Llama 3,
    # Gemma, Phi-4), as the families' own templates write it: start + role + end.
    header: tuple[str, str] | None = None


def _headed(
    start: str, end: str, close: str, special_tokens: tuple[str, ...], *, assistant: str = "assistant"
) -> TurnLayout:
    """A layout whose turns open with the role's name between two markers and close alike."""
    return TurnLayout(
        system=Turn(start + "system" + end, close),
        user=Turn(start + "user" + end, close),
        assistant=Turn(start + assistant + end, close),
        turn_end=special_tokens[-1],
        special_tokens=special_tokens,
        header=(start, end),
    )


CHATML = _headed("<|im_start|>", "\n", "<|im_end|>\n", ("<|im_start|>", "<|im_end|>"))

LLAMA_3 = _headed(
    "<|start_header_id|>",
    "<|end_header_id|>\n\n",
    "<|eot_id|>",
    ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
)

# Gemma's assistant is called "model"; it has no system turn.
GEMMA = dataclasses.replace(
    _headed(
        "<start_of_turn>", "\n", "<end_of_turn>\n", ("<start_of_turn>", "<end_of_turn>"), assistant="model"
    ),
    system=None,
)

# Gemma 4: a turn of its own for the system text, new turn markers (<|turn>, <turn|>), the
# assistant still called "model".
GEMMA_4 = _headed("<|turn>", "\n", "<turn|>\n", ("<|turn>", "<turn|>"), assistant="model")

PHI_3 = TurnLayout(
    system=Turn("<|system|>\n", "<|end|>\n"),
    user=Turn("<|user|>\n", "<|end|>\n"),
    assistant=Turn("<|assistant|>\n", "<|end|>\n"),
    turn_end="<|end|>",
    special_tokens=("<|system|>", "<|user|>", "<|assistant|>", "<|end|>"),
)

# Phi-4: ChatML's tokens with <|im_sep|> after the role and no newline anywhere.
PHI_4 = _headed("<|im_start|>", "<|im_sep|>", "<|im_end|>", ("<|im_start|>", "<|im_sep|>", "<|im_end|>"))

# Mistral Instruct v1 and Llama 2: the reply follows [/INST] and ends with the tokenizer's EOS.
INST = TurnLayout(
    system=None,
    user=Turn("[INST] ", " [/INST]"),
    assistant=Turn("", ""),
    turn_end=None,
    special_tokens=(),
)


# Qwen3's thinking block: an empty one, and the text around the reasoning.
EMPTY_THINKING = "<think>\n\n</think>\n\n"
THINKING_OPENING = "<think>\n"
THINKING_CLOSING = "\n</think>\n\n"

# Gemma 4's thinking mode: <|think|> opens the system turn when thinking is on, and the
# reasoning of the current exchange's reply sits in a "thought" channel before the answer.
GEMMA_4_THINK = "<|think|>\n"
GEMMA_4_THOUGHT_OPENING = "<|channel>thought\n"
GEMMA_4_THOUGHT_CLOSING = "\n<channel|>"
GEMMA_4_CHANNEL_TOKENS = ("<|think|>", "<|channel>", "<channel|>")


# OpenAI's harmony format (gpt-oss). Every message is <|start|>{role}<|message|>...<|end|>;
# an assistant's names its channel after the role: "final" for the answer, "analysis" for
# the reasoning. A conversation opens with harmony's own system message (HARMONY_SYSTEM),
# which carries the model's identity, knowledge cutoff, date and reasoning effort; the
# dataset's system text is the developer message. The last reply of a training text ends
# with <|return|> (the token generation stops at) where earlier ones end with <|end|>.
HARMONY = TurnLayout(
    system=Turn("<|start|>developer<|message|># Instructions\n\n", "\n\n<|end|>"),
    user=Turn("<|start|>user<|message|>", "<|end|>"),
    assistant=Turn("<|start|>assistant", "<|end|>"),
    turn_end="<|return|>",
    special_tokens=("<|start|>", "<|message|>", "<|channel|>", "<|end|>", "<|return|>", "<|call|>"),
)
HARMONY_SYSTEM = Turn("<|start|>system<|message|>", "<|end|>")
HARMONY_IDENTITY = "You are ChatGPT, a large language model trained by OpenAI."
HARMONY_DEFAULT_EFFORT = "medium"
# Harmony's system message without tools; {identity}, {date} (YYYY-MM-DD) and {effort}
# are filled in by each reader in its own template language.
HARMONY_SYSTEM_TEXT = (
    "{identity}\nKnowledge cutoff: 2024-06\nCurrent date: {date}\n\nReasoning: {effort}\n\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every message."
)
HARMONY_FINAL = "<|channel|>final<|message|>"
HARMONY_ANALYSIS = "<|channel|>analysis<|message|>"


def quoted(text: str) -> str:
    """`text` as a single-quoted Jinja string literal, as the bodies write their markers."""
    return "'" + text.replace("\\", "\\\\").replace("\n", "\\n").replace("'", "\\'") + "'"


def filled(text: str, **expressions: str) -> str:
    """`text` as a Jinja expression, each {name} in it replaced by the expression expressions[name]."""
    pieces = re.split(r"\{(\w+)\}", text)
    terms = [quoted(piece) if i % 2 == 0 else expressions[piece] for i, piece in enumerate(pieces)]
    return " + ".join(term for term in terms if term != "''")
