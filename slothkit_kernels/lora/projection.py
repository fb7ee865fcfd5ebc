"""One LoRA-adapted projection as the kernels take it, and the checks of it and its input.

A projection has a frozen base weight W (out, in), either a 16-bit tensor or an
``NF4Weight`` (dequantised on the fly, in forward and again in backward, never
kept in 16-bit), an optional frozen bias, and an optional adapter A (r, in),
B (out, r) with scale s:

    Y = X W^T + s (X A^T) B^T (+ bias)              X: (N, in), Y: (N, out)

Precision.  PEFT keeps A and B in fp32 while the base runs in bf16/fp16; here the
adapter matmuls run in the compute dtype (A and B are cast, which is cheap) and
dA, dB are returned in A's and B's own dtype.  The compute dtype is x's dtype, or
the autocast dtype when torch autocast is on (then x and a 16-bit W are cast to
it, as autocast would for ``F.linear``).  Without autocast a tensor W must have
x's dtype.  LoRA dropout is not modelled: use these with ``lora_dropout=0``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slothkit_kernels.nf4.weight import NF4Weight
from slothkit_kernels.utils import check_float_dtype, check_not_empty


@dataclass
class LoRAProjection:
    weight: torch.Tensor | NF4Weight  # frozen base, (out_features, in_features)
    lora_a: torch.Tensor | None  # (r, in_features), trainable; None = no adapter
    lora_b: torch.Tensor | None  # (out_features, r)
    scaling: float  # lora_alpha / r, or lora_alpha / sqrt(r) for rsLoRA
    bias: torch.Tensor | None = None  # frozen base-layer bias (out_features,), no grad

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    def fields(self) -> tuple:
        return (self.weight, self.lora_a, self.lora_b, self.scaling, self.bias)

    def fields_in(self, dtype: torch.dtype) -> tuple:
        """fields() with A and B cast to the compute dtype *before* the autograd Function.
        Autograd records the casts, so the Function's backward needs none of its own and
        returns the adapter gradients in ``dtype``, which the casts' backward turns back
        into the parameters' dtype: the same values as casting inside, fewer launches."""
        a, b = self.lora_a, self.lora_b
        if a is not None:
            a, b = a.to(dtype), b.to(dtype)
        return (self.weight, a, b, self.scaling, self.bias)


_N_FIELDS = 5  # LoRAProjection.fields() as passed to Function.apply


def _base_weight(weight: torch.Tensor | NF4Weight, dtype: torch.dtype) -> torch.Tensor:
    """The base weight as a (out, in) tensor of ``dtype``; NF4 is dequantised afresh."""
    if isinstance(weight, NF4Weight):
        from slothkit_kernels.nf4.dequantize import dequantize_nf4

        weight = dequantize_nf4(weight)
    return weight if weight.dtype == dtype else weight.to(dtype)


# ----------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return x.dtype


def _check_projection(
    name: str, proj: LoRAProjection, in_features: int, x: torch.Tensor, dtype: torch.dtype
) -> None:
    if not isinstance(proj, LoRAProjection):
        raise TypeError(f"{name} must be a LoRAProjection, got {type(proj).__name__}")
    w = proj.weight
    if not isinstance(w, (torch.Tensor, NF4Weight)):
        raise TypeError(f"{name}.weight must be a torch.Tensor or NF4Weight, got {type(w).__name__}")
    if len(w.shape) != 2:
        raise ValueError(f"{name}.weight must be (out_features, in_features), got shape {tuple(w.shape)}")
    out_features = w.shape[0]
    if w.shape[1] != in_features:
        raise ValueError(
            f"{name}.weight has in_features={w.shape[1]} but its input has last dimension {in_features}"
        )
    if w.device != x.device:
        raise ValueError(f"{name}.weight is on {w.device} but the input is on {x.device}")
    if isinstance(w, torch.Tensor):
        check_float_dtype(f"{name}.weight", w)
        if w.dtype != dtype and not torch.is_autocast_enabled(x.device.type):
            raise TypeError(
                f"{name}.weight has dtype {w.dtype} but the input has {dtype}; they must "
                f"match (or run under torch.autocast)"
            )
        if w.requires_grad and torch.is_grad_enabled():
            raise ValueError(
                f"{name}.weight requires grad, but the base weight of a LoRA projection is "
                f"frozen and gets no gradient; call weight.requires_grad_(False)"
            )
    if proj.bias is not None:
        if proj.bias.shape != (out_features,):
            raise ValueError(f"{name}.bias has shape {tuple(proj.bias.shape)}, expected ({out_features},)")
        if proj.bias.requires_grad and torch.is_grad_enabled():
            raise ValueError(
                f"{name}.bias requires grad, but the base bias is frozen here; "
                f"call bias.requires_grad_(False)"
            )
    a, b = proj.lora_a, proj.lora_b
    if (a is None) != (b is None):
        raise ValueError(f"{name}: lora_a and lora_b must both be tensors or both be None")
    if a is None:
        return
    check_float_dtype(f"{name}.lora_a", a)
    check_float_dtype(f"{name}.lora_b", b)
    if a.dim() != 2 or a.shape[1] != in_features:
        raise ValueError(f"{name}.lora_a must be (r, {in_features}), got shape {tuple(a.shape)}")
    if b.dim() != 2 or b.shape[0] != out_features:
        raise ValueError(f"{name}.lora_b must be ({out_features}, r), got shape {tuple(b.shape)}")
    if a.shape[0] != b.shape[1]:
        raise ValueError(
            f"{name}: rank mismatch, lora_a has r={a.shape[0]} rows but lora_b has r={b.shape[1]} columns"
        )
    for part, t in (("lora_a", a), ("lora_b", b)):
        if t.device != x.device:
            raise ValueError(f"{name}.{part} is on {t.device} but the input is on {x.device}")


def _check_input(x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    check_float_dtype("x", x)
    check_not_empty("x", x)
    if x.dim() < 1:
        raise ValueError("x must have shape (..., in_features)")


def _prepare(x: torch.Tensor, checks) -> torch.Tensor:
    """Validate x and each (name, projection, in_features or None for x's last dim).

    Returns x cast to the compute dtype.
    """
    _check_input(x)
    dtype = _compute_dtype(x)
    for name, proj, in_features in checks:
        _check_projection(name, proj, in_features or x.shape[-1], x, dtype)
    return x.to(dtype)
