"""The ``generate`` that FastModel's models carry: the fast decode loop after
``FastModel.for_inference`` (slothkit.inference), and ``model.generate(input_ids=inputs)``
where ``inputs`` is the dict that ``tokenizer.apply_chat_template(..., return_tensors="pt")``
returns in transformers 5; token ids the model has no embedding for are refused first.

transformers 4 returned the token ids as a tensor there; 5 returns a BatchEncoding
(input_ids and attention_mask), which ``generate(input_ids=...)`` cannot take.  The models
FastModel returns have a ``generate`` on the instance that unpacks such a dict, as
``generate(**inputs)`` would, and says once how the call is written now.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import torch

from slothkit.core.notices import LegacySpellingWarning, say_once
from slothkit.data.chat_template_calls import TokenTensor


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
                "slothkit unpacked it",
                LegacySpellingWarning,
            )
            for key, value in encoding.items():
                kwargs.setdefault(key, value)
        # transformers 4's tensor from apply_chat_template (slothkit.data.chat_template_calls)
        # goes on as the plain tensor it stands for.
        if isinstance(kwargs.get("input_ids"), TokenTensor):
            kwargs["input_ids"] = kwargs["input_ids"].plain()
        if args and isinstance(args[0], TokenTensor):
            args = (args[0].plain(), *args[1:])
        check_token_ids(self.model, kwargs.get("input_ids", args[0] if args else None))
        from slothkit.inference import fast_generate

        sequences = fast_generate(self.model, args, kwargs)  # None: not on for_inference's fast path
        if sequences is not None:
            return sequences
        return self.generate(*args, **kwargs)


def check_token_ids(model, input_ids) -> None:
    """Refuse token ids the model has no embedding row for, before generating: the
    embedding lookup would fail deep inside the model with torch's "index out of range in
    self", on a GPU as an asynchronous CUDA assert.

    Args:
        model: the model about to generate.
        input_ids: the prompt's ids; anything that is not a tensor of ids is left to generate.

    Raises:
        ValueError: naming the largest (or a negative) id and the vocabulary size.
    """
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if not isinstance(input_ids, torch.Tensor) or input_ids.is_floating_point() or embeddings is None:
        return
    if not input_ids.numel():
        return
    rows = embeddings.weight.shape[0]
    smallest, largest = torch.stack(torch.aminmax(input_ids)).tolist()  # one sync, before any work
    if smallest < 0:
        raise ValueError(
            f"input_ids holds token id {smallest}, which no token has (ids run from 0 to {rows - 1}); "
            "pass the ids the tokenizer returns (a padding value of -100 belongs in labels, not input_ids)"
        )
    if largest >= rows:
        raise ValueError(
            f"input_ids holds token id {largest}, beyond the model's vocabulary of {rows} ids (0 to {rows - 1}); "
            "the tokenizer is not this model's, or tokens were added to it without "
            "model.resize_token_embeddings(len(tokenizer))"
        )
