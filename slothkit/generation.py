"""The ``generate`` that FastModel's models carry: the fast decode loop after
``FastModel.for_inference`` (slothkit.inference), and ``model.generate(input_ids=inputs)``
where ``inputs`` is the dict that ``tokenizer.apply_chat_template(..., return_tensors="pt")``
returns in transformers 5.

transformers 4 returned the token ids as a tensor there; 5 returns a BatchEncoding
(input_ids and attention_mask), which ``generate(input_ids=...)`` cannot take.  The models
FastModel returns have a ``generate`` on the instance that unpacks such a dict, as
``generate(**inputs)`` would, and says once how the call is written now.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

from slothkit.notices import say_once


def accept_encoding_in_generate(model):
    """Give `model` (this instance only) a ``generate`` that also takes a BatchEncoding or
    dict as ``input_ids`` (or as its first positional argument) and unpacks it, and that
    decodes through the fast loop when ``FastModel.for_inference`` turned it on.

    Args:
        model: a transformers model or PeftModel; changed in place.

    Returns:
        The same model (unchanged when it has no ``generate``: a sequence classifier).
    """
    generate = getattr(model, "generate", None)
    if generate is None or isinstance(generate, UnpackingGenerate):
        return model
    model.generate = UnpackingGenerate(model, generate)
    return model


class UnpackingGenerate:
    """A model's ``generate`` that unpacks a BatchEncoding passed as ``input_ids`` and
    hands the call to the fast loop first (``accept_encoding_in_generate``)."""

    def __init__(self, model, generate):
        self.model = model
        self.generate = generate
        functools.update_wrapper(self, generate)

    def __call__(self, *args, **kwargs):
        encoding = kwargs.get("input_ids")
        if encoding is None and args and isinstance(args[0], Mapping):
            encoding, args = args[0], args[1:]
        elif isinstance(encoding, Mapping):
            kwargs.pop("input_ids")
        if isinstance(encoding, Mapping):
            say_once(
                "model.generate(input_ids=inputs) with the dict that apply_chat_template(..., "
                "return_tensors='pt') returns in transformers 5 is written model.generate(**inputs); "
                "slothkit unpacked it"
            )
            for key, value in encoding.items():
                kwargs.setdefault(key, value)
        from slothkit.inference import fast_generate

        sequences = fast_generate(self.model, args, kwargs)  # None: not on for_inference's fast path
        if sequences is not None:
            return sequences
        return self.generate(*args, **kwargs)
