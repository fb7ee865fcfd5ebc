"""Qwen2: Llama's layers with a bias on the q, k and v projections, Qwen's byte-level BPE
vocabulary and ChatML turns.

Covers Qwen2, Qwen2.5 (and their Coder and Math variants) and the DeepSeek-R1 distills of
Qwen. The small checkpoints (0.5B to 3B) tie the LM head to the embeddings, the larger
ones do not: each named shape says which. Qwen2 may limit some layers to a sliding window
(use_sliding_window, off in every released checkpoint); transformers then gives each
attention module its own `sliding_window`, which the fused attention reads.

llama.cpp runs it as its "qwen2" graph: half-split ("neox") rotation, so the Q/K rows are
written as stored, and the three biases as blk.N.attn_{q,k,v}.bias.

Qwen2.5-VL's language model is this decoder (`language_model_types`): FastVisionModel
runs it on the fused path. GGUF export writes it by QWEN2_5_VL_TEXT, as llama.cpp's
"qwen2vl" graph: the same tensors, rotated by M-RoPE, so that llama.cpp's libmtmd can give
the image tokens their (time, height, width) positions.
"""

import dataclasses

from slothkit.models.architecture import Architecture, GGUFLayout, TinyTraits
from slothkit.models.shape import Shape

_QWEN25 = {"rope_theta": 1_000_000.0, "rms_norm_eps": 1e-6}
_TIED = {**_QWEN25, "tie_word_embeddings": True}

QWEN2 = Architecture(
    name="qwen2",
    model_types=("qwen2",),
    causal_lm_class="Qwen2ForCausalLM",
    hidden_act="silu",
    activation_keys=("hidden_act",),
    norm_adds_one=False,
    tied_embeddings=False,
    sliding_window=False,
    gguf=GGUFLayout(arch="qwen2", permute_qk=False, output_always_tied=False),
    fused=True,
    tiny=TinyTraits(
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        head_dim=None,
        sliding_window=None,
        tokenizer="qwen",
        chat_format="qwen-2.5",
        chat_specials=("<|im_start|>", "<|im_end|>"),
        end_of_turn="<|im_end|>",
    ),
    shapes={
        "qwen2.5-0.5b": Shape("qwen2", 896, 4864, 24, 14, 2, 151936, 32768, _TIED),
        "qwen2.5-1.5b": Shape("qwen2", 1536, 8960, 28, 12, 2, 151936, 32768, _TIED),
        "qwen2.5-3b": Shape("qwen2", 2048, 11008, 36, 16, 2, 151936, 32768, _TIED),
        "qwen2.5-7b": Shape("qwen2", 3584, 18944, 28, 28, 4, 152064, 32768, _QWEN25),
        "qwen2.5-14b": Shape("qwen2", 5120, 13824, 48, 40, 8, 152064, 32768, _QWEN25),
        "tiny-qwen2": Shape("qwen2", 64, 192, 2, 4, 2, 512, 2048, _QWEN25),
    },
    families=("Qwen2", "Qwen2.5", "Qwen2.5-Coder", "Qwen2.5-Math", "DeepSeek-R1-Distill-Qwen"),
    # Qwen2.5-VL's language model: these layers, whose rotary tables transformers builds by
    # M-RoPE (each frequency band takes the temporal, height or width position), one
    # (B, T, D) table like any other that the fused RoPE reads as it is.
    language_model_types=("qwen2_5_vl_text",),
)

# Qwen2.5-VL's language model (qwen2_5_vl_text) for GGUF export alone (EXPORT_ONLY_RECORDS):
# Qwen2's tensors under llama.cpp's "qwen2vl" graph, whose rope.dimension_sections split
# each head's rotated pairs among the position axes as transformers' mrope_section does.
QWEN2_5_VL_TEXT = dataclasses.replace(
    QWEN2,
    name="qwen2_5_vl_text",
    model_types=("qwen2_5_vl_text",),
    gguf=dataclasses.replace(QWEN2.gguf, arch="qwen2vl", mrope_sections=True),
    fused=False,
    shapes={},
    families=("Qwen2.5-VL",),
    language_model_types=(),
)
