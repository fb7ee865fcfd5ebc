"""Gemma: (1 + w) RMSNorm, GeGLU (tanh) MLP, sqrt(hidden) embedding scale, tied head.

Gemma-7B's attention has head_dim 256 with hidden 3072 (16 heads), so the
attention width is not the hidden size; its vocabulary has 256,000 entries.
The embedding scale is applied by transformers (in GemmaModel.forward or its embedding
module) and by llama.cpp's gemma graph; only slothkit's own decode step applies it.
"""

from slothkit.models.architecture import Architecture, GGUFLayout, TinyTraits
from slothkit.models.shape import Shape

_ACT = "gelu_pytorch_tanh"
# hidden_activation: the name transformers 4.x reads for Gemma's MLP.
_ACTIVATION_KEYS = ("hidden_activation", "hidden_act")
_GEMMA = {"head_dim": 256, **{key: _ACT for key in _ACTIVATION_KEYS}, "rms_norm_eps": 1e-6}

GEMMA = Architecture(
    name="gemma",
    model_types=("gemma",),
    causal_lm_class="GemmaForCausalLM",
    hidden_act=_ACT,
    activation_keys=_ACTIVATION_KEYS,
    norm_adds_one=True,
    tied_embeddings=True,
    sliding_window=False,
    # llama.cpp's gemma graph rotates half-split pairs as HF does: Q/K rows stay as stored.
    gguf=GGUFLayout(arch="gemma", permute_qk=False, output_always_tied=True),
    fused=True,
    tiny=TinyTraits(
        rope_theta=10_000.0,
        rms_norm_eps=1e-6,
        head_dim=256,
        sliding_window=None,
        tokenizer="sentencepiece",
        chat_format="gemma",
        chat_specials=("<start_of_turn>", "<end_of_turn>"),
        end_of_turn="<end_of_turn>",
    ),
    shapes={
        "gemma-2b": Shape("gemma", 2048, 16384, 18, 8, 1, 256000, 8192, _GEMMA),
        "gemma-7b": Shape("gemma", 3072, 24576, 28, 16, 16, 256000, 8192, _GEMMA),
        "tiny-gemma": Shape("gemma", 64, 192, 2, 4, 1, 512, 2048, {**_GEMMA, "head_dim": 32}),
    },
    families=("Gemma 2B", "Gemma 7B"),
    unsloth_block_compile=False,
    embedding_scale=True,
)
