"""Shapes of families slothkit has no record for, by name: `slothkit bench` measures the
generic path (the model's own modules with slothkit's offloaded checkpointing and fused
head) on them, and `slothkit plan` predicts from them with its caveat for that path.

The mixture-of-experts shapes are the released checkpoints' per-layer shapes: the whole
model (what `slothkit plan` and the notebooks' hardware cell count), and for benchmarks on
one 80 GB card in 16 bits the same layers with fewer of them (the name says how many). Their experts train through slothkit's fused
experts (slothkit.engine.experts), the rest through the model's own modules.

OLMo 2 and SmolLM3 stand for the record-less families: OLMo 2's layers normalise the
attention's and the MLP's outputs and each full q/k projection, which no fused record
covers; SmolLM3's are Llama's but a quarter of them attend without RoPE. Both name their
modules as Llama does, so HF + PEFT adapts the same seven projections.
"""

from slothkit.models.shape import Shape

_OLMO2 = {"rope_theta": 500_000.0, "rms_norm_eps": 1e-6}
# SmolLM3-3B: Llama's parts, but every fourth layer's attention without RoPE, which the
# generic path's check at load tells from the others, so every layer keeps its own modules.
_SMOLLM3 = {
    "rope_theta": 5_000_000.0,
    "rms_norm_eps": 1e-6,
    "no_rope_layer_interval": 4,
    "tie_word_embeddings": True,
}
# Qwen3-30B-A3B: 128 experts of width 768, 8 per token, renormalised top-k weights.
_QWEN3_MOE = {
    "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
    "head_dim": 128, "rope_theta": 1_000_000.0, "rms_norm_eps": 1e-6,
}  # fmt: skip
# gpt-oss: experts of width 2880 with biases and the clamped SwiGLU, 4 per token, attention
# sinks, sliding (128) and full layers alternating; 20b has 32 experts, 120b 128.
_GPT_OSS = {"num_experts_per_tok": 4, "head_dim": 64, "sliding_window": 128, "rope_theta": 150_000.0}
# Gemma 4 E2B/E4B's traits at a tiny size: per-layer input embeddings (each layer is handed
# its slice of an embedding computed once before the layers), the last two layers reusing
# the keys and values of the last sliding and full layers before them (and a double-wide
# MLP there), sliding and full layers alternating, full layers with a wider head.
_TINY_GEMMA4 = {
    "head_dim": 16, "global_head_dim": 32, "hidden_size_per_layer_input": 16,
    "vocab_size_per_layer_input": 512, "num_kv_shared_layers": 2, "use_double_wide_mlp": True,
    "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"] * 2,
}  # fmt: skip
# Gemma 3n's text model, which shares those two traits, with its own: four alternating
# predictions of the hidden states (AltUp), a low-rank residual branch (LAuReL), and the
# first layer's MLP keeping only its top 5 % activations.
_TINY_GEMMA3N = {
    "head_dim": 16, "hidden_size_per_layer_input": 16, "vocab_size_per_layer_input": 512,
    "num_kv_shared_layers": 2, "sliding_window": 8, "laurel_rank": 8, "altup_num_inputs": 2,
    "activation_sparsity_pattern": [0.95, 0.0, 0.0, 0.0],
    "layer_types": ["sliding_attention", "full_attention"] * 2,
}  # fmt: skip

# Qwen3.5's text model: three gated DeltaNet (linear attention) layers, then one gated
# full-attention layer with a quarter of each head rotated.
_TINY_QWEN3_5 = {
    "head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
}  # fmt: skip

# Multimodal checkpoints of record-less families whose text model FastModel loads alone
# (slothkit.loading.text_tower), as a record's `text_tower_of` says for its family:
# multimodal model_type -> its text model's. Gemma 4's E2B, E4B and 31B checkpoints are
# image-text (E2B and E4B hear audio too).
TEXT_TOWERS = {"gemma4": "gemma4_text"}

