"""Llama: plain RMSNorm, SwiGLU MLP, rotary attention with grouped-query heads.

Covers Llama 2 and 3 and checkpoints that share the architecture (CodeLlama, Yi,
TinyLlama). Its tiny test checkpoint is a Llama 3: rope theta 500,000, byte-level BPE
tokenizer, Llama 3's chat format.
"""

from slothkit.models.architecture import Architecture, GGUFLayout, TinyTraits
from slothkit.models.shape import Shape

_LLAMA3 = {"rope_theta": 500000.0, "rms_norm_eps": 1e-5, "hidden_act": "silu"}

LLAMA = Architecture(
    name="llama",
    model_types=("llama",),
    causal_lm_class="LlamaForCausalLM",
    hidden_act="silu",
    activation_keys=("hidden_act",),
    norm_adds_one=False,
    tied_embeddings=False,
    sliding_window=False,
    gguf=GGUFLayout(arch="llama", permute_qk=True, output_always_tied=False, rope_freqs=True),
    fused=True,
    tiny=TinyTraits(
        rope_theta=500_000.0,
        rms_norm_eps=1e-5,
        head_dim=None,
        sliding_window=None,
        tokenizer="bpe",
        chat_format="llama-3",
        chat_specials=("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
        end_of_turn="<|eot_id|>",
    ),
    shapes={
        "llama-3-8b": Shape("llama", 4096, 14336, 32, 32, 8, 128256, 8192, _LLAMA3),
        "llama-3-70b": Shape("llama", 8192, 28672, 80, 64, 8, 128256, 8192, _LLAMA3),
        "tinyllama-1.1b": Shape(
            "llama", 2048, 5632, 22, 32, 4, 32000, 2048, {"rope_theta": 10000.0, "rms_norm_eps": 1e-5}
        ),
        "tiny-llama": Shape("llama", 64, 192, 2, 4, 2, 512, 2048, _LLAMA3),
    },
    families=("Llama 2", "Llama 3", "CodeLlama", "Yi", "TinyLlama"),
    demo_model="smollm2-135m-instruct",
)
