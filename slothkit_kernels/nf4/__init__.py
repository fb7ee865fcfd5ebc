"""bitsandbytes NF4 weights (QLoRA's frozen base weights): the record, its dequantisation
and the decode GEMVs that read it without dequantising.

* ``weight``: ``NF4Weight``, the format as plain tensors;
* ``dequantize``: ``dequantize_nf4`` and its reference;
* ``gemv``, ``gemv_group``: ``nf4_lora_gemv`` and ``nf4_lora_gemv_group``, the decode
  GEMVs of one projection and of several of one input, and their CUDA-core kernel;
* ``gemv_mma``: their tensor-core kernel;
* ``scales``, ``level_lookup``: a block's scale and a code's level inside a kernel.
"""

from slothkit_kernels.nf4.dequantize import dequantize_nf4, dequantize_nf4_reference
from slothkit_kernels.nf4.gemv import nf4_lora_gemv, nf4_lora_gemv_reference
from slothkit_kernels.nf4.gemv_group import nf4_lora_gemv_group, nf4_lora_gemv_group_reference
from slothkit_kernels.nf4.weight import NF4Weight

__all__ = [
    "NF4Weight",
    "dequantize_nf4",
    "dequantize_nf4_reference",
    "nf4_lora_gemv",
    "nf4_lora_gemv_group",
    "nf4_lora_gemv_group_reference",
    "nf4_lora_gemv_reference",
]
