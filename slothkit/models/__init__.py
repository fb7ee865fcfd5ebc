"""Supported architectures: one record per family (slothkit.models.architecture).

architecture_for(model.config)     # by config.model_type; None when unsupported
architecture_named("gemma")        # by record name
architecture_of_shape("gemma-7b")  # the family a named shape belongs to
"""

from __future__ import annotations

from slothkit.models.architecture import Architecture, GGUFLayout, TinyTraits
from slothkit.models.gemma import GEMMA
from slothkit.models.llama import LLAMA
from slothkit.models.mistral import MISTRAL
from slothkit.models.shape import Shape

ARCHITECTURES: tuple[Architecture, ...] = (LLAMA, MISTRAL, GEMMA)

__all__ = [
    "ARCHITECTURES",
    "Architecture",
    "GGUFLayout",
    "Shape",
    "TinyTraits",
    "architecture_for",
    "architecture_named",
    "architecture_of_shape",
    "supported_summary",
]


def architecture_for(config) -> Architecture | None:
    """The Architecture for a transformers config (or anything with a `model_type`, such as
    a Shape), or None if slothkit has no fused path for it."""
    model_type = getattr(config, "model_type", None)
    for arch in ARCHITECTURES:
        if model_type in arch.model_types:
            return arch
    return None


def architecture_named(name: str) -> Architecture:
    """The record called `name` ("llama", "mistral", "gemma")."""
    for arch in ARCHITECTURES:
        if arch.name == name:
            return arch
    raise ValueError(f"unknown architecture {name!r}; known: {', '.join(a.name for a in ARCHITECTURES)}")


def architecture_of_shape(shape_name: str) -> Architecture:
    """The record whose named shapes include `shape_name` ("gemma-7b" -> Gemma)."""
    for arch in ARCHITECTURES:
        if shape_name in arch.shapes:
            return arch
    known = ", ".join(name for arch in ARCHITECTURES for name in arch.shapes)
    raise ValueError(f"no architecture names the shape {shape_name!r}; named shapes: {known}")


def supported_summary() -> str:
    return "; ".join(f"{a.name} ({', '.join(a.families)})" for a in ARCHITECTURES)
