"""``tokenizer.apply_chat_template`` called as code written for datasets 3 and
transformers 4 calls it, on the tokenizers FastModel returns (this instance only).

A whole column of conversations at once,
``tokenizer.apply_chat_template(dataset["conversations"], tokenize=False)``: datasets 3
returned a column as a list; datasets 4 and later return a ``Column``, a lazy sequence
that is not a list, and transformers batches only a list or tuple of conversations, so
it takes the ``Column`` for one conversation and fails deep inside, reading a
conversation where it expects a message ("Chat messages should be dicts ...").  Such a
sequence of conversations is read as the list it stands for.

Token ids, ``len(tokenizer.apply_chat_template(messages))`` or
``apply_chat_template(batch["prompt"], tokenize=True)`` inside a batched
``dataset.map``: transformers 4 returned the ids as a list (a list of lists for a batch);
transformers 5 returns a BatchEncoding (a dict of input_ids and attention_mask) unless
``return_dict=False``, so ``len`` counts its two keys and ``dataset.map`` refuses the
dict.  Called without ``return_dict`` and ``return_tensors``, the ids come back as
``TokenIds``: the list transformers 4 returned, which also reads as the BatchEncoding
transformers 5 returns (``["input_ids"]``, ``["attention_mask"]``, ``.keys()``,
``**ids``); with ``return_tensors="pt"`` and nothing padded, as ``TokenTensor``: the
tensor transformers 4 returned (``ids.shape[1]``, ``ids[0]``), which also reads as that
BatchEncoding.  Every other call is transformers' own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch


def accept_older_chat_template_calls(tokenizer, text_by_default: bool = False):
    """Give `tokenizer` (this instance only) an ``apply_chat_template`` that also takes a
    sequence of conversations that is not a list, such as a datasets ``Column``, and
    returns token ids as ``TokenIds`` (module docstring).

    Args:
        tokenizer: changed in place; calling this again keeps its one wrapper.
        text_by_default: a call that asks for no tokens (no tokenize, return_tensors or
            return_dict) returns the text, as an image-text checkpoint's processor does
            (slothkit.loading.text_tower); once set, it stays set.

    Returns:
        The same tokenizer (unchanged when it has no ``apply_chat_template``).
    """
    if getattr(type(tokenizer), "apply_chat_template", None) is None:
        return tokenizer
    call = tokenizer.__dict__.get("apply_chat_template")
    if not isinstance(call, ChatTemplateCall):
        call = tokenizer.apply_chat_template = ChatTemplateCall(tokenizer)
    call.text_by_default = call.text_by_default or text_by_default
    return tokenizer


def is_column_of_conversations(value) -> bool:
    """A sequence (not a list, tuple or string) whose first item is a conversation (a
    list or tuple of messages)."""
    if isinstance(value, (list, tuple, str, bytes, Mapping)) or not isinstance(value, Sequence):
        return False
    return len(value) > 0 and isinstance(value[0], (list, tuple))


class ChatTemplateCall:
    """A tokenizer's ``apply_chat_template`` taking the older calls
    (``accept_older_chat_template_calls``).  It calls the class's method, not a bound one
    it kept: a pickled tokenizer (datasets.map's workers) then unpickles to this wrapper
    around the class's method again, not a method that resolves to the wrapper."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.text_by_default = False
        self.__doc__ = type(tokenizer).apply_chat_template.__doc__

    def __call__(self, conversation, *args, **kwargs):
        if is_column_of_conversations(conversation):
            conversation = list(conversation)
        if (
            self.text_by_default
            and not args
            and not {"tokenize", "return_tensors", "return_dict"} & kwargs.keys()
        ):
            kwargs["tokenize"] = False
        result = type(self.tokenizer).apply_chat_template(self.tokenizer, conversation, *args, **kwargs)
        if "return_dict" in kwargs or args or not isinstance(result, Mapping) or "input_ids" not in result:
            return result
        if kwargs.get("return_tensors") is None:
            return TokenIds(result)
        if kwargs["return_tensors"] == "pt" and _unpadded(result):
            return result["input_ids"].as_subclass(TokenTensor)
        return result


class TokenIds(list):
    """Token ids as transformers 4's ``apply_chat_template`` returned them (a list of ids,
    or of lists of ids for a batch) that also read as the BatchEncoding transformers 5
    returns: ``ids["input_ids"]``, ``ids["attention_mask"]``, ``ids.input_ids``,
    ``ids.keys()``, ``dict(ids)`` and ``**ids``."""

    def __init__(self, encoding: Mapping):
        super().__init__(encoding["input_ids"])
        self.encoding = dict(encoding)

    def __getitem__(self, key):
        if isinstance(key, str):
            return self.encoding[key]
        return super().__getitem__(key)

    def __getattr__(self, name):
        encoding = self.__dict__.get("encoding", {})
        if name in encoding:
            return encoding[name]
        raise AttributeError(name)

    def keys(self):
        return self.encoding.keys()

    def values(self):
        return self.encoding.values()

    def items(self):
        return self.encoding.items()

    def get(self, key, default=None):
        return self.encoding.get(key, default)


def _unpadded(encoding: Mapping) -> bool:
    mask = encoding.get("attention_mask")
    return torch.is_tensor(encoding["input_ids"]) and (mask is None or bool(mask.all()))


class TokenTensor(torch.Tensor):
    """Token ids as transformers 4's ``apply_chat_template(..., return_tensors="pt")``
    returned them, a (batch, length) tensor (``ids.shape[1]``, ``ids[0]``), that also reads
    as the BatchEncoding transformers 5 returns (``**ids``, ``ids["input_ids"]``,
    ``ids.attention_mask``: all ones, since nothing is padded).  Operations on it give plain
    tensors; ``.to``, ``.cuda`` and ``.cpu`` keep it one."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))

    def plain(self) -> torch.Tensor:
        return self.as_subclass(torch.Tensor)

    def __getitem__(self, key):
        if isinstance(key, str):
            return {"input_ids": self.input_ids, "attention_mask": self.attention_mask}[key]
        return self.plain()[key]

    @property
    def input_ids(self) -> torch.Tensor:
        return self.plain()

    @property
    def attention_mask(self) -> torch.Tensor:
        return torch.ones_like(self.plain())

    def keys(self):
        return ("input_ids", "attention_mask")

    def items(self):
        return [(key, self[key]) for key in self.keys()]

    def to(self, *args, **kwargs):
        return self.plain().to(*args, **kwargs).as_subclass(TokenTensor)

    def cuda(self, *args, **kwargs):
        return self.plain().cuda(*args, **kwargs).as_subclass(TokenTensor)

    def cpu(self):
        return self.plain().cpu().as_subclass(TokenTensor)
