"""slothkit_kernels: fused Triton kernels with hand-derived backward passes.

Needs only torch and triton and knows nothing of models.  Each op runs its
Triton kernel on CUDA tensors (and on CPU tensors under ``TRITON_INTERPRET=1``)
and its plain-torch reference, named ``<op>_reference``, elsewhere.

An op of one module is that module (attention, cross_entropy, fused_linear_cross_entropy,
geglu, swiglu, rms_norm); a concept of several modules is a folder whose ``__init__``
exports its public functions (rope/, lora/, nf4/, moe/, delta_rule/).  What they share: ``utils``
(launch settings and the dispatch rule), ``split_k`` (the decode GEMVs' split-K) and
``testing`` (numerical comparisons against references).
"""

from slothkit_kernels.attention import attention, attention_reference
from slothkit_kernels.cross_entropy import cross_entropy, cross_entropy_reference
from slothkit_kernels.delta_rule import gated_delta_rule, gated_delta_rule_reference
from slothkit_kernels.fused_linear_cross_entropy import (
    fused_linear_cross_entropy,
    fused_linear_cross_entropy_reference,
)
from slothkit_kernels.geglu import geglu, geglu_reference
from slothkit_kernels.lora import (
    LoRAProjection,
    lora_gemv,
    lora_gemv_group,
    lora_gemv_group_reference,
    lora_gemv_reference,
    lora_linear,
    lora_mlp,
    lora_mlp_reference,
    lora_o,
    lora_o_residual,
    lora_qkv,
    lora_qkv_reference,
    lora_qkv_rope,
)
from slothkit_kernels.moe import ExpertLoRA, moe_lora_experts, moe_lora_experts_reference
from slothkit_kernels.nf4 import (
    NF4Weight,
    dequantize_nf4,
    dequantize_nf4_reference,
    nf4_lora_gemv,
    nf4_lora_gemv_group,
    nf4_lora_gemv_group_reference,
    nf4_lora_gemv_reference,
)
from slothkit_kernels.rms_norm import rms_norm, rms_norm_reference
from slothkit_kernels.rope import rope, rope_into_cache, rope_into_cache_reference, rope_reference, rotate
from slothkit_kernels.swiglu import swiglu, swiglu_reference

__all__ = [
    "ExpertLoRA",
    "LoRAProjection",
    "NF4Weight",
    "attention",
    "attention_reference",
    "cross_entropy",
    "cross_entropy_reference",
    "dequantize_nf4",
    "dequantize_nf4_reference",
    "fused_linear_cross_entropy",
    "fused_linear_cross_entropy_reference",
    "gated_delta_rule",
    "gated_delta_rule_reference",
    "geglu",
    "geglu_reference",
    "lora_gemv",
    "lora_gemv_reference",
    "lora_gemv_group",
    "lora_gemv_group_reference",
    "lora_linear",
    "lora_mlp",
    "lora_mlp_reference",
    "lora_o",
    "lora_o_residual",
    "lora_qkv",
    "lora_qkv_reference",
    "lora_qkv_rope",
    "moe_lora_experts",
    "moe_lora_experts_reference",
    "nf4_lora_gemv",
    "nf4_lora_gemv_reference",
    "nf4_lora_gemv_group",
    "nf4_lora_gemv_group_reference",
    "rms_norm",
    "rms_norm_reference",
    "rope",
    "rope_into_cache",
    "rope_into_cache_reference",
    "rope_reference",
    "rotate",
    "swiglu",
    "swiglu_reference",
]
