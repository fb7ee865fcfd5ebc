"""Model shapes `slothkit bench` knows by name: the real configs' sizes, no weights.

The benchmark builds each model with random weights from these numbers, so no
download is needed; a local checkpoint directory works as well.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Shape:
    model_type: str  # transformers model_type
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    max_position_embeddings: int
    extra: dict = field(default_factory=dict)

    def config(self):
        from transformers import AutoConfig

        return AutoConfig.for_model(
            self.model_type,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            vocab_size=self.vocab_size,
            max_position_embeddings=self.max_position_embeddings,
            **self.extra,
        )

    def matmul_parameters(self) -> int:
        """Parameters of the projections and LM head: the ones that cost FLOPs per token."""
        head_dim = self.extra.get("head_dim", self.hidden_size // self.num_attention_heads)
        q = self.hidden_size * self.num_attention_heads * head_dim
        kv = 2 * self.hidden_size * self.num_key_value_heads * head_dim
        o = self.num_attention_heads * head_dim * self.hidden_size
        mlp = 3 * self.hidden_size * self.intermediate_size
        return self.num_hidden_layers * (q + kv + o + mlp) + self.vocab_size * self.hidden_size


_LLAMA3 = {"rope_theta": 500000.0, "rms_norm_eps": 1e-5, "hidden_act": "silu"}
_GEMMA = {
    "head_dim": 256,
    "hidden_act": "gelu_pytorch_tanh",
    "hidden_activation": "gelu_pytorch_tanh",
    "rms_norm_eps": 1e-6,
}

SHAPES: dict[str, Shape] = {
    "llama-3-8b": Shape("llama", 4096, 14336, 32, 32, 8, 128256, 8192, _LLAMA3),
    "llama-3-70b": Shape("llama", 8192, 28672, 80, 64, 8, 128256, 8192, _LLAMA3),
    "gemma-2b": Shape("gemma", 2048, 16384, 18, 8, 1, 256000, 8192, _GEMMA),
    "gemma-7b": Shape("gemma", 3072, 24576, 28, 16, 16, 256000, 8192, _GEMMA),
    "mistral-7b": Shape(
        "mistral",
        4096,
        14336,
        32,
        32,
        8,
        32000,
        32768,
        {"sliding_window": 4096, "rope_theta": 10000.0, "rms_norm_eps": 1e-5},
    ),
    "tinyllama-1.1b": Shape(
        "llama", 2048, 5632, 22, 32, 4, 32000, 2048, {"rope_theta": 10000.0, "rms_norm_eps": 1e-5}
    ),
    # Tiny shapes: the CPU configuration (tests, machines without a GPU).
    "tiny-llama": Shape("llama", 64, 192, 2, 4, 2, 512, 2048, _LLAMA3),
    "tiny-mistral": Shape("mistral", 64, 192, 2, 4, 2, 512, 2048, {"sliding_window": 32}),
    "tiny-gemma": Shape("gemma", 64, 192, 2, 4, 1, 512, 2048, {**_GEMMA, "head_dim": 32}),
}


def shape_by_name(name: str) -> Shape:
    if name not in SHAPES:
        raise ValueError(
            f"unknown model shape {name!r}; known shapes: {', '.join(SHAPES)} "
            f"(or pass a local checkpoint directory)"
        )
    return SHAPES[name]
