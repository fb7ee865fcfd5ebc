"""Replace text that a Jinja template writes: `replace_written_text(source, old, new)`.

A custom (jinja_template, eos_token) pair whose end-of-turn token the tokenizer lacks is
installed with the tokenizer's EOS written in that token's place
(slothkit.data.chat_templates).  The token is replaced only where the template writes it:
in the template's plain text and inside its string literals, found with Jinja's own lexer.
A comment, a variable name or a tag that holds the same characters stays as it is, so the
template keeps its logic and only its output changes.

Plain text takes the new text as it is, unless the new text holds a character of Jinja's
tag syntax (it could open a tag), where it goes in as an expression; a string literal that
holds the old text is written again, decoded as Jinja decodes it and escaped by
chat_formats.jinja_string, so quotes and backslashes in either text stay literal.
"""

from __future__ import annotations

from slothkit.data.chat_formats import jinja_string

# Characters that may open or close a tag, a comment or an expression in plain text.
_TAG_SYNTAX = set("{}%#")


def replace_written_text(source: str, old: str, new: str) -> str:
    """`source` with `old` replaced by `new` wherever the template writes it as output: in
    its plain text (raw blocks included) and in its string literals (module docstring).

    Raises:
        jinja2.TemplateSyntaxError: `source` is not a Jinja template.
    """
    import jinja2

    pieces, cursor, in_raw_block = [], 0, False
    for _, kind, value in jinja2.Environment().lex(source):
        # The lexer gives each token's source text in order; between two tokens lies only
        # whitespace that a "-" in a tag strips from the output, which is kept as written.
        at = source.index(value, cursor)
        pieces.append(source[cursor:at])
        cursor = at + len(value)
        in_raw_block = kind == "raw_begin" or (in_raw_block and kind != "raw_end")
        if kind == "data":
            pieces.append(value.replace(old, new if in_raw_block else _as_plain_text(new)))
        elif kind == "string":
            pieces.append(_rewritten_literal(value, old, new))
        else:
            pieces.append(value)
    pieces.append(source[cursor:])
    return "".join(pieces)


def _as_plain_text(text: str) -> str:
    """`text` as the plain text of a template writes it."""
    if _TAG_SYNTAX.isdisjoint(text):
        return text
    return "{{ " + jinja_string(text) + " }}"


def _rewritten_literal(literal: str, old: str, new: str) -> str:
    """The string literal `literal` (its source, quotes included) with `old` replaced in the
    text it stands for; the literal as written when it does not hold `old`."""
    import jinja2

    (output,) = jinja2.Environment().parse("{{ " + literal + " }}").body
    text = output.nodes[0].value
    if old not in text:
        return literal
    return jinja_string(text.replace(old, new))
