"""Gemma: (1 + w) RMSNorm, GeGLU (tanh) MLP, sqrt(hidden) embedding scale, tied head.

Gemma-7B's attention has head_dim 256 with hidden 3072 (16 heads), so the
attention width is not the hidden size; its vocabulary has 256,000 entries.
"""

from slothkit.models.architecture import Architecture

GEMMA = Architecture(
    name="gemma",
    model_types=("gemma",),
    norm_adds_one=True,
    embedding_scaled=True,
    tied_embeddings=True,
    sliding_window=False,
    families=("Gemma 2B", "Gemma 7B"),
)
