"""Refuse to save weights that hold NaN or Inf.

A model whose training diverged, or whose merged weights overflow the dtype they are saved
in (float16 ends at 65504), loads and runs without complaint and answers with garbage, so
every writer passes its tensors through `finite_tensors` on their way to the file.  Each
tensor is checked where it lies (torch.isfinite(...).all(), on the GPU for a GPU model),
one at a time as it is written: no second pass over the model when all is well.  On the
first bad tensor the rest are only checked, not written, so that the error names all of
them; the exception leaves the save's staging folder to be removed (slothkit.export.atomic),
so nothing reaches the final path and an earlier save stays.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

FLOAT16_MAX = 65504.0
_SHOWN = 8  # tensor names listed in the error


class NonFiniteWeightsError(ValueError):
    """Weights to be saved, or just loaded (slothkit.checkpoint.loaded_weights), hold NaN or Inf values."""


def problem(tensor: torch.Tensor, saved_as: torch.dtype | None = None) -> str | None:
    """What is wrong with `tensor` ("NaN", "Inf", "beyond float16's range"), or None.

    Args:
        tensor: the values to save, on any device.
        saved_as: the dtype the file stores them in when that is narrower than the
            tensor's own (float16: values beyond 65504 would be written as Inf).
    """
    if not tensor.is_floating_point():
        return None
    if bool(torch.isfinite(tensor).all()):
        if saved_as == torch.float16 and tensor.dtype != torch.float16 and tensor.numel():
            if float(tensor.abs().max()) > FLOAT16_MAX:
                return "beyond float16's range (65504)"
        return None
    return "NaN" if bool(torch.isnan(tensor).any()) else "Inf"


def finite_tensors(
    items: Iterable[tuple[str, torch.Tensor]], what: str, saved_as: dict | torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass (name, tensor) pairs through, raising when one holds NaN or Inf (module docstring).

    Args:
        items: the tensors on their way to the file.
        what: the save, for the message ("the merged checkpoint", "the GGUF file X").
        saved_as: the dtype every floating tensor is stored in, or {name: dtype} for
            those stored in another dtype than they come in; None: their own.

    Raises:
        NonFiniteWeightsError: naming every bad tensor and what is wrong with it.
    """
    stored = saved_as.get if isinstance(saved_as, dict) else (lambda name: saved_as)
    items = iter(items)
    for name, tensor in items:
        found = problem(tensor, stored(name))
        if found is None:
            yield name, tensor
            continue
        bad = [(name, found)]
        for other, value in items:  # the rest are checked, not written
            found = problem(value, stored(other))
            if found is not None:
                bad.append((other, found))
        raise NonFiniteWeightsError(message(bad, what))


def listing(names: list[str]) -> str:
    """The first few of `names`, comma-separated, with how many more there are."""
    more = f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
    return ", ".join(names[:_SHOWN]) + more


def named_problems(bad: list[tuple[str, str]]) -> str:
    """(name, problem) pairs listed as NAME (NaN), NAME (Inf), ..."""
    return listing([f"{name} ({found})" for name, found in bad])


def message(bad: list[tuple[str, str]], what: str) -> str:
    overflow = any("range" in found for _, found in bad)
    cause = (
        "save in bfloat16 or float32 (dtype=torch.bfloat16), whose range holds them"
        if overflow
        else "the training diverged (check the loss; lower the learning rate) or the weights were damaged"
    )
    return (
        f"refusing to write {what}: {len(bad)} tensor(s) hold values a file must not: {named_problems(bad)}; "
        f"nothing was written. {cause[0].upper()}{cause[1:]}"
    )
