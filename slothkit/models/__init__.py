"""Supported architectures, looked up by a transformers config's model_type."""

from __future__ import annotations

from slothkit.models.architecture import Architecture
from slothkit.models.gemma import GEMMA
from slothkit.models.llama import LLAMA
from slothkit.models.mistral import MISTRAL

ARCHITECTURES: tuple[Architecture, ...] = (LLAMA, MISTRAL, GEMMA)


def architecture_for(config) -> Architecture | None:
    """The Architecture for a transformers config, or None if slothkit has no fused path for it."""
    model_type = getattr(config, "model_type", None)
    for arch in ARCHITECTURES:
        if model_type in arch.model_types:
            return arch
    return None


def supported_summary() -> str:
    return "; ".join(f"{a.name} ({', '.join(a.families)})" for a in ARCHITECTURES)
