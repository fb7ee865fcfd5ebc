"""slothkit_kernels: fused Triton kernels with hand-derived backward passes.

Needs only torch and triton and knows nothing of models.  Each op runs its
Triton kernel on CUDA tensors (and on CPU tensors under ``TRITON_INTERPRET=1``)
and its plain-torch reference, named ``<op>_reference``, elsewhere.
"""

import sys as _sys

if __name__ == "kernels":
    # This folder was imported as a top-level `kernels`: Python started in the repository
    # root (`python -m ...`, `python -c ...`, pytest-xdist's workers put it first on
    # sys.path), where the folder shadows Hugging Face's `kernels` package, which
    # transformers imports when it is installed (transformers 5.25 depends on it). Hand the
    # import over to that package: the module left in sys.modules is what `import kernels`
    # returns. Where it is not installed, this module stays, as transformers 5.24 expects
    # of a `kernels` that find_spec found.
    import importlib as _importlib
    import os as _os

    _this = _sys.modules["kernels"]
    _root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    _path = _sys.path[:]
    _sys.path[:] = [entry for entry in _path if _os.path.abspath(entry or _os.curdir) != _root]
    del _sys.modules["kernels"]
    try:
        _sys.modules["kernels"] = _importlib.import_module("kernels")
    except ModuleNotFoundError as _missing:
        if _missing.name != "kernels":
            raise
        _sys.modules["kernels"] = _this
    finally:
        _sys.path[:] = _path

from slothkit_kernels.attention import attention, attention_reference
from slothkit_kernels.cross_entropy import cross_entropy, cross_entropy_reference
from slothkit_kernels.fused_linear_cross_entropy import (
    fused_linear_cross_entropy,
    fused_linear_cross_entropy_reference,
)
from slothkit_kernels.geglu import geglu, geglu_reference
from slothkit_kernels.lora import (
    lora_linear,
    lora_mlp,
    lora_mlp_reference,
    lora_o,
    lora_o_residual,
    lora_qkv,
    lora_qkv_reference,
    lora_qkv_rope,
)
from slothkit_kernels.lora_gemv import lora_gemv, lora_gemv_reference
from slothkit_kernels.lora_gemv_group import lora_gemv_group, lora_gemv_group_reference
from slothkit_kernels.lora_projection import LoRAProjection
from slothkit_kernels.moe import ExpertLoRA, moe_lora_experts, moe_lora_experts_reference
from slothkit_kernels.nf4 import dequantize_nf4, dequantize_nf4_reference
from slothkit_kernels.nf4_gemv import nf4_lora_gemv, nf4_lora_gemv_reference
from slothkit_kernels.nf4_gemv_group import nf4_lora_gemv_group, nf4_lora_gemv_group_reference
from slothkit_kernels.nf4_weight import NF4Weight
from slothkit_kernels.rms_norm import rms_norm, rms_norm_reference
from slothkit_kernels.rope import rope, rope_reference, rotate
from slothkit_kernels.rope_cache import rope_into_cache, rope_into_cache_reference
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
