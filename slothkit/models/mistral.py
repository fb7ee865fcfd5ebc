"""Mistral: Llama's layers with attention limited to a sliding window."""

from slothkit.models.architecture import Architecture

MISTRAL = Architecture(
    name="mistral",
    model_types=("mistral",),
    norm_adds_one=False,
    embedding_scaled=False,
    tied_embeddings=False,
    sliding_window=True,
    families=("Mistral",),
)
