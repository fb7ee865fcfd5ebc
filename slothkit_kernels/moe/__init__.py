"""Mixture-of-experts expert blocks with per-expert LoRA adapters, dropless, in Triton.

One file per concept: ``routing`` (sort by expert, the tile schedule), ``grouped_gemm``
(each expert's projection with its adapter fused), ``activation`` (the gated
activations and their backward), ``combine`` (sorted rows back to tokens),
``expert_sums`` (the adapters' per-expert gradients), ``lora`` (the adapter record) and
``experts`` (the autograd Function and the public op, with the derivation, and
``moe_lora_experts_forward``: a forward to hand to a later call on the same inputs); ``grouped_mm``
(the same grouped GEMMs through torch._grouped_mm, chosen by its ``set_backend``); ``gemv``
(``expert_gemv``: a decode step's few tokens, each pair through its chosen expert, reading
only those experts' weights).

4-bit experts: ``nf4_experts`` (``NF4Experts``, E experts' weights each in bitsandbytes'
NF4 with double-quantised scales, and its plain-torch dequantisation), ``nf4_quantize``
(``quantize_nf4_experts``, bitsandbytes' quantisation in plain torch, one expert at a
time) and ``nf4_dequantize`` (a run of experts dequantised in one launch).
``moe_lora_experts`` and ``grouped_lora_gemm`` take an ``NF4Experts`` wherever they take
a base weight, and multiply it a run of experts at a time (at most
``grouped_gemm.NF4_STAGE_BYTES`` dequantised at once), forward and backward: no 16-bit
copy of all the experts is made.
"""

from slothkit_kernels.moe.experts import (
    ExpertsForward,
    moe_lora_experts,
    moe_lora_experts_forward,
    moe_lora_experts_reference,
)
from slothkit_kernels.moe.gemv import expert_gemv, expert_gemv_reference
from slothkit_kernels.moe.grouped_gemm import grouped_lora_gemm, grouped_lora_gemm_reference
from slothkit_kernels.moe.lora import ExpertLoRA
from slothkit_kernels.moe.nf4_dequantize import dequantize_nf4_experts
from slothkit_kernels.moe.nf4_experts import NF4Experts
from slothkit_kernels.moe.nf4_quantize import quantize_nf4_experts
from slothkit_kernels.moe.routing import ExpertRouting, route_to_experts

__all__ = [
    "ExpertLoRA",
    "ExpertRouting",
    "ExpertsForward",
    "NF4Experts",
    "dequantize_nf4_experts",
    "expert_gemv",
    "expert_gemv_reference",
    "grouped_lora_gemm",
    "grouped_lora_gemm_reference",
    "moe_lora_experts",
    "moe_lora_experts_forward",
    "moe_lora_experts_reference",
    "quantize_nf4_experts",
    "route_to_experts",
]
