"""Phi-3, Phi-3.5 and Phi-4 (transformers' model_type "phi3"): Llama's layer (plain RMSNorm,
SwiGLU MLP, rotary attention with grouped-query heads) with two projections fused:

    qkv_proj      (q_heads + 2 kv_heads) * head_dim rows: q's, then k's, then v's
    gate_up_proj  2 * intermediate rows: gate's, then up's

LoRA goes on these layers as they are (qkv_proj, o_proj, gate_up_proj, down_proj; the
seven Llama names a notebook passes map onto them, slothkit.loading.lora_setup), rather than on
q/k/v and gate/up split into layers of their own. So a saved adapter loads on the original
model with plain PEFT, a merged save needs no re-fusing, and GGUF's phi3 layout (one
attn_qkv, one ffn_up holding gate and up) is written as it is. The price is one rank-r
update shared by q, k and v (and by gate and up) rather than one each.

The fused path reads each fused layer as row ranges (slothkit.engine.lora_projection's
describe_rows): views of the base weight's rows (of an NF4 weight's packed bytes and
scales), of B's rows, and the one A they share, which then run through the same kernels as
Llama's separate projections.

Rotary tables come from transformers' model forward, so Phi-3.5's and the 128k models'
"longrope" scaling (short or long factors by sequence length, and its attention factor
folded into cos and sin) reaches the fused attention as it is. Phi-4-mini rotates only the
first 3/4 of each head (partial_rotary_factor 0.75), which the RoPE kernel does not: such
configs train on the generic path (slothkit.models.generic_path_reason), said once.

Phi-3-mini-4k and Phi-3-medium-4k set sliding_window 2047 (the 128k ones 262144, beyond
their context): transformers builds a sliding-window mask from it and passes it to the
attention function, and the fused attention does the same (attention_window). The class
default is no window, so the record's sliding_window is False and the tiny checkpoint has
none; its GGUF layout's optional_window writes a checkpoint's window below its context as
phi3.attention.sliding_window. llama.cpp's phi3 graph reads that key and switches the
window off all the same, so its output differs from HF's past 2,047 tokens
(slothkit.export.gguf.attention). GGUF files carry the 128k models' and Phi-3.5's longrope
factors as llama.cpp reads them (slothkit.export.gguf.longrope).

Chat: Phi-3 and 3.5 close each turn with <|end|> after <|user|>/<|assistant|> headers;
Phi-4 uses ChatML-like <|im_start|>role<|im_sep|>...<|im_end|>. llama.cpp runs all of them
as its "phi3" graph (neox rotation: Q/K rows as stored).
"""

from slothkit.models.architecture import Architecture, GGUFLayout, TinyTraits
from slothkit.models.shape import Shape

# A shape is a size (what the planner predicts from, the bench's random weights): the 4k
# models' 2,047-token window and the 128k models' longrope tables are left out, as neither
# changes it.
_PHI3 = {"rope_theta": 10000.0, "rms_norm_eps": 1e-5}

PHI3 = Architecture(
    name="phi3",
    model_types=("phi3",),
    causal_lm_class="Phi3ForCausalLM",
    hidden_act="silu",
    activation_keys=("hidden_act",),
    norm_adds_one=False,
    tied_embeddings=False,
    sliding_window=False,  # the class default; a checkpoint's window is read per module
    gguf=GGUFLayout(
        arch="phi3", permute_qk=False, output_always_tied=False, optional_window=True, rope_factors=True
    ),
    fused=True,
    fused_projections=True,
    tiny=TinyTraits(
        rope_theta=10_000.0,
        rms_norm_eps=1e-5,
        head_dim=None,
        sliding_window=None,
        tokenizer="sentencepiece",  # Phi-3's is Llama 2's SentencePiece vocabulary
        chat_format="phi-3",
        # <|endoftext|> (Phi-3's eos_token) closes a finished conversation; llama.cpp looks it
        # up in the vocabulary of any model whose name holds "phi3", so the tiny tokenizer has it.
        chat_specials=("<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|endoftext|>"),
        end_of_turn="<|end|>",
    ),
    shapes={
        "phi-3-mini-4k": Shape("phi3", 3072, 8192, 32, 32, 32, 32064, 4096, _PHI3),
        "phi-3.5-mini": Shape("phi3", 3072, 8192, 32, 32, 32, 32064, 131072, _PHI3),
        "phi-3-medium-4k": Shape("phi3", 5120, 17920, 40, 40, 10, 32064, 4096, _PHI3),
        "phi-4": Shape("phi3", 5120, 17920, 40, 40, 10, 100352, 16384, {**_PHI3, "rope_theta": 250000.0}),
        # Phi3Config's default pad_token_id (32000) lies outside a 512-row vocabulary.
        "tiny-phi3": Shape("phi3", 64, 192, 2, 4, 2, 512, 2048, {**_PHI3, "pad_token_id": 0}),
    },
    families=("Phi-3", "Phi-3.5", "Phi-4"),
)
