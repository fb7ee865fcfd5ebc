"""Mixtral: Mistral's attention with a mixture-of-experts MLP in every layer. A router
(mlp.gate, experts x hidden) scores the experts; each token runs through the
num_experts_per_tok best, weighted by their softmax scores renormalised over the chosen
ones; each expert is a SwiGLU MLP of width intermediate_size.

slothkit has no fused decoder for it: FastModel trains it on the generic path, its experts
through slothkit.engine.experts. This record serves GGUF export: llama.cpp runs Mixtral as
its "llama" graph with experts (ffn_gate_inp and the expert stacks in place of ffn_gate,
ffn_up and ffn_down; softmax over every expert, the chosen ones' weights renormalised, as
HF's router computes them), which is why it sits in EXPERT_RECORDS and not in RECORDS.
"""

import dataclasses

from slothkit.models.architecture import GGUFExperts
from slothkit.models.mistral import MISTRAL

MIXTRAL = dataclasses.replace(
    MISTRAL,
    name="mixtral",
    model_types=("mixtral",),
    causal_lm_class="MixtralForCausalLM",
    gguf=dataclasses.replace(
        MISTRAL.gguf,
        experts=GGUFExperts(
            count_key="num_local_experts",
            used_count_key="num_experts_per_tok",
            width_key="intermediate_size",
        ),
    ),
    fused=False,
    shapes={},  # the generic path's shapes: slothkit.models.generic_shapes
    families=("Mixtral",),
)
