"""Gemma 3 (text): Gemma's (1 + w) RMSNorm, GeGLU (tanh) MLP, sqrt(hidden) embedding scale
and tied head, with four norms per layer, RMSNorm on each head's queries and keys, and
attention that alternates sliding-window layers (rope base 10,000) with global ones
(rope base 1,000,000).

The four norms, in transformers' Gemma3DecoderLayer:
    h = x + post_attention_layernorm(attn(input_layernorm(x)))
    y = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))
q_norm and k_norm normalise each head's queries and keys before the rotation. Every one of
them, like the final norm, scales by (1 + w).

slothkit's fused decoder runs it with Gemma's norm and MLP, Qwen3's per-head q/k norms and
the sandwich layer (slothkit.engine.decoder_layer, `sandwich_norms`). transformers gives
each layer its own rotary tables (by layer type) and each attention module its window and
its scale, query_pre_attn_scalar ** -0.5, which the fused attention reads off the module.
The fast decode loop runs its sandwich layers with each layer type's rotary table and each
window's mask (slothkit.inference.model_step). llama.cpp runs it as
its "gemma3" graph; which layer slides, and the sliding layers' rope base, go into the file
(slothkit.export.gguf.attention).
"""

from slothkit.models.architecture import Architecture, GGUFLayout, TinyTraits
from slothkit.models.gemma import GEMMA
from slothkit.models.shape import Shape

# Every Gemma 3 text tower: 256-wide heads (27B: 128, with its own query scale), every sixth
# layer global (transformers' default layer_types), tied embeddings; the 270M and 1B slide
# over 512 tokens, the larger ones over 1,024.
_SMALL = {"head_dim": 256, "sliding_window": 512, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-6}
_LARGE = {**_SMALL, "sliding_window": 1024}

GEMMA3 = Architecture(
    name="gemma3",
    model_types=("gemma3_text",),
    causal_lm_class="Gemma3ForCausalLM",
    hidden_act=GEMMA.hidden_act,
    activation_keys=GEMMA.activation_keys,
    norm_adds_one=True,
    tied_embeddings=True,
    sliding_window=True,
    gguf=GGUFLayout(
        arch="gemma3",
        permute_qk=False,  # half-split ("neox") rotation, as HF's
        # llama.cpp's gemma3 reads output.weight when the file has one (an untied head), else
        # the token embeddings; Gemma 3's checkpoints tie them, so none is written.
        output_always_tied=False,
        norms=(
            ("input_layernorm", "attn_norm"),
            ("self_attn.q_norm", "attn_q_norm"),
            ("self_attn.k_norm", "attn_k_norm"),
            ("post_attention_layernorm", "post_attention_norm"),
            ("pre_feedforward_layernorm", "ffn_norm"),
            ("post_feedforward_layernorm", "post_ffw_norm"),
        ),
        windowed_layers=True,
        query_scale_hidden_layers=62,
    ),
    fused=True,
    qk_norm=True,
    sandwich_norms=True,
    tiny=TinyTraits(
        rope_theta=1_000_000.0,  # the global layers'; the sliding ones keep the config's 10,000
        rms_norm_eps=1e-6,
        head_dim=256,  # as in every Gemma 3, and what query_pre_attn_scalar (256) assumes
        sliding_window=16,  # short, so that a few sentences hit it
        tokenizer="sentencepiece",
        chat_format=GEMMA.tiny.chat_format,  # Gemma 3 keeps Gemma's turn format
        chat_specials=GEMMA.tiny.chat_specials,
        end_of_turn=GEMMA.tiny.end_of_turn,
        # Every second layer global (the real models: every sixth), so that two layers hold
        # one of each kind.
        config={"sliding_window_pattern": 2},
    ),
    # The bench builds these and the planner predicts from them.
    shapes={
        "gemma-3-270m": Shape("gemma3_text", 640, 2048, 18, 4, 1, 262144, 32768, _SMALL),
        "gemma-3-1b": Shape("gemma3_text", 1152, 6912, 26, 4, 1, 262144, 32768, _SMALL),
        "gemma-3-4b": Shape("gemma3_text", 2560, 10240, 34, 8, 4, 262208, 131072, _LARGE),
        "gemma-3-12b": Shape("gemma3_text", 3840, 15360, 48, 16, 8, 262208, 131072, _LARGE),
        "gemma-3-27b": Shape(
            "gemma3_text",
            5376,
            21504,
            62,
            32,
            16,
            262208,
            131072,
            {**_LARGE, "head_dim": 128, "query_pre_attn_scalar": 168},
        ),
        "tiny-gemma3": Shape(
            "gemma3_text",
            64,
            192,
            2,
            4,
            1,
            512,
            2048,
            {
                **_SMALL,
                "head_dim": 32,
                "query_pre_attn_scalar": 32,
                "sliding_window": 16,
                "sliding_window_pattern": 2,
            },
        ),
    },
    families=("Gemma 3 (text)",),
    unsloth_block_compile=False,
    embedding_scale=True,
    text_tower_of=("gemma3",),  # the 4B, 12B and 27B checkpoints hold a vision tower too
)
