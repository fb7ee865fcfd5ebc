"""gpt-oss: a mixture-of-experts MLP in every layer, sliding-window and full attention layers
alternating (the first slides), and attention with biases and sinks (one learned logit per
head that joins each softmax and takes its share of the weight, then is dropped). A router
(mlp.router, with a bias) scores the experts; each token runs through the
num_experts_per_tok best, weighted by the softmax of their scores; each expert is a clamped
SwiGLU with biases, gate and up interleaved by column:

    gate = min(gate, limit), up = clamp(up, -limit, limit), out = (up + 1) * gate * sigmoid(alpha * gate)

with alpha 1.702 and limit 7.0. The rope is YaRN (factor 32 over an original context of
4096, unrounded correction range: slothkit.export.gguf.yarn), rotating the two halves of
each head.

slothkit has no fused decoder for it: FastModel trains it on the generic path, its experts
through slothkit.engine.experts. This record serves GGUF export (llama.cpp's "gpt-oss"
graph, LLM_ARCH_OPENAI_MOE), which is why it sits in EXPERT_RECORDS and not in RECORDS.
"""

from slothkit.models.architecture import Architecture, GGUFExperts, GGUFLayout, TinyTraits

GPT_OSS = Architecture(
    name="gpt_oss",
    model_types=("gpt_oss",),
    causal_lm_class="GptOssForCausalLM",
    hidden_act="silu",
    activation_keys=("hidden_act",),
    norm_adds_one=False,
    tied_embeddings=False,
    sliding_window=True,
    gguf=GGUFLayout(
        arch="gpt-oss",
        permute_qk=False,  # llama.cpp's gpt-oss graph rotates halves (neox), as HF does
        output_always_tied=False,
        # post_attention_layernorm normalises the MLP's input; llama.cpp's converter names it
        # post_attention_norm for this graph, which reads it where Llama's reads ffn_norm.
        norms=(("input_layernorm", "attn_norm"), ("post_attention_layernorm", "post_attention_norm")),
        windowed_layers=True,
        # llama.cpp's graph slides every second layer, the first included (set_swa_pattern(2)).
        fixed_sliding_pattern=2,
        yarn=True,
        experts=GGUFExperts(
            count_key="num_local_experts",
            used_count_key="num_experts_per_tok",
            width_key="intermediate_size",
            router="mlp.router",
            transposed=True,
            interleaved=True,
            # llama.cpp's graph weights the chosen experts by the softmax of their scores
            # alone (LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX_WEIGHT), as HF's router does, and
            # runs ggml_swiglu_oai with these constants.
            graph_constants=(("swiglu_alpha", 1.702), ("swiglu_limit", 7.0)),
        ),
    ),
    fused=False,
    tiny=TinyTraits(
        rope_theta=150_000.0,
        rms_norm_eps=1e-5,
        head_dim=16,
        sliding_window=8,
        tokenizer="bpe",
        chat_format="gpt-oss",
        chat_specials=("<|start|>", "<|message|>", "<|channel|>", "<|end|>", "<|return|>", "<|call|>"),
        end_of_turn="<|return|>",
    ),
    shapes={},  # the generic path's shapes: slothkit.models.generic_shapes
    families=("gpt-oss",),
)
