"""Read a (possibly LoRA-wrapped, possibly 4-bit) linear layer as a LoRAProjection.

The fused functions in slothkit_kernels.lora take plain tensors.  This module
looks at a layer at call time (adapters can be switched off and on between
calls, e.g. by DPO's reference pass) and either describes it as a
``LoRAProjection`` or says why it cannot, so that the caller falls back to the
layer's own forward.
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch import nn

from slothkit.core.inspection import is_4bit_parameter
from slothkit.core.model_state import keep_nf4_cache, nf4_cache
from slothkit.engine.nf4_layout import is_repacked_for_cpu, repacked_weight_error
from slothkit_kernels.lora.projection import LoRAProjection
from slothkit_kernels.nf4.weight import NF4Weight


def base_weight(layer: nn.Module) -> torch.Tensor | NF4Weight | None:
    """The frozen weight of a plain or bitsandbytes-4-bit linear layer, else None.

    An NF4 weight is described once and the record kept on the parameter, so that the
    kernels' checks and argument preparation (cached on the record) run once per weight
    rather than at every call: three calls per projection per training step add up to
    milliseconds of Python per step. A moved or re-quantised weight (another storage or
    quant_state) gets a fresh record.
    """
    if is_4bit_parameter(getattr(layer, "weight", None)):
        param = layer.weight
        state = param.quant_state
        if getattr(state, "quant_type", None) != "nf4":
            return None
        cached = nf4_cache(param)
        key = (param.data_ptr(), param.device, id(state))
        if cached is not None and cached.key == key:
            return cached.weight
        if is_repacked_for_cpu(state):
            raise repacked_weight_error(layer)
        weight = NF4Weight.from_bitsandbytes(param.data, state)
        keep_nf4_cache(param, key, weight)
        return weight
    if isinstance(layer, nn.Linear):
        return layer.weight
    return None


def describe(layer: nn.Module) -> LoRAProjection | str:
    """``layer`` as a LoRAProjection for the fused functions, or the reason it cannot be.

    One walk over the layer: this runs for every projection at every call (forward and
    the recomputed forward), so its cost is Python time per training step.
    """
    base = getattr(layer, "base_layer", None)
    if base is None:  # not a PEFT LoRA layer: a plain (frozen) linear
        weight = base_weight(layer)
        if weight is None:
            return f"{type(layer).__name__} is neither nn.Linear nor an NF4 bitsandbytes Linear4bit"
        if layer.weight.requires_grad and torch.is_grad_enabled():
            return "the base weight is trainable (the fused functions assume a frozen base)"
        return LoRAProjection(weight, None, None, 0.0, layer.bias)
    weight = base_weight(base)
    if weight is None:
        return f"the base layer {type(base).__name__} is neither nn.Linear nor NF4 Linear4bit"
    if base.weight.requires_grad and torch.is_grad_enabled():
        return "the base weight is trainable (the fused functions assume a frozen base)"
    bias = base.bias
    if getattr(layer, "merged", False) or getattr(layer, "disable_adapters", False):
        return LoRAProjection(weight, None, None, 0.0, bias)  # runs as the plain base layer
    lora_a = layer.lora_A
    active = [a for a in layer.active_adapters if a in lora_a]
    if len(active) > 1:
        return f"{len(active)} adapters are active at once"
    if not active:
        return LoRAProjection(weight, None, None, 0.0, bias)
    name = active[0]
    if name in getattr(layer, "lora_variant", {}):
        return "it uses a LoRA variant (e.g. DoRA)"
    dropout = layer.lora_dropout[name]
    if not isinstance(dropout, nn.Identity) and layer.training and dropout.p > 0:
        return f"lora_dropout={dropout.p} (use 0.0 for the fused path)"
    lora_b = layer.lora_B[name]
    if lora_b.bias is not None:
        return "the LoRA B matrix has a bias (bias='lora_only' or 'all')"
    return LoRAProjection(weight, lora_a[name].weight, lora_b.weight, float(layer.scaling[name]), bias)


def describe_rows(layer: nn.Module, splits: tuple[int, ...]) -> list[LoRAProjection] | str:
    """``layer``, one projection computing several (Phi-3's qkv_proj: q, k and v stacked by
    rows), as one LoRAProjection per row range [splits[i], splits[i + 1]), or the reason
    it cannot be.

    Each part reads the rows of the same tensors, as views: the base weight's (an NF4
    weight's packed bytes and scales: NF4Weight.rows), B's and the bias's; A is the one
    tensor every part shares. LoRA on the fused layer is y = x W^T + s (x A^T) B^T, whose
    rows [a, b) are x W[a:b]^T + s (x A^T) B[a:b]^T: each part is a projection of its own
    with A shared. Autograd sums A's gradient over the parts, and B's row views send
    theirs into the one B leaf.
    """
    described = describe(layer)
    if isinstance(described, str):
        return described
    base = getattr(layer, "base_layer", layer)
    weight, a, b, scaling, bias = described.fields()
    parts = []
    for start, stop in zip(splits, splits[1:]):
        rows = _weight_rows(base.weight, weight, start, stop)
        if rows is None:
            return (
                f"its 4-bit weight's rows from {start} do not start on a quantisation block "
                f"(of {weight.blocksize} values), so they cannot be read as a weight of their own"
            )
        part_b = None if b is None else b[start:stop]
        part_bias = None if bias is None else bias[start:stop]
        parts.append(LoRAProjection(rows, a, part_b, scaling, part_bias))
    return parts


def _weight_rows(param, weight, start: int, stop: int):
    """Rows [start, stop) of a base weight: a view of a tensor, or an NF4Weight over views
    of the packed one (kept on the parameter's NF4Cache; None where a block is cut)."""
    if not isinstance(weight, NF4Weight):
        return weight[start:stop]
    rows = nf4_cache(param).rows
    if (start, stop) not in rows:
        rows[start, stop] = weight.rows(start, stop)
    return rows[start, stop]


def why_not_fusable(layer: nn.Module) -> str | None:
    """None when ``layer`` can run through the fused LoRA functions, else the reason."""
    described = describe(layer)
    return described if isinstance(described, str) else None


def lora_projection(layer: nn.Module) -> LoRAProjection:
    """Describe ``layer`` as a LoRAProjection; ValueError when it cannot be fused."""
    described = describe(layer)
    if isinstance(described, str):
        raise ValueError(f"{type(layer).__name__} cannot run through the fused functions: {described}")
    return described


@functools.cache
def warn_fallback_once(module_kind: str, reason: str) -> None:
    warnings.warn(
        f"slothkit: {module_kind} runs through the plain PEFT path, not the fused kernels, "
        f"because {reason}. Results are the same; training is slower.",
        stacklevel=3,
    )


def row_projections_or_none(
    kind: str, layer: nn.Module, splits: tuple[int, ...]
) -> list[LoRAProjection] | None:
    """describe_rows(layer, splits), or None (after one warning) where it cannot be fused."""
    described = describe_rows(layer, splits)
    if isinstance(described, str):
        warn_fallback_once(kind, described)
        return None
    return described


def projections_or_none(kind: str, *layers: nn.Module) -> list[LoRAProjection] | None:
    """All layers as LoRAProjections, or None (after one warning) if any is not fusable."""
    projections = []
    for layer in layers:
        described = describe(layer)
        if isinstance(described, str):
            warn_fallback_once(kind, described)
            return None
        projections.append(described)
    return projections
