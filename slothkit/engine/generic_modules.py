"""The RMSNorms and gated MLPs of a model whose decoder layers stay its own, fused one
module at a time where each computes what the kernel does, checked at loading.

slothkit.engine.generic_layers fuses a record-less model's layers whole, or not at all:
OLMo 2 (norms on the attention's and the MLP's outputs), SmolLM3 (a quarter of its layers
without RoPE), Gemma 4 (four norms a layer, per-layer inputs) and Qwen3.5 (gated DeltaNet
layers) keep their Hugging Face layers. Most of what those layers run is still two kinds
of module the kernels compute: an RMSNorm (``x / rms(x) * w`` or ``* (1 + w)``) and a
gated MLP (``down(act(gate(x)) * up(x))``). Each such module is recognised by what it
computes, not by its class:

- a norm with a 1-D weight, no bias and an epsilon, whose forward takes the input alone,
  and whose output on a random input is the RMSNorm's with weight or with 1 + weight
  (generic_layers' ``_norm_adds_one``);
- a module with gate_proj, up_proj and down_proj and an activation the fused MLP computes,
  whose output in float32, with small random projections scaled so that the gate's
  outputs are of order one (at a tiny checkpoint's small weights SiLU and GELU are both
  nearly x / 2), equals the fused MLP's.

Then, in the model's own dtype and weights, every patched module's output on one short
random batch is compared with its own forward's, each given the same input (the first
run's, so that a rounding before a mixture-of-experts router cannot flip its choice and
move what follows); any difference beyond the dtype's rounding, or an error (a norm called
with a gate, say), undoes every patch made here. The layers' own forward calls the patched
modules, so the MLP never skips its down projection in a checkpoint's re-run (something,
OLMo 2's post_feedforward_layernorm, may read its output).
"""

from __future__ import annotations

import copy
import inspect

import torch
from torch import nn

from slothkit.core.model_state import patched_module
from slothkit.engine.decoder import patch_mlp, patch_rms_norm
from slothkit.engine.generic_layers import (
    CHECK_TOKENS,
    MLP_PROJECTIONS,
    _activation,
    _is_dense,
    _is_rms_norm,
    _norm_adds_one,
    _unpatch,
    largest_difference,
    relative_tolerance,
)


def _takes_input_alone(module: nn.Module) -> bool:
    """Whether ``module.forward`` has one parameter (a gated norm's takes the gate too)."""
    try:
        parameters = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return False
    return len(parameters) == 1 and all(p.kind is p.POSITIONAL_OR_KEYWORD for p in parameters)


def _norm_flavour(norm: nn.Module) -> bool | None:
    """1 + weight (True), weight (False), or None where ``norm`` is no RMSNorm the kernel
    computes."""
    if not (_is_rms_norm(norm) and _takes_input_alone(norm)) or patched_module(norm) is not None:
        return None
    try:
        return _norm_adds_one(norm)
    except (TypeError, RuntimeError, ValueError):
        return None


# The check's widths: what the MLP computes does not depend on them, and small random
# projections keep it free of the model's size (no copy of a 4096 x 11008 matrix).
CHECK_WIDTH, CHECK_INTERMEDIATE = 64, 48


def mlp_difference(mlp: nn.Module, activation: str) -> float:
    """The relative difference between ``mlp`` and the fused MLP, in float32 on a copy whose
    projections are small random ones (gate and up scaled to outputs of order one). A
    forward tied to the model's widths fails on the copy, and the MLP keeps its own."""
    generator = torch.Generator(device="cpu").manual_seed(2)
    device = mlp.down_proj.weight.device
    projections = {name: getattr(mlp, name) for name in MLP_PROJECTIONS}
    own = copy.deepcopy(mlp, memo={id(m): None for m in projections.values()})
    shapes = {
        "gate_proj": (CHECK_INTERMEDIATE, CHECK_WIDTH),
        "up_proj": (CHECK_INTERMEDIATE, CHECK_WIDTH),
        "down_proj": (CHECK_WIDTH, CHECK_INTERMEDIATE),
    }
    for name, (rows, columns) in shapes.items():
        linear = nn.Linear(columns, rows, bias=False, device="meta")
        weight = torch.randn(rows, columns, generator=generator) / columns**0.5
        linear.weight = nn.Parameter(weight.to(device), requires_grad=False)
        setattr(own, name, linear)
    own.float()
    x = torch.randn(1, CHECK_TOKENS, CHECK_WIDTH, generator=generator).to(device)
    with torch.no_grad():
        expected = own(x)
        patch_mlp(own, activation, output_unread_in_recompute=False)
        fused = own(x)
    return largest_difference([fused], [expected])


