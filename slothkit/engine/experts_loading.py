"""Mixture-of-experts weights quantised to NF4 as transformers loads them.

bitsandbytes quantises a 4-bit model's nn.Linear layers while transformers loads it, but
not the experts' 3-D parameters (gate_up_proj, down_proj), which slothkit quantises
where its fused experts compute them (slothkit.engine.experts_nf4).  Quantised only after
loading, every layer's experts would first be on the device in 16 bits at once: about
54 GiB for Qwen3-30B-A3B, whose NF4 records take about 14.

transformers 5 loads a checkpoint one model parameter at a time: it reads that
parameter's tensors (for a fused experts parameter, every expert's slices, stacked and
concatenated by its weight converter), puts the result on the parameter's device and sets
it on its module with ``setattr``, which registers it through ``nn.Module.register_parameter``;
the next parameter is read only after that (on-the-fly quantisation makes it load
synchronously).  While ``quantized_experts_while_loading`` is open, a parameter
registration hook of torch's (``register_module_parameter_registration_hook``) catches each
experts parameter as it is registered and registers its NF4 placeholder in its place, so
the 16-bit tensor is dropped as soon as transformers lets go of it: at most one layer's
experts are in 16 bits at any time.  The hook acts only in the thread that opened it,
only on experts modules whose calls the fused experts compute, and only on parameters
on a device it is told the fused experts run on; every other parameter registers as it
would.  The hook is removed when the block closes.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import torch
from torch import nn

from slothkit.core.inspection import nf4_experts_of
from slothkit.core.notices import FallbackWarning, say_once
from slothkit.engine.experts import (
    DOWN,
    GATE_UP,
    ExpertsCall,
    describe_experts,
    experts_base,
    experts_modules,
    has_fused_experts,
    is_experts_module,
    patch_experts,
)
from slothkit.engine.experts_nf4 import nf4_placeholder

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


class ExpertsQuantizedWhileLoading:
    """What the hook did: the placeholders it registered, by id (kept alive here so the
    ids stay theirs)."""

    def __init__(self) -> None:
        self.placeholders: dict[int, nn.Parameter] = {}

    def made(self, placeholder: nn.Parameter) -> bool:
        return id(placeholder) in self.placeholders

    def left_for_later(self, experts_modules: list[nn.Module]) -> int:
        """How many of these experts modules hold NF4 parameters the hook did not make:
        quantised after loading, in 16 bits on the device until then."""
        return sum(
            any(
                nf4_experts_of(getattr(module, name)) is not None and not self.made(getattr(module, name))
                for name in (GATE_UP, DOWN)
            )
            for module in experts_modules
        )


def _quantizable(module: nn.Module, name: str, param: torch.Tensor) -> bool:
    """Whether ``param``, about to be registered as ``module.name``, is a loaded experts
    weight the fused experts compute: a float tensor on a real device, of the shape the
    module declares."""
    if name not in (GATE_UP, DOWN) or param.device.type == "meta" or param.dtype not in _FLOATS:
        return False
    if nf4_experts_of(param) is not None or not is_experts_module(module):
        return False
    if tuple(param.shape) != tuple(getattr(module, name).shape):
        return False
    with torch.no_grad():  # loaded parameters require grad until PEFT freezes them
        return isinstance(describe_experts(module), ExpertsCall)


@contextlib.contextmanager
def quantized_experts_while_loading(
    runs_fused_on: Callable[[torch.device], bool],
) -> Iterator[ExpertsQuantizedWhileLoading]:
    """Within the block, experts parameters registered on a device where
    ``runs_fused_on(device)`` are registered as their NF4 placeholders instead; yields
    what it did."""
    done = ExpertsQuantizedWhileLoading()
    owner = threading.get_ident()

    def hook(module: nn.Module, name: str, param: torch.Tensor):
        if threading.get_ident() != owner or not _quantizable(module, name, param):
            return None
        if not runs_fused_on(param.device):
            return None
        placeholder = nf4_placeholder(param)
        # transformers marks what it loaded, so that it does not initialise it afterwards.
        if hasattr(param, "_is_hf_initialized"):
            placeholder._is_hf_initialized = param._is_hf_initialized
        done.placeholders[id(placeholder)] = placeholder
        return placeholder

    handle = torch.nn.modules.module.register_module_parameter_registration_hook(hook)
    try:
        yield done
    finally:
        handle.remove()


def settle_loaded_experts(done: ExpertsQuantizedWhileLoading, causal_lm: nn.Module) -> None:
    """After the fused path was patched onto a model loaded within
    ``quantized_experts_while_loading``: experts quantised at loading are computed by the
    fused experts (bound here if the patching left them: nothing else reads NF4), and
    experts that loaded in 16 bits and were quantised afterwards are said once as a
    fallback."""
    if done.placeholders and not has_fused_experts(causal_lm):
        patch_experts(causal_lm)
    later = done.left_for_later([experts_base(module)[0] for module in experts_modules(causal_lm)])
    if later:
        say_once(
            f"slothkit: the experts of {later} mixture-of-experts layers loaded in 16 bits and were "
            f"quantised to NF4 after loading (this transformers did not register them one at a time "
            f"as slothkit quantises them), so loading held them all on the device in 16 bits at once",
            FallbackWarning,
        )
