"""Supported architectures: one record per family (slothkit.models.architecture).

architecture_for(model.config)     # the fused path's record by config.model_type; None without one
language_model_architecture(config)  # the fused record of an image-text model's language model
record_for(model.config)           # any record by config.model_type (GGUF export); None when unknown
export_record_for(model.config)    # record_for, else a mixture-of-experts family's (GGUF export)
architecture_named("gemma")        # by record name
architecture_of_shape("gemma-7b")  # the family a named shape belongs to
shape_by_name("llama-3-8b")        # a real checkpoint's size, no weights (bench, planner)
language_shape_by_name("qwen2.5-vl-7b")  # shape_by_name, or an image-text shape's language model

RECORDS holds every record; ARCHITECTURES those that slothkit's fused decoder patches (every
record; a record with fused=False would serve export only, its family training on the
generic path); EXPERT_RECORDS the mixture-of-experts families that GGUF export writes
and the fast decode loop generates (they train on the generic path: no fixture, notebook
or fused layer reads them); EXPORT_ONLY_RECORDS the families that GGUF export
alone reads a record of (Qwen3.5's DeltaNet hybrid and Gemma 4, which train on the generic
path, and Qwen2.5-VL's language model under llama.cpp's qwen2vl graph); SHAPES the shapes every record names and those of record-less families
(generic_shapes: the generic path's), by name (`slothkit plan` predicts from them,
`slothkit bench` builds them with random weights); IMAGE_TEXT_SHAPES the image-text
models' (image_text_shapes: a language model's shape under a vision tower), which
`slothkit bench` builds too.
"""

from __future__ import annotations

import functools
import warnings

from slothkit.models.architecture import (
    Architecture,
    GGUFExperts,
    GGUFLayout,
    TinyTraits,
    generic_path_reason,
)
from slothkit.models.gemma import GEMMA
from slothkit.models.gemma2 import GEMMA2
from slothkit.models.gemma3 import GEMMA3
from slothkit.models.gemma4 import GEMMA4
from slothkit.models.generic_shapes import GENERIC_SHAPES
from slothkit.models.gpt_oss import GPT_OSS
from slothkit.models.image_text_shapes import IMAGE_TEXT_SHAPES, ImageTextShape
from slothkit.models.llama import LLAMA
from slothkit.models.ministral import MINISTRAL
from slothkit.models.mistral import MISTRAL
from slothkit.models.mixtral import MIXTRAL
from slothkit.models.phi3 import PHI3
from slothkit.models.qwen2 import QWEN2, QWEN2_5_VL_TEXT
from slothkit.models.qwen3 import QWEN3
from slothkit.models.qwen3_5 import QWEN3_5, QWEN3_5_MOE
from slothkit.models.qwen3_moe import QWEN3_MOE
from slothkit.models.shape import Shape

RECORDS: tuple[Architecture, ...] = (LLAMA, MISTRAL, GEMMA, QWEN2, QWEN3, GEMMA3, GEMMA2, PHI3, MINISTRAL)
ARCHITECTURES: tuple[Architecture, ...] = tuple(arch for arch in RECORDS if arch.fused)
EXPERT_RECORDS: tuple[Architecture, ...] = (QWEN3_MOE, GPT_OSS, MIXTRAL)
EXPORT_ONLY_RECORDS: tuple[Architecture, ...] = (QWEN3_5, QWEN3_5_MOE, GEMMA4, QWEN2_5_VL_TEXT)
SHAPES: dict[str, Shape] = {
    **{name: shape for arch in RECORDS for name, shape in arch.shapes.items()},
    **GENERIC_SHAPES,
}

__all__ = [
    "ARCHITECTURES",
    "EXPERT_RECORDS",
    "EXPORT_ONLY_RECORDS",
    "IMAGE_TEXT_SHAPES",
    "RECORDS",
    "SHAPES",
    "Architecture",
    "GGUFExperts",
    "GGUFLayout",
    "ImageTextShape",
    "Shape",
    "TinyTraits",
    "architecture_for",
    "architecture_named",
    "architecture_of_shape",
    "export_record_for",
    "language_shape_by_name",
    "language_model_architecture",
    "record_for",
    "shape_by_name",
    "supported_summary",
]