# Qwen3.5-9B's text model (its checkpoint holds a vision tower too, which transformers'
# Qwen3_5ForCausalLM leaves on disk): 32 layers, every fourth a gated full-attention layer
# (16 heads of 256, 4 key/value heads, a quarter of each rotated), the others gated DeltaNet
# (16 key heads and 32 value heads of 128, a 4-wide causal convolution); untied head.
_QWEN3_5_9B = {
    "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
    "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 8, "tie_word_embeddings": False,
}  # fmt: skip
# Qwen3.5-35B-A3B's text model (transformers' Qwen3_5MoeTextConfig defaults, with the
# checkpoint's 262,144-token context; the checkpoint holds a vision tower too): Qwen3.5-9B's
# kinds of layer at 2048 hidden, 40 of them, every fourth gated full attention (16 heads of
# 256, 2 key/value heads), the others gated DeltaNet (16 key heads and 32 value heads of 128);
# every layer's MLP 256 experts of width 512, 8 per token, beside a shared expert of width
# 512 gated by sigmoid(shared_expert_gate(x)). Its config has no dense MLP width: the
# shape's intermediate_size is the experts' (as slothkit.models.shape.shape_from_config
# reads it). Untied head.
_QWEN3_5_MOE = {
    "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
    "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "num_experts": 256,
    "num_experts_per_tok": 8, "tie_word_embeddings": False,
}  # fmt: skip
# Gemma 4 E4B's text model (the checkpoint is image-text and audio): 42 layers, five sliding
# (512 tokens, heads of 256) to one full (heads of 512); per-layer input embeddings of 256
# per layer; the last 18 layers reuse earlier layers' keys and values; logits soft-capped.
_GEMMA4_E4B = {
    "head_dim": 256, "global_head_dim": 512, "hidden_size_per_layer_input": 256,
    "vocab_size_per_layer_input": 262_144, "num_kv_shared_layers": 18, "sliding_window": 512,
    "final_logit_softcapping": 30.0, "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 7,
}  # fmt: skip

# Record-less families whose attention normalises each head's q and k (Qwen3's q_norm and
# k_norm): the generic path fuses those norms as a record's, and the planner counts what
# they keep (slothkit.memory.memory_model.kept_layer_bytes).
PER_HEAD_QK_NORM_TYPES = frozenset({"qwen3_moe"})

# One shape a line.
# fmt: off
GENERIC_SHAPES: dict[str, Shape] = {
    "olmo-2-7b": Shape("olmo2", 4096, 11008, 32, 32, 32, 100352, 4096, _OLMO2),
    "smollm3-3b": Shape("smollm3", 2048, 11008, 36, 16, 4, 128256, 65536, _SMOLLM3),
    "tiny-olmo2": Shape("olmo2", 64, 192, 2, 4, 4, 512, 2048, _OLMO2),
    "qwen3-30b-a3b": Shape("qwen3_moe", 2048, 6144, 48, 32, 4, 151936, 40960, _QWEN3_MOE),
    "qwen3-30b-a3b-12l": Shape("qwen3_moe", 2048, 6144, 12, 32, 4, 151936, 40960, _QWEN3_MOE),
    "gpt-oss-20b": Shape("gpt_oss", 2880, 2880, 24, 64, 8, 201088, 131072, {**_GPT_OSS, "num_local_experts": 32}),
    "gpt-oss-120b-6l": Shape("gpt_oss", 2880, 2880, 6, 64, 8, 201088, 131072, {**_GPT_OSS, "num_local_experts": 128}),
    "tiny-qwen3-moe": Shape("qwen3_moe", 64, 128, 2, 4, 2, 512, 2048, {**_QWEN3_MOE, "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2, "head_dim": 16}),
    "qwen3.5-9b": Shape("qwen3_5_text", 4096, 12288, 32, 16, 4, 248320, 262144, _QWEN3_5_9B),
    "qwen3.5-35b-a3b": Shape("qwen3_5_moe_text", 2048, 512, 40, 16, 2, 248320, 262144, {**_QWEN3_5_MOE, "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 10}),
    "qwen3.5-35b-a3b-8l": Shape("qwen3_5_moe_text", 2048, 512, 8, 16, 2, 248320, 262144, {**_QWEN3_5_MOE, "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 2}),
    "gemma-4-e4b": Shape("gemma4_text", 2560, 10240, 42, 8, 2, 262144, 131072, _GEMMA4_E4B),
    "tiny-gemma4": Shape("gemma4_text", 64, 128, 4, 4, 2, 512, 2048, _TINY_GEMMA4),
    "tiny-gemma3n": Shape("gemma3n_text", 64, 128, 4, 4, 2, 512, 2048, _TINY_GEMMA3N),
    "tiny-qwen3.5": Shape("qwen3_5_text", 64, 128, 4, 4, 2, 512, 2048, _TINY_QWEN3_5),
    "tiny-gpt-oss": Shape("gpt_oss", 64, 32, 2, 4, 2, 512, 2048, {**_GPT_OSS, "num_local_experts": 8, "head_dim": 16, "sliding_window": 8}),
}
# fmt: on
