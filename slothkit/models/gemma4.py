"""Gemma 4 (text; transformers' gemma4_text): Gemma 3's sandwich layers, q/k norms and
alternating sliding and full layers, with what E2B and E4B add:

  - per-layer input embeddings: a second embedding table (hidden_size_per_layer_input wide
    per layer, every layer's slice in one row), mixed once with a projection of the token
    embeddings; each layer gates its slice by its hidden state (per_layer_input_gate),
    projects it back (per_layer_projection), normalises it and adds it to its output;
  - the last num_kv_shared_layers layers reuse the keys and values of the last earlier
    layer of their type, and hold no k/v projections of their own;
  - wider heads on the full layers (per_layer_config), rotated "proportionally": a share of
    each head's frequencies at the full head's spacing, the others not at all;
  - a scalar per layer multiplying its output (layer_scalar), and norms that scale by w
    (not Gemma's 1 + w); the query scale is 1, q_norm setting the queries' size;
  - in the larger sizes, full layers whose values are their keys (attention_k_eq_v, 31B)
    and a mixture-of-experts block beside the MLP (26B-A4B).

slothkit has no fused decoder for it: FastModel trains it on the generic path. This record
serves GGUF export, as llama.cpp's "gemma4" graph (slothkit.export.gguf.gemma4), which is
why it sits in EXPORT_ONLY_RECORDS.
"""

import dataclasses

from slothkit.models.architecture import GGUFLayout
from slothkit.models.gemma3 import GEMMA3

GEMMA4 = dataclasses.replace(
    GEMMA3,
    name="gemma4",
    model_types=("gemma4_text",),
    causal_lm_class="Gemma4ForCausalLM",
    norm_adds_one=False,
    gguf=GGUFLayout(
        arch="gemma4",
        permute_qk=False,  # half-split ("neox") rotation, as HF's
        output_always_tied=False,  # llama.cpp's gemma4 reads output.weight where the head is untied
        norms=(
            ("input_layernorm", "attn_norm"),
            ("self_attn.q_norm", "attn_q_norm"),
            ("self_attn.k_norm", "attn_k_norm"),
            ("post_attention_layernorm", "post_attention_norm"),
            ("pre_feedforward_layernorm", "ffn_norm"),
            ("post_feedforward_layernorm", "post_ffw_norm"),
            ("post_per_layer_input_norm", "post_norm"),
            # the mixture-of-experts block's (26B-A4B): its input norm, and each branch's output
            ("pre_feedforward_layernorm_2", "pre_ffw_norm_2"),
            ("post_feedforward_layernorm_1", "post_ffw_norm_1"),
            ("post_feedforward_layernorm_2", "post_ffw_norm_2"),
        ),
        windowed_layers=True,  # the file's pattern says which layers slide, as for Gemma 3
        gemma4=True,
        llama_cpp_python="0.3.36",  # its llama.cpp knows gemma4; slothkit has run no older one
    ),
    fused=False,
    sandwich_norms=True,
    text_tower_of=(),  # the generic path's loading reads generic_shapes.TEXT_TOWERS
    shapes={},  # the generic path's shapes: slothkit.models.generic_shapes
    families=("Gemma 4",),
)
