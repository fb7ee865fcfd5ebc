"""What slothkit knows of mixture-of-experts expert modules, as data.

transformers 5 holds the experts of a mixture-of-experts layer (Qwen3-MoE, Qwen3.5-MoE,
gpt-oss, Mixtral, Gemma 4, ...) as one module with 3-D parameters, `gate_up_proj`
(experts, 2 x intermediate, hidden) and `down_proj` (experts, hidden, intermediate), or
the transposes of both, and states their layout on the instance
(`use_experts_implementation`: is_transposed, is_concatenated, has_bias, has_gate). What
it does not state is the activation between the two products: its own `_apply_gate`, by
default `act_fn(gate) * up`. slothkit's fused experts (slothkit.engine.experts) compute
the activations named here and leave any other experts module to its own forward.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ExpertGate:
    """An experts module's activation, by slothkit_kernels.moe's name, and where its
    parameters live on the module."""

    activation: str  # "swiglu": silu(gate) * up; "gpt_oss": the clamped SwiGLU of gpt-oss;
    # "geglu_tanh": gelu_tanh(gate) * up (Gemma 4)
    alpha_attribute: str | None = None  # the sigmoid's slope (gpt-oss: alpha, 1.702)
    limit_attribute: str | None = None  # the clamp on gate and up (gpt-oss: limit, 7.0)


# Experts classes with a gate of their own (`_apply_gate` overridden), by class name.
# gpt-oss: gate = min(gate, limit), up = clamp(up, -limit, limit),
# out = (up + 1) * gate * sigmoid(alpha * gate), gate and up interleaved by column.
OWN_GATES = {
    "GptOssExperts": ExpertGate("gpt_oss", alpha_attribute="alpha", limit_attribute="limit"),
}

# transformers' default gate, act_fn(gate) * up, by the class of act_fn.  GELUTanh is
# ACT2FN["gelu_pytorch_tanh"] (Gemma 4's experts: 26B-A4B), PytorchGELUTanh its older name.
DEFAULT_GATES = {
    "SiLUActivation": ExpertGate("swiglu"),
    "SiLU": ExpertGate("swiglu"),
    "GELUTanh": ExpertGate("geglu_tanh"),
    "PytorchGELUTanh": ExpertGate("geglu_tanh"),
}
