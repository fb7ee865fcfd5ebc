"""``tokenizer.apply_chat_template(dataset["conversations"], tokenize=False)``: a whole
column of conversations rendered at once, as Unsloth's notebooks write it.

datasets 3 returned a column as a list.  datasets 4 and later return a ``Column``, a lazy
sequence that is not a list, and transformers treats a batch as a batch only when it is
a list or tuple of conversations: it takes the ``Column`` for one conversation and fails
deep inside, reading a conversation where it expects a message ("Chat messages should be
dicts ...").  The tokenizers FastModel returns carry, on the instance, an
``apply_chat_template`` that reads any such sequence of conversations as the list it
stands for and leaves every other call to transformers unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def accept_conversation_columns(tokenizer):
    """Give `tokenizer` (this instance only) an ``apply_chat_template`` that also takes a
    sequence of conversations that is not a list, such as a datasets ``Column``.

    Returns:
        The same tokenizer (unchanged when it has no ``apply_chat_template``).
    """
    method = getattr(type(tokenizer), "apply_chat_template", None)
    if method is None or isinstance(tokenizer.__dict__.get("apply_chat_template"), ColumnsAsBatches):
        return tokenizer
    tokenizer.apply_chat_template = ColumnsAsBatches(tokenizer)
    return tokenizer


def is_column_of_conversations(value) -> bool:
    """A sequence (not a list, tuple or string) whose first item is a conversation (a
    list or tuple of messages)."""
    if isinstance(value, (list, tuple, str, bytes, Mapping)) or not isinstance(value, Sequence):
        return False
    return len(value) > 0 and isinstance(value[0], (list, tuple))


class ColumnsAsBatches:
    """A tokenizer's ``apply_chat_template`` reading a column of conversations as a
    batch (``accept_conversation_columns``).  It calls the class's method, not a bound
    one it kept: a pickled tokenizer (datasets.map's workers) then unpickles to this
    wrapper around the class's method again, not a method that resolves to the wrapper."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.__doc__ = type(tokenizer).apply_chat_template.__doc__

    def __call__(self, conversation, *args, **kwargs):
        if is_column_of_conversations(conversation):
            conversation = list(conversation)
        return type(self.tokenizer).apply_chat_template(self.tokenizer, conversation, *args, **kwargs)
