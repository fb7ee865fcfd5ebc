"""Mistral: Llama's layers with attention limited to a sliding window.

Its tiny test checkpoint keeps a window of 32 tokens, so that short sequences hit it,
a SentencePiece-style tokenizer and Mistral's [INST] chat format.
"""

from slothkit.models.architecture import Architecture, GGUFLayout, TinyTraits
from slothkit.models.shape import Shape

MISTRAL = Architecture(
    name="mistral",
    model_types=("mistral",),
    causal_lm_class="MistralForCausalLM",
    hidden_act="silu",
    activation_keys=("hidden_act",),
    norm_adds_one=False,
    tied_embeddings=False,
    sliding_window=True,
    # llama.cpp runs Mistral with its llama graph (which ignores the window).
    gguf=GGUFLayout(arch="llama", permute_qk=True, output_always_tied=False, rope_freqs=True),
    fused=True,
    tiny=TinyTraits(
        rope_theta=10_000.0,
        rms_norm_eps=1e-5,
        head_dim=None,
        sliding_window=32,
        tokenizer="sentencepiece",
        chat_format="mistral",
        chat_specials=("[INST]", "[/INST]"),
        end_of_turn=None,
    ),
    shapes={
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
        "tiny-mistral": Shape("mistral", 64, 192, 2, 4, 2, 512, 2048, {"sliding_window": 32}),
    },
    families=("Mistral",),
)
