"""Checks of the weights a checkpoint loaded into a model, made once after loading.

transformers starts every parameter the checkpoint lacks from random values and only logs
it, so a checkpoint missing a shard or a tensor (a download cut short, a hand-edited index)
loads and trains without a word, from noise.  slothkit refuses such a load, naming the
tensors.  What is legitimately not in the file passes: a head tied to the embeddings
(transformers ties it and does not report it missing) and the score head of a sequence
classifier made from a causal LM's checkpoint, which is new by design and said once.
"""

from __future__ import annotations

import warnings

_SHOWN = 8  # tensor names listed in a message


class IncompleteCheckpointError(ValueError):
    """The checkpoint lacks tensors the model needs."""


class NewHeadWarning(UserWarning):
    """A sequence classifier's score head is not in the checkpoint and starts random."""


def check_loading_info(model, loading_info: dict, checkpoint: str) -> None:
    """Refuse a load that left some of the model's tensors at their random initial values.

    Args:
        model: the model transformers built.
        loading_info: its ``from_pretrained(..., output_loading_info=True)`` report.
        checkpoint: the name or folder loaded, for the message.

    Raises:
        IncompleteCheckpointError: naming the missing tensors.
    """
    missing = sorted(loading_info.get("missing_keys") or ())
    if not missing:
        return
    # A sequence classifier's head lies outside its base model (``score.weight`` beside
    # ``model.layers...``); transformers adds it when the checkpoint is a causal LM's.
    prefix = getattr(model, "base_model_prefix", "") + "."
    head = [name for name in missing if not name.startswith(prefix)] if _is_classifier(model) else []
    missing = [name for name in missing if name not in head]
    if head:
        warnings.warn(
            f"slothkit: the score head ({', '.join(head)}) is new: {checkpoint!r} does not hold it, so it "
            f"starts from random values; get_peft_model trains it in full beside the adapters",
            NewHeadWarning,
            stacklevel=4,
        )
    if missing:
        listed = ", ".join(missing[:_SHOWN]) + (
            f" and {len(missing) - _SHOWN} more" if len(missing) > _SHOWN else ""
        )
        raise IncompleteCheckpointError(
            f"{checkpoint!r} lacks {len(missing)} tensor(s) the model needs: {listed}; they would start "
            f"from random values. The checkpoint is incomplete (a shard or a download cut short) or made "
            f"for another architecture than its config.json names: fetch or save it again"
        )


def _is_classifier(model) -> bool:
    return type(model).__name__.endswith("ForSequenceClassification")
