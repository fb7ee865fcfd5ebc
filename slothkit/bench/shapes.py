"""Model shapes `slothkit bench` knows by name: the real configs' sizes, no weights.

The benchmark builds each model with random weights from these numbers, so no
download is needed; a local checkpoint directory works as well. The shapes are those
the architecture records name (slothkit.models), collected here by name.
"""

from __future__ import annotations

from slothkit.models import ARCHITECTURES
from slothkit.models.shape import Shape

__all__ = ["SHAPES", "Shape", "shape_by_name"]

SHAPES: dict[str, Shape] = {name: shape for arch in ARCHITECTURES for name, shape in arch.shapes.items()}


def shape_by_name(name: str) -> Shape:
    if name not in SHAPES:
        raise ValueError(
            f"unknown model shape {name!r}; known shapes: {', '.join(SHAPES)} "
            f"(or pass a local checkpoint directory)"
        )
    return SHAPES[name]
