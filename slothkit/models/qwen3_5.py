"""Qwen3.5 (text; transformers' qwen3_5_text): a hybrid of gated DeltaNet and attention layers.

Three of every four layers are gated DeltaNet (linear attention: a recurrent state updated by
the delta rule, fed by a short causal convolution over q, k, v, gated by z before out_proj);
every fourth is Qwen3's attention with a gate: q_proj writes each head's query and as many gate
values, and the attention's output is multiplied by their sigmoid before o_proj. A quarter of
each attention head is rotated. Every RMSNorm scales by 1 + w (as Gemma's) except the DeltaNet
output's gated norm, which scales by w.

slothkit has no fused decoder for it: FastModel trains it on the generic path (its tiny shape
and the real ones: slothkit.models.generic_shapes). This record serves GGUF export, as
llama.cpp's "qwen35" graph (slothkit.export.gguf.deltanet), which is why it sits in
EXPORT_ONLY_RECORDS.
"""

import dataclasses

from slothkit.models.architecture import GGUFExperts, GGUFLayout
from slothkit.models.qwen3 import QWEN3

QWEN3_5 = dataclasses.replace(
    QWEN3,
    name="qwen3_5",
    model_types=("qwen3_5_text",),
    causal_lm_class="Qwen3_5ForCausalLM",
    norm_adds_one=True,
    gguf=GGUFLayout(
        arch="qwen35",
        permute_qk=False,  # llama.cpp's qwen35 graph rotates half-split pairs, as HF does
        output_always_tied=False,
        # llama.cpp's tensor map names Qwen3.5's post_attention_layernorm (the MLP's input
        # norm) post_attention_norm; every one holds 1 + w (the converter adds 1 to each
        # "norm.weight" but the DeltaNet's linear_attn.norm).
        norms=(
            ("input_layernorm", "attn_norm"),
            ("self_attn.q_norm", "attn_q_norm"),
            ("self_attn.k_norm", "attn_k_norm"),
            ("post_attention_layernorm", "post_attention_norm"),
        ),
        deltanet=True,
        llama_cpp_python="0.3.36",  # its llama.cpp knows qwen35; slothkit has run no older one
    ),
    fused=False,
    shapes={},  # the generic path's shapes: slothkit.models.generic_shapes
    families=("Qwen3.5",),
)

# Qwen3.5's mixture-of-experts sizes (qwen3_5_moe_text): the same layers with Qwen3-MoE's
# experts in every layer (softmax router, the chosen experts' weights always renormalised)
# and a shared expert beside them, gated per token by sigmoid(shared_expert_gate(x)).
# llama.cpp runs them as its "qwen35moe" graph.
QWEN3_5_MOE = dataclasses.replace(
    QWEN3_5,
    name="qwen3_5_moe",
    model_types=("qwen3_5_moe_text",),
    causal_lm_class="Qwen3_5MoeForCausalLM",
    gguf=dataclasses.replace(
        QWEN3_5.gguf,
        arch="qwen35moe",
        experts=GGUFExperts(
            count_key="num_experts",
            used_count_key="num_experts_per_tok",
            width_key="moe_intermediate_size",
            shared_width_key="shared_expert_intermediate_size",
        ),
    ),
    families=("Qwen3.5 MoE",),
)
