"""Qwen3 (dense): Qwen2's layers without the q/k/v biases and with an RMSNorm over each
head's queries and keys before the rotation:

    q = rope(q_norm(q_proj(x) viewed as heads)),  k = rope(k_norm(k_proj(x) viewed as heads))

Both norms scale by w, over the head dimension (128 in every size, also where
hidden_size / num_heads differs: Qwen3-0.6B's 1024 / 16). The fused attention runs the
projections, then the norms, then RoPE (slothkit.engine.decoder, `qk_norm`).

Its chat format is ChatML; the instruct models think first, between <think> and </think>,
unless the template is rendered with enable_thinking=False, which closes an empty think
block in the generation prompt. llama.cpp runs it as its "qwen3" graph (attn_q_norm,
attn_k_norm per layer; neox rotation).
"""

from slothkit.models.architecture import Architecture, GGUFLayout, TinyTraits
from slothkit.models.shape import Shape

_QWEN3 = {"rope_theta": 1_000_000.0, "rms_norm_eps": 1e-6, "head_dim": 128}
_TIED = {**_QWEN3, "tie_word_embeddings": True}

QWEN3 = Architecture(
    name="qwen3",
    model_types=("qwen3",),
    causal_lm_class="Qwen3ForCausalLM",
    hidden_act="silu",
    activation_keys=("hidden_act",),
    norm_adds_one=False,
    tied_embeddings=False,
    sliding_window=False,
    gguf=GGUFLayout(
        arch="qwen3",
        permute_qk=False,
        output_always_tied=False,
        norms=(
            ("input_layernorm", "attn_norm"),
            ("self_attn.q_norm", "attn_q_norm"),
            ("self_attn.k_norm", "attn_k_norm"),
            ("post_attention_layernorm", "ffn_norm"),
        ),
    ),
    fused=True,
    qk_norm=True,
    tiny=TinyTraits(
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        head_dim=32,  # unlike hidden_size // num_heads (16), as in Qwen3-0.6B
        sliding_window=None,
        tokenizer="qwen",
        chat_format="qwen3",
        chat_specials=("<|im_start|>", "<|im_end|>", "<think>", "</think>"),
        end_of_turn="<|im_end|>",
    ),
    shapes={
        "qwen3-0.6b": Shape("qwen3", 1024, 3072, 28, 16, 8, 151936, 40960, _TIED),
        "qwen3-1.7b": Shape("qwen3", 2048, 6144, 28, 16, 8, 151936, 40960, _TIED),
        "qwen3-4b": Shape("qwen3", 2560, 9728, 36, 32, 8, 151936, 40960, _TIED),
        "qwen3-8b": Shape("qwen3", 4096, 12288, 36, 32, 8, 151936, 40960, _QWEN3),
        "qwen3-14b": Shape("qwen3", 5120, 17408, 40, 40, 8, 151936, 40960, _QWEN3),
        "qwen3-32b": Shape("qwen3", 5120, 25600, 64, 64, 8, 151936, 40960, _QWEN3),
        "tiny-qwen3": Shape("qwen3", 64, 192, 2, 4, 2, 512, 2048, {**_QWEN3, "head_dim": 32}),
    },
    families=("Qwen3",),
)
