"""Checks of the weights a checkpoint loaded into a model, made once after loading.

transformers starts every parameter the checkpoint lacks from random values and only logs
it, so a checkpoint missing a shard or a tensor (a download cut short, a hand-edited index)
loads and trains without a word, from noise.  slothkit refuses such a load, naming the
tensors.  What is legitimately not in the file passes: a head tied to the embeddings
(transformers ties it and does not report it missing) and the score head of a sequence
classifier made from a causal LM's checkpoint, which is new by design and said once.

A checkpoint whose bytes were overwritten (0xFF bytes are NaN in every float format) or
that was saved from a diverged run loads as well, and answers with garbage; slothkit
refuses weights holding NaN or Inf, naming the tensors.  That costs one isfinite pass over
the parameters where they lie (on the GPU for a GPU model).  A 4-bit weight's packed codes
cannot hold NaN, but its block scales can: a NaN or Inf value in the checkpoint makes the
scale of its block (its absmax) NaN or Inf, so those are checked instead.
"""

from __future__ import annotations

import warnings

import torch

from slothkit.checkpoint.finite import NonFiniteWeightsError, listing, named_problems, problem


class IncompleteCheckpointError(ValueError):
    """The checkpoint lacks tensors the model needs."""


class NewHeadWarning(UserWarning):
    """A sequence classifier's score head is not in the checkpoint and starts random."""


def check_loaded_weights(model, loading_info: dict, checkpoint: str) -> None:
    """Refuse a model that loaded with tensors missing or holding NaN or Inf (module docstring).

    Args:
        model: the model transformers built.
        loading_info: its ``from_pretrained(..., output_loading_info=True)`` report.
        checkpoint: the name or folder loaded, for the messages.

    Raises:
        IncompleteCheckpointError: check_loading_info's.
        NonFiniteWeightsError: check_finite_weights'.
    """
    check_loading_info(model, loading_info, checkpoint)
    check_finite_weights(model, checkpoint)


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
            stacklevel=5,  # the caller of FastModel.from_pretrained
        )
    if missing:
        raise IncompleteCheckpointError(
            f"{checkpoint!r} lacks {len(missing)} tensor(s) the model needs: {listing(missing)}; they would start "
            f"from random values. The checkpoint is incomplete (a shard or a download cut short) or made "
            f"for another architecture than its config.json names: fetch or save it again"
        )


def _is_classifier(model) -> bool:
    return type(model).__name__.endswith("ForSequenceClassification")


def check_finite_weights(model, checkpoint: str) -> None:
    """Refuse a loaded model whose weights hold NaN or Inf (module docstring).

    Args:
        model: the model as loaded.
        checkpoint: the name or folder loaded, for the message.

    Raises:
        NonFiniteWeightsError: (a ValueError) naming every bad tensor.
    """
    bad = []
    for name, param in model.named_parameters():
        if param.device.type == "meta":  # offloaded to disk by accelerate: not read here
            continue
        found = next(filter(None, map(problem, _stored_values(param))), None)
        if found is not None:
            bad.append((name, found))
    if bad:
        raise NonFiniteWeightsError(
            f"refusing to load {checkpoint!r}: {len(bad)} tensor(s) hold values a model must not: "
            f"{named_problems(bad)}. The checkpoint is damaged or was saved from a training run that "
            f"diverged: fetch it again, or load an earlier checkpoint"
        )


def _stored_values(param) -> list[torch.Tensor]:
    """The floating tensors that hold `param`'s values: the parameter itself, or for a 4-bit
    weight (bitsandbytes' Params4bit) its block scales, the second level's with double
    quantisation (and the mean subtracted from the first level's before they are quantised)."""
    state = getattr(param, "quant_state", None)
    if state is None:
        return [param]
    nested = getattr(state, "state2", None)
    candidates = [state.absmax, getattr(state, "offset", None), getattr(nested, "absmax", None)]
    return [t for t in candidates if isinstance(t, torch.Tensor) and t.is_floating_point()]
