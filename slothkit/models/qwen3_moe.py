"""Qwen3-MoE: Qwen3's attention (q/k norms, no biases) with a mixture-of-experts MLP in every
layer. A router (mlp.gate, experts x hidden) scores the experts; each token runs through the
num_experts_per_tok best, weighted by their softmax scores renormalised over the chosen ones
(norm_topk_prob); each expert is a SwiGLU MLP of width moe_intermediate_size.

slothkit has no fused decoder for it: FastModel trains it on the generic path, its experts
through slothkit.engine.experts. This record serves GGUF export (llama.cpp's "qwen3moe" graph)
and the fast decode loop (slothkit.inference: Qwen3's attention, the experts through
decode_experts.py), which is why it sits in EXPERT_RECORDS and not in RECORDS.
"""

import dataclasses

from slothkit.models.architecture import GGUFExperts
from slothkit.models.qwen3 import QWEN3

QWEN3_MOE = dataclasses.replace(
    QWEN3,
    name="qwen3_moe",
    model_types=("qwen3_moe",),
    causal_lm_class="Qwen3MoeForCausalLM",
    gguf=dataclasses.replace(
        QWEN3.gguf,
        arch="qwen3moe",
        experts=GGUFExperts(
            count_key="num_experts",
            used_count_key="num_experts_per_tok",
            width_key="moe_intermediate_size",
            # llama.cpp's qwen3moe graph always renormalises the chosen experts' weights.
            renormalised_key="norm_topk_prob",
        ),
    ),
    fused=False,
    shapes={},  # the generic path's shapes: slothkit.models.generic_shapes
    families=("Qwen3-MoE",),
)