def architecture_for(config) -> Architecture | None:
    """The Architecture for a transformers config (or anything with a `model_type`, such as
    a Shape), or None if slothkit has no fused path for it (nor for this config of a fused
    family: generic_path_reason, said once)."""
    arch = record_for(config)
    if arch is None or not arch.fused:
        return None
    reason = generic_path_reason(config)
    if reason is not None:
        _notice_generic_config(arch.name, reason)
        return None
    return arch


def language_model_architecture(config) -> Architecture | None:
    """The fused record for the language model of an image-text model's config (its
    text_config's model_type: a record's own, as Gemma 3's "gemma3_text", or one of its
    `language_model_types`, as Qwen2.5-VL's "qwen2_5_vl_text"), or None."""
    text = config.get_text_config()
    arch = architecture_for(text)
    if arch is not None:
        return arch
    for arch in ARCHITECTURES:
        if text.model_type in arch.language_model_types and generic_path_reason(text) is None:
            return arch
    return None


@functools.cache
def _notice_generic_config(name: str, reason: str) -> None:
    warnings.warn(
        f"slothkit: this {name} model trains on the generic path, not the fused one: {reason}", stacklevel=3
    )


def record_for(config) -> Architecture | None:
    """The record for a transformers config, fused path or not (GGUF export), or None if
    slothkit knows nothing of its model_type."""
    model_type = getattr(config, "model_type", None)
    for arch in RECORDS:
        if model_type in arch.model_types:
            return arch
    return None


def export_record_for(config) -> Architecture | None:
    """The record GGUF export writes a model of `config` by: record_for's, else the
    mixture-of-experts family's (EXPERT_RECORDS) or an export-only family's
    (EXPORT_ONLY_RECORDS), else None."""
    model_type = getattr(config, "model_type", None)
    for arch in RECORDS + EXPERT_RECORDS + EXPORT_ONLY_RECORDS:
        if model_type in arch.model_types:
            return arch
    return None


def architecture_named(name: str) -> Architecture:
    """The record called `name` ("llama", "qwen3", ...: RECORDS)."""
    for arch in RECORDS:
        if arch.name == name:
            return arch
    raise ValueError(f"unknown architecture {name!r}; known: {', '.join(a.name for a in RECORDS)}")


def architecture_of_shape(shape_name: str) -> Architecture:
    """The record whose named shapes include `shape_name` ("gemma-7b" -> Gemma)."""
    for arch in RECORDS:
        if shape_name in arch.shapes:
            return arch
    known = ", ".join(name for arch in RECORDS for name in arch.shapes)
    raise ValueError(f"no architecture names the shape {shape_name!r}; named shapes: {known}")


def shape_by_name(name: str) -> Shape:
    """The named shape ("llama-3-8b"); a ValueError naming the known ones otherwise."""
    if name not in SHAPES:
        raise ValueError(
            f"unknown model shape {name!r}; known shapes: {', '.join(SHAPES)} "
            f"(or pass a local checkpoint directory)"
        )
    return SHAPES[name]


def language_shape_by_name(name: str) -> Shape:
    """The named text shape, or the language model's of the named image-text shape
    (IMAGE_TEXT_SHAPES); a ValueError naming the known ones otherwise."""
    if name in IMAGE_TEXT_SHAPES:
        return IMAGE_TEXT_SHAPES[name].text
    if name not in SHAPES:
        raise ValueError(
            f"unknown model shape {name!r}; known shapes: {', '.join(SHAPES)}; "
            f"image-text shapes: {', '.join(IMAGE_TEXT_SHAPES)}"
        )
    return SHAPES[name]


def supported_summary() -> str:
    return "; ".join(f"{a.name} ({', '.join(a.families)})" for a in ARCHITECTURES)
