"""LoRA-adapted projections with hand-derived backward passes, and the decode GEMVs.

* ``ops``: the public training ops (``lora_linear``, ``lora_o``, ``lora_o_residual``,
  ``lora_qkv``, ``lora_qkv_rope``, ``lora_mlp``) and their plain-torch references;
* ``projection``: ``LoRAProjection``, the record each op takes, with its precision rules
  and input checks;
* ``gemms``: one projection's GEMMs, forward and backward, and their derivation;
* ``attention``, ``gated_mlp``: the autograd Functions of the attention block's and of
  the gated MLP's projections;
* ``gemv``, ``gemv_group``: the decode-time GEMVs of one projection and of several of
  one input (``lora_gemv``, ``lora_gemv_group``).
"""

from slothkit_kernels.lora.gemv import lora_gemv, lora_gemv_reference
from slothkit_kernels.lora.gemv_group import lora_gemv_group, lora_gemv_group_reference
from slothkit_kernels.lora.ops import (
    lora_linear,
    lora_linear_reference,
    lora_mlp,
    lora_mlp_reference,
    lora_o,
    lora_o_residual,
    lora_qkv,
    lora_qkv_reference,
    lora_qkv_rope,
)
from slothkit_kernels.lora.projection import LoRAProjection

__all__ = [
    "LoRAProjection",
    "lora_gemv",
    "lora_gemv_group",
    "lora_gemv_group_reference",
    "lora_gemv_reference",
    "lora_linear",
    "lora_linear_reference",
    "lora_mlp",
    "lora_mlp_reference",
    "lora_o",
    "lora_o_residual",
    "lora_qkv",
    "lora_qkv_reference",
    "lora_qkv_rope",
]