def _candidates(causal_lm: nn.Module) -> list[tuple[nn.Module, object]]:
    """(module, patch) for each RMSNorm and gated MLP in the decoder that computes what the
    kernels do, by the checks above."""
    patches = []
    for module in causal_lm.model.modules():
        if patched_module(module) is not None:
            continue
        if _is_dense(module) and getattr(module, "act_fn", None) is not None:
            activation = _activation(module)
            if activation is None:
                continue
            try:
                difference = mlp_difference(module, activation)
            except (TypeError, AttributeError, ValueError, RuntimeError):
                continue
            if difference <= relative_tolerance(torch.float32):
                patches.append(
                    (module, lambda m, a=activation: patch_mlp(m, a, output_unread_in_recompute=False))
                )
            continue
        adds_one = _norm_flavour(module)
        if adds_one is not None:
            patches.append((module, lambda m, a=adds_one: patch_rms_norm(m, a)))
    return patches


def _outputs(causal_lm: nn.Module, modules: list[nn.Module], ids: torch.Tensor, inputs: list | None):
    """Each of ``modules``' outputs on one forward of ``ids`` (float32 copies), and its
    inputs; with ``inputs`` (an earlier run's) each module is handed those instead."""
    outputs, seen = {}, {}

    def hand_earlier(module, args):
        key = id(module)
        seen.setdefault(key, args[0].detach())
        if inputs is not None:
            return (inputs[key], *args[1:])
        return None

    def record(module, args, output):
        outputs.setdefault(id(module), (output[0] if isinstance(output, tuple) else output).detach().float())

    hooks = []
    for module in modules:
        hooks.append(module.register_forward_pre_hook(hand_earlier))
        hooks.append(module.register_forward_hook(record))
    try:
        with torch.no_grad():
            causal_lm.model(input_ids=ids)
    finally:
        for hook in hooks:
            hook.remove()
    return [outputs.get(id(m)) for m in modules], seen


def fuse_generic_modules(causal_lm: nn.Module) -> tuple[int, int, str | None]:
    """Patch the fused RMSNorm and gated MLP onto each module of ``causal_lm`` that
    computes them (module docstring). Returns (norms, MLPs) patched and, where the
    model-level check undid them all, why."""
    patches = _candidates(causal_lm)
    if not patches:
        return 0, 0, None
    modules = [module for module, _ in patches]
    embeddings = causal_lm.get_input_embeddings()
    generator = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, embeddings.weight.shape[0], (1, CHECK_TOKENS), generator=generator)
    ids = ids.to(embeddings.weight.device)
    dtype = embeddings.weight.dtype
    was_training = causal_lm.training
    causal_lm.eval()
    patched = []
    try:
        own, inputs = _outputs(causal_lm, modules, ids, None)
        for module, patch in patches:
            patch(module)
            patched.append(module)
        fused, _ = _outputs(causal_lm, modules, ids, inputs)
    except (TypeError, AttributeError, ValueError, RuntimeError, IndexError, KeyError) as error:
        _unpatch(patched)
        return (
            0,
            0,
            f"its norms and MLPs could not be checked against the fused ones ({type(error).__name__}: {error})",
        )
    finally:
        causal_lm.train(was_training)
    # A module the batch did not reach (a layer skipped by the forward) cannot be judged.
    pairs = [(f, o) for f, o in zip(fused, own) if f is not None and o is not None]
    unreached = len(pairs) != len(modules)
    difference = largest_difference([f for f, _ in pairs], [o for _, o in pairs]) if pairs else 0.0
    if unreached or not difference <= relative_tolerance(dtype):  # a NaN fails too
        _unpatch(patched)
        why = (
            "a module the check's batch did not reach"
            if unreached
            else f"an output differs by {difference:.2g}"
        )
        return 0, 0, f"its norms and MLPs compute something else than the fused ones ({why}, relative)"
    mlps = sum(1 for module in modules if _is_dense(module))
    return len(modules) - mlps, mlps, None
