"""4-bit experts: a 4-bit model's expert weights quantised to NF4 where slothkit fuses them.

bitsandbytes quantises nn.Linear layers only, so a model loaded with load_in_4bit=True
keeps its experts' 3-D parameters (gate_up_proj, down_proj) in 16 bits: most of a
mixture-of-experts model's weights.  Where slothkit's fused experts compute an experts
module (slothkit.engine.experts), it quantises those two parameters to
slothkit_kernels.moe.NF4Experts (bitsandbytes' NF4 with double-quantised scales, per
expert), on the parameter's device, one expert at a time, and the fused experts read the
4-bit codes inside their GEMMs.  About 4.13 bits per weight remain of 16.  FastModel
quantises each parameter as transformers loads it (slothkit.engine.experts_loading), so
at most one layer's experts are ever in 16 bits; a model quantised otherwise gets its
experts quantised when the fused experts are bound.

The parameter stays on the module, for what reads its shape, dtype and device (PEFT's
target_parameters wrappers among them), as a frozen placeholder of that shape whose every
element is one stored zero (a stride-0 view), with the record as its ``nf4_experts``
attribute, as a bitsandbytes Params4bit carries its quant_state.  Nothing but the fused
experts reads the values: the module's own forward cannot, so where the fused experts
cannot compute a call it is refused (slothkit.engine.experts), and a merge into the
model's own weights is refused (slothkit.export.merge).  The record is not moved by
``module.to()``; a 4-bit model stays on the device it was loaded to.
"""

from __future__ import annotations

import torch
from torch import nn

from slothkit.core.inspection import nf4_experts_of
from slothkit.core.notices import SettingChangedWarning, say_once
from slothkit_kernels.moe import NF4Experts, quantize_nf4_experts


def has_nf4_experts(experts: nn.Module, names: tuple[str, ...]) -> bool:
    """Whether any of the experts module's parameters ``names`` is quantised."""
    return any(nf4_experts_of(getattr(experts, name, None)) is not None for name in names)


def _placeholder(weight: torch.Tensor, record: NF4Experts) -> nn.Parameter:
    """A frozen parameter of ``weight``'s shape, dtype and device holding one element."""
    zero = torch.zeros((), dtype=weight.dtype, device=weight.device)
    placeholder = nn.Parameter(zero.expand(weight.shape), requires_grad=False)
    placeholder.nf4_experts = record  # read through slothkit.core.inspection.nf4_experts_of
    return placeholder


def nf4_placeholder(weight: torch.Tensor) -> nn.Parameter:
    """The frozen placeholder standing for ``weight`` (E, rows, cols) quantised to NF4;
    ``weight`` itself is left to the caller to drop."""
    with torch.no_grad():
        return _placeholder(weight, quantize_nf4_experts(weight.detach()))


def quantize_expert_parameters(experts: nn.Module, names: tuple[str, ...]) -> int:
    """Quantise the experts module's 3-D parameters ``names`` to NF4 in place (each freed
    once its record is made); how many it quantised (those already quantised are left)."""
    quantized = 0
    for name in names:
        weight = getattr(experts, name)
        if nf4_experts_of(weight) is not None:
            continue
        setattr(experts, name, nf4_placeholder(weight))
        del weight
        quantized += 1
    return quantized


def nf4_expert_bytes(experts: nn.Module, names: tuple[str, ...]) -> tuple[int, int]:
    """(bytes the quantised parameters among ``names`` took in their dtype, bytes their
    NF4 records take); (0, 0) where none is quantised."""
    before = after = 0
    for name in names:
        weight = getattr(experts, name, None)
        record = nf4_experts_of(weight)
        if record is not None:
            before += weight.numel() * weight.element_size()
            after += record.nbytes()
    return before, after


def _size(count: int) -> str:
    return f"{count / 2**30:.2f} GiB" if count >= 2**30 else f"{count / 2**20:.2f} MiB"


def say_quantized(blocks: int, before: int, after: int) -> None:
    """The notice of quantised experts, with the bytes they took and take."""
    say_once(
        f"slothkit: the model is loaded in 4 bits, but bitsandbytes leaves mixture-of-experts "
        f"weights alone; slothkit quantised the experts of {blocks} layers to NF4 "
        f"(bitsandbytes' 4-bit format, double-quantised scales): their weights took "
        f"{_size(before)} ({before} bytes) and take {_size(after)} ({after} bytes). Only the fused "
        f"experts read them; to save a merged model, load with load_in_4bit=False",
        SettingChangedWarning,
    )
