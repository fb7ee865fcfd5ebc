"""Mixture-of-experts layers through slothkit's fused experts (slothkit_kernels.moe).

transformers 5's mixture-of-experts blocks route each token themselves (their router
module, whose logits also feed the auxiliary loss) and then call their experts module as
``experts(hidden_states, top_k_index, top_k_weights)``. slothkit leaves the router alone
and replaces what that call computes, on the instance: every expert's gate/up product,
activation and down product for its tokens, weighted and summed, with the LoRA adapters
of every expert inside the same grouped products instead of PEFT's way of adding each
expert's B A to its weight before every call.

PEFT adapts the experts' 3-D parameters through ``target_parameters``: it wraps the
experts module in one ``ParamWrapper`` per adapted parameter, nested. Which module the
block calls therefore changes when PEFT wraps it, so the fused forward is bound to the
experts module at loading and again to the outermost wrapper after ``get_peft_model``
(``patch_experts`` is idempotent). At every call the chain is read afresh, as
slothkit.engine.lora_projection reads a LoRA linear layer (adapters can be switched off,
merged or swapped between calls); what the fused experts do not compute runs the
module's own forward, said once with the reason.

In a model loaded in 4 bits the experts' weights are quantised to NF4 where they are fused
(slothkit.engine.experts_nf4): then only the fused experts can read them, and a call they
cannot compute is refused with the reason instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from slothkit.core.inspection import is_4bit_model
from slothkit.core.model_state import patched_module
from slothkit.core.notices import FallbackWarning, say_once
from slothkit.engine.checkpointing.recomputation import keep_group, keeping, recomputing, take_kept_group
from slothkit.engine.decoder import bind_forward
from slothkit.engine.experts_nf4 import (
    has_nf4_experts,
    nf4_expert_bytes,
    nf4_experts_of,
    quantize_expert_parameters,
    say_quantized,
)
from slothkit.models.experts import DEFAULT_GATES, OWN_GATES, ExpertGate
from slothkit_kernels.moe import (
    ExpertLoRA,
    ExpertsForward,
    NF4Experts,
    moe_lora_experts,
    moe_lora_experts_forward,
)

# The experts' parameters slothkit reads, by their name on transformers' modules.
GATE_UP, DOWN = "gate_up_proj", "down_proj"
# The name under which a checkpointed layer keeps its experts' forward for the re-run.
KEPT_PREFIX = "experts."


@dataclass(frozen=True)
class ExpertsCall:
    """What one call of an experts module computes, as slothkit_kernels.moe takes it."""

    gate_up: torch.Tensor | NF4Experts  # (E, 2I, H), or (E, H, 2I) with weights_in_out
    down: torch.Tensor | NF4Experts  # (E, H, I), or (E, I, H) with weights_in_out
    weights_in_out: bool  # transformers' is_transposed: y = x @ W_e rather than x @ W_e^T
    interleaved: bool  # gate and up alternate by column (not is_concatenated: gpt-oss)
    gate_up_bias: torch.Tensor | None
    down_bias: torch.Tensor | None
    gate: ExpertGate
    alpha: float
    limit: float
    gate_up_lora: ExpertLoRA | None
    down_lora: ExpertLoRA | None


def experts_base(module: nn.Module) -> tuple[nn.Module, list[nn.Module]]:
    """(the experts module, PEFT's wrappers around it, outermost first)."""
    wrappers = []
    while hasattr(module, "base_layer") and hasattr(module, "parameter_name"):
        wrappers.append(module)
        module = module.base_layer
    return module, wrappers


def is_experts_module(module: nn.Module) -> bool:
    """transformers 5's experts module: gate_up_proj and down_proj as 3-D parameters."""
    gate_up, down = getattr(module, GATE_UP, None), getattr(module, DOWN, None)
    return (
        isinstance(gate_up, torch.Tensor)
        and isinstance(down, torch.Tensor)
        and gate_up.dim() == down.dim() == 3
    )


def expert_gate(experts: nn.Module) -> ExpertGate | str:
    """The experts module's activation, or why the fused experts do not compute it."""
    own = OWN_GATES.get(type(experts).__name__)
    if own is not None:
        return own
    from transformers.integrations import moe

    if getattr(type(experts), "_apply_gate", None) is not getattr(moe, "_default_apply_gate", None):
        return f"{type(experts).__name__} computes its own activation between the products"
    act = type(getattr(experts, "act_fn", None)).__name__
    gate = DEFAULT_GATES.get(act)
    if gate is None:
        return (
            f"its activation {act} is not one the fused experts compute ({', '.join(sorted(DEFAULT_GATES))})"
        )
    return gate


def _expert_lora(wrapper: nn.Module, in_features: int, out_features: int) -> ExpertLoRA | str | None:
    """One ParamWrapper's adapter as per-expert (A, B) views, None if it adds nothing now,
    or why the fused experts cannot apply it.

    PEFT keeps the adapter of E experts as one lora_A (E r, in) and one lora_B (out, r E):
    expert e's update is s B[:, :, e] A[e] with A viewed (E, r, in) and B (out, r, E)."""
    if getattr(wrapper, "merged", False) or getattr(wrapper, "disable_adapters", False):
        return None  # merged: the parameter holds the update; disabled: the base alone
    active = [name for name in wrapper.active_adapters if name in wrapper.lora_A]
    if not active:
        return None
    if len(active) > 1:
        return f"{len(active)} adapters are active at once on experts.{wrapper.parameter_name}"
    name = active[0]
    a, b = wrapper.lora_A[name], wrapper.lora_B[name]
    if b.bias is not None:
        return f"the LoRA B of experts.{wrapper.parameter_name} has a bias"
    if (wrapper.in_features, wrapper.out_features) != (in_features, out_features):
        return (
            f"PEFT reads experts.{wrapper.parameter_name} as {wrapper.in_features} -> "
            f"{wrapper.out_features} features, not {in_features} -> {out_features}"
        )
    experts, rank = wrapper.num_experts, wrapper.r[name]
    return ExpertLoRA(
        a.weight.view(experts, rank, in_features),
        b.weight.view(out_features, rank, experts).permute(2, 0, 1),
        float(wrapper.scaling[name]),
    )


def describe_experts(module: nn.Module) -> ExpertsCall | str:
    """``module`` (an experts module, or PEFT's wrappers of one) as one ExpertsCall, or why
    the fused experts cannot compute it."""
    experts, wrappers = experts_base(module)
    if not is_experts_module(experts):
        return f"{type(experts).__name__} holds no 3-D gate_up_proj and down_proj"
    if not getattr(experts, "has_gate", True) or getattr(experts, "has_post_expert_norm", False):
        return f"{type(experts).__name__} has no gate, or a norm after each expert"
    gate = expert_gate(experts)
    if isinstance(gate, str):
        return gate
    gate_up, down = getattr(experts, GATE_UP), getattr(experts, DOWN)
    gate_up, down = nf4_experts_of(gate_up) or gate_up, nf4_experts_of(down) or down
    if gate_up.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"the experts' weights are {gate_up.dtype}, not 16- or 32-bit floats"
    if torch.is_grad_enabled() and any(getattr(w, "requires_grad", False) for w in (gate_up, down)):
        return "the experts' base weights are trainable (the fused experts assume a frozen base)"
    weights_in_out = bool(getattr(experts, "is_transposed", False))
    hidden, widths = (
        (gate_up.shape[1], gate_up.shape[2]) if weights_in_out else (gate_up.shape[2], gate_up.shape[1])
    )
    features = {GATE_UP: (hidden, widths), DOWN: (widths // 2, hidden)}
    adapters = {GATE_UP: None, DOWN: None}
    for wrapper in wrappers:
        if wrapper.parameter_name not in adapters:
            return f"PEFT adapts experts.{wrapper.parameter_name}, which the fused experts do not read"
        lora = _expert_lora(wrapper, *features[wrapper.parameter_name])
        if isinstance(lora, str):
            return lora
        adapters[wrapper.parameter_name] = lora
    has_bias = getattr(experts, "has_bias", False)
    return ExpertsCall(
        gate_up=gate_up,
        down=down,
        weights_in_out=weights_in_out,
        interleaved=not getattr(experts, "is_concatenated", True),
        gate_up_bias=getattr(experts, "gate_up_proj_bias", None) if has_bias else None,
        down_bias=getattr(experts, "down_proj_bias", None) if has_bias else None,
        gate=gate,
        alpha=float(getattr(experts, gate.alpha_attribute)) if gate.alpha_attribute else 1.0,
        limit=float(getattr(experts, gate.limit_attribute)) if gate.limit_attribute else float("inf"),
        gate_up_lora=adapters[GATE_UP],
        down_lora=adapters[DOWN],
    )


def _experts_forward(self, hidden_states, top_k_index=None, top_k_weights=None, *args, **kwargs):
    call = describe_experts(self) if top_k_index is not None and not args and not kwargs else None
    if not isinstance(call, ExpertsCall):
        if has_nf4_experts(experts_base(self)[0], (GATE_UP, DOWN)):
            reason = (
                call or "it is called with other arguments than (hidden_states, top_k_index, top_k_weights)"
            )
            raise ValueError(
                f"slothkit: this mixture-of-experts layer's experts were quantised to 4 bits (NF4) at "
                f"loading, which only slothkit's fused experts read, and they cannot compute this "
                f"call: {reason}. Load with load_in_4bit=False to run it otherwise"
            )
        if call is not None:
            say_once(
                f"slothkit: a mixture-of-experts layer runs its own experts module: {call}", FallbackWarning
            )
        return patched_module(self).original_forward(
            hidden_states, top_k_index, top_k_weights, *args, **kwargs
        )
    inputs = (hidden_states, top_k_index, top_k_weights, call.gate_up, call.down)
    options = dict(
        gate_up_lora=call.gate_up_lora,
        down_lora=call.down_lora,
        gate_up_bias=call.gate_up_bias,
        down_bias=call.down_bias,
        weights_in_out=call.weights_in_out,
        activation=call.gate.activation,
        interleaved=call.interleaved,
        alpha=call.alpha,
        limit=call.limit,
    )
    # A checkpointed layer's forward keeps what the experts computed (their output, the
    # gate/up products and the adapters' x A^T, the routing), and its re-run in backward
    # takes it instead of running the products again: a third of the experts' GEMM work
    # per step, for M (2 I + 2 r) + T H elements more per layer in the checkpointer's
    # (pinned host) memory.
    if recomputing():
        done = take_kept_group(KEPT_PREFIX)
        if done is not None:
            return moe_lora_experts(*inputs, forward=ExpertsForward.from_tensors(done), **options)
    elif keeping() and not torch.is_grad_enabled():
        out, done = moe_lora_experts_forward(*inputs, **options)
        if done is not None:
            keep_group(KEPT_PREFIX, done.tensors())
        return out
    return moe_lora_experts(*inputs, **options)


def experts_modules(model: nn.Module) -> list[nn.Module]:
    """The module each mixture-of-experts block calls as its experts: the experts module,
    or PEFT's outermost wrapper of it."""
    found = []
    for parent in model.modules():
        child = getattr(parent, "experts", None)
        if isinstance(child, nn.Module) and is_experts_module(experts_base(child)[0]):
            found.append(child)
    return found


def patch_experts(model: nn.Module) -> int:
    """Bind the fused experts forward onto the module each expert block calls (once per
    module); the number of blocks whose experts it computes.  In a 4-bit model the experts
    the fused forward computes get their weights quantised to NF4 (experts_nf4)."""
    blocks = experts_modules(model)
    for module in blocks:
        if patched_module(module) is None:
            bind_forward(module, _experts_forward)
    if is_4bit_model(model):
        _quantize_fused_experts(blocks)
    return len(blocks)


def _quantize_fused_experts(blocks: list[nn.Module]) -> None:
    """Quantise the weights of the experts modules the fused experts compute (those
    quantised while loading are left), said once with the bytes of all of them.  Judged
    without grad: at loading the parameters still require it, which PEFT turns off."""
    quantized, before, after = 0, 0, 0
    for module in blocks:
        with torch.no_grad():
            call = describe_experts(module)
        if not isinstance(call, ExpertsCall):
            continue
        experts = experts_base(module)[0]
        quantize_expert_parameters(experts, (GATE_UP, DOWN))
        took, takes = nf4_expert_bytes(experts, (GATE_UP, DOWN))
        quantized, before, after = quantized + (took > 0), before + took, after + takes
    if quantized:
        say_quantized(quantized, before, after)


def has_fused_experts(model: nn.Module) -> bool:
    """Whether patch_experts ran on ``model``: some experts module computes through it."""
    return any(patched_module(experts_base(m)[0]) is not None for m in experts_modules(model))
