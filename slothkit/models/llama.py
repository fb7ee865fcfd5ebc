"""Llama: plain RMSNorm, SwiGLU MLP, rotary attention with grouped-query heads.

Covers Llama 2 and 3 and checkpoints that share the architecture (CodeLlama, Yi,
TinyLlama).
"""

from slothkit.models.architecture import Architecture

LLAMA = Architecture(
    name="llama",
    model_types=("llama",),
    norm_adds_one=False,
    embedding_scaled=False,
    tied_embeddings=False,
    sliding_window=False,
    families=("Llama 2", "Llama 3", "CodeLlama", "Yi", "TinyLlama"),
)
