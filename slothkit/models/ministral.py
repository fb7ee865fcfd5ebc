"""Ministral: Qwen2's layers with Mistral's bias-free q, k and v, and a per-layer choice of
sliding-window or full attention (config.layer_types).

transformers builds each Ministral layer as Qwen2's, so each attention module carries its
own `sliding_window` (the config's on "sliding_attention" layers, None on
"full_attention" ones), which the fused attention and the fast decode step read. Its
tiny test checkpoint alternates a sliding layer with a full one, over a window of 8
tokens, so that even the 12-token batches of the parity tests hit it. The real checkpoints' tokenizer is Mistral's byte-level "tekken";
the tiny one keeps its special tokens (<s>, </s>, [INST], [/INST]) in the
SentencePiece-style flavour, with Mistral's [INST] chat format.

llama.cpp runs it as Mistral, with its llama graph (which ignores the window).
"""

from slothkit.models.architecture import Architecture, GGUFLayout, TinyTraits
from slothkit.models.shape import Shape

# Ministral-8B-Instruct-2410's config.json. Its window equals the context, so which layers
# slide changes nothing within it; the shape keeps transformers' default (every layer).
# Every shape names head_dim: MinistralConfig, unlike MistralConfig, leaves it None when
# absent, and the attention module then fails on None ** -0.5.
_MINISTRAL_8B = {"head_dim": 128, "sliding_window": 32768, "rope_theta": 100_000_000.0, "rms_norm_eps": 1e-5}

MINISTRAL = Architecture(
    name="ministral",
    model_types=("ministral",),
    causal_lm_class="MinistralForCausalLM",
    hidden_act="silu",
    activation_keys=("hidden_act",),
    norm_adds_one=False,
    tied_embeddings=False,
    sliding_window=True,
    gguf=GGUFLayout(arch="llama", permute_qk=True, output_always_tied=False, rope_freqs=True),
    fused=True,
    tiny=TinyTraits(
        rope_theta=100_000_000.0,
        rms_norm_eps=1e-5,
        head_dim=None,
        sliding_window=8,
        tokenizer="sentencepiece",
        chat_format="mistral",
        chat_specials=("[INST]", "[/INST]"),
        end_of_turn=None,
        # One sliding layer, one full: the two layers hold one of each kind.
        config={"layer_types": ["sliding_attention", "full_attention"]},
    ),
    shapes={
        "ministral-8b": Shape("ministral", 4096, 12288, 36, 32, 8, 131072, 32768, _MINISTRAL_8B),
        "tiny-ministral": Shape(
            "ministral",
            64,
            192,
            2,
            4,
            2,
            512,
            2048,
            {"head_dim": 16, "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]},
        ),
    },
    families=("Ministral",),
)
