"""What differs between the supported decoder architectures, as data.

The decoder glue (slothkit.engine.decoder) is written once; each architecture
file only fills in one of these records.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Architecture:
    name: str
    # transformers' `config.model_type` values this record covers.
    model_types: tuple[str, ...]
    # RMSNorm scales by (1 + weight) instead of weight (Gemma).
    norm_adds_one: bool
    # The embedding output is multiplied by sqrt(hidden_size) (Gemma); done by
    # transformers' model forward, recorded here for export.
    embedding_scaled: bool
    # The LM head shares the embedding matrix by default (Gemma).
    tied_embeddings: bool
    # Attention may be limited to a sliding window (Mistral).
    sliding_window: bool
    # Checkpoints covered, for messages and docs.
    families: tuple[str, ...] = ()

    def activation(self, config) -> str:
        """The gated MLP's activation name for slothkit_kernels.lora.lora_mlp."""
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
        if act in ("silu", "swish"):
            return "swiglu"
        if act in ("gelu_pytorch_tanh", "gelu_new", "gelu_fast"):
            return "geglu_tanh"
        if act == "gelu":
            return "geglu"
        raise ValueError(
            f"{self.name}: MLP activation {act!r} is not supported by the fused MLP "
            f"(supported: silu, gelu, gelu_pytorch_tanh)"
        )
