"""Gemma 2: Gemma's (1 + w) RMSNorm, GeGLU (tanh) MLP, sqrt(hidden) embedding scale and tied
head, with four norms per layer (Gemma 3's layout, without its q/k norms), sliding-window
attention on every second layer, and soft-capped attention and output logits.

transformers' Gemma2DecoderLayer:
    h = x + post_attention_layernorm(attn(input_layernorm(x)))
    y = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))
Every norm, like the final one, scales by (1 + w). The attention scores are
    s = c_a * tanh(q k^T / (sqrt(query_pre_attn_scalar) * c_a)),   c_a = attn_logit_softcapping (50)
and the output logits z = c_f * tanh(hidden @ W^T / c_f), c_f = final_logit_softcapping (30).

SDPA cannot soft-cap scores, so transformers refuses it for Gemma 2 and FastModel loads it with
eager attention (or flash attention where asked). slothkit's fused decoder runs it with Gemma's
norm and MLP and the sandwich layer (slothkit.engine.decoder_layer, `sandwich_norms`); the fused
attention hands the module's attn_logit_softcapping and its scale to transformers' attention
function, and the fused cross-entropy soft-caps the logits itself. The fast decode loop does
not cover it: generate stays Hugging Face's. llama.cpp runs it as its "gemma2" graph, which
reads both soft-caps and the window from the file and slides on every second layer, the first
included (slothkit.export.gguf.attention).
"""

from slothkit.models.architecture import Architecture, GGUFLayout, TinyTraits
from slothkit.models.gemma import GEMMA
from slothkit.models.shape import Shape

# Every Gemma 2: 4,096-token windows on alternate layers (transformers' default layer_types),
# 256-wide heads (27B: 128, with the query scale of hidden / heads), soft-caps 50 and 30.
_GEMMA2 = {
    "head_dim": 256,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0,
    "rms_norm_eps": 1e-6,
}

GEMMA2 = Architecture(
    name="gemma2",
    model_types=("gemma2",),
    causal_lm_class="Gemma2ForCausalLM",
    hidden_act=GEMMA.hidden_act,
    activation_keys=GEMMA.activation_keys,
    norm_adds_one=True,
    tied_embeddings=True,
    sliding_window=True,
    gguf=GGUFLayout(
        arch="gemma2",
        permute_qk=False,  # half-split ("neox") rotation, as HF's
        output_always_tied=True,  # llama.cpp's gemma2 reads the token embeddings as the head
        norms=(
            ("input_layernorm", "attn_norm"),
            ("post_attention_layernorm", "post_attention_norm"),
            ("pre_feedforward_layernorm", "ffn_norm"),
            ("post_feedforward_layernorm", "post_ffw_norm"),
        ),
        windowed_layers=True,
        fixed_sliding_pattern=2,
        logit_softcapping=True,
        query_scale_hidden_layers=46,
    ),
    fused=True,
    sandwich_norms=True,
    tiny=TinyTraits(
        rope_theta=10_000.0,
        rms_norm_eps=1e-6,
        head_dim=256,  # as in Gemma 2 2B and 9B, and what query_pre_attn_scalar (256) assumes
        sliding_window=16,  # short, so that a few sentences hit it
        tokenizer="sentencepiece",
        chat_format=GEMMA.tiny.chat_format,  # Gemma 2 keeps Gemma's turn format
        chat_specials=GEMMA.tiny.chat_specials,
        end_of_turn=GEMMA.tiny.end_of_turn,
    ),
    # The bench builds these and the planner predicts from them.
    shapes={
        "gemma-2-2b": Shape("gemma2", 2304, 9216, 26, 8, 4, 256000, 8192, _GEMMA2),
        "gemma-2-9b": Shape("gemma2", 3584, 14336, 42, 16, 8, 256000, 8192, _GEMMA2),
        "gemma-2-27b": Shape(
            "gemma2",
            4608,
            36864,
            46,
            32,
            16,
            256000,
            8192,
            {**_GEMMA2, "head_dim": 128, "query_pre_attn_scalar": 144},
        ),
        "tiny-gemma2": Shape(
            "gemma2",
            64,
            192,
            2,
            4,
            1,
            512,
            2048,
            {**_GEMMA2, "head_dim": 32, "query_pre_attn_scalar": 32, "sliding_window": 16},
        ),
    },
    families=("Gemma 2",),
    unsloth_block_compile=False,
    embedding_scale=True,
)
