"""Add LoRA adapters to a loaded model: check the settings against the model, build
PEFT's LoraConfig, and wrap the model in a ``peft.PeftModel``.

    peft_model = add_lora(model, LoraSettings(r=16, target_modules=None), max_seq_length=4096)

FastModel.get_peft_model calls it, then sets the result up to train
(slothkit.loading.training_mode).
"""

from __future__ import annotations

import dataclasses
import warnings

import torch

from slothkit.checkpoint.before_loading import ALL_PROJECTIONS, linear_module_leaves, matching_modules
from slothkit.compat.unsloth_options import embeddings_trained_in_full
from slothkit.core.inspection import causal_lm_of, is_sequence_classifier
from slothkit.core.notices import FallbackWarning, SettingChangedWarning, say_once
from slothkit.engine.experts import has_fused_experts, patch_experts
from slothkit.loading.load_model import set_max_seq_length

ALL_LINEAR = "all-linear"  # PEFT's target_modules value for every linear layer but the head
BIASES = ("none", "all", "lora_only")


@dataclasses.dataclass(frozen=True)
class LoraSettings:
    """get_peft_model's LoRA options, which travel together into ``peft.LoraConfig``
    (its docstring says what each means).

    Attributes:
        r, lora_alpha, lora_dropout, bias, use_rslora, modules_to_save: as LoraConfig.
        target_modules: names of linear layers, one name, "all-linear", or None (all
            seven projections).
        random_state: the seed of the adapters' initialisation.
        extra: further LoraConfig keywords.
    """

    r: int = 16
    target_modules: object = None
    lora_alpha: float = 16
    lora_dropout: float = 0.0
    bias: str = "none"
    random_state: int = 3407
    use_rslora: bool = False
    modules_to_save: object = None
    extra: dict = dataclasses.field(default_factory=dict)


def add_lora(model, settings: LoraSettings, max_seq_length: int | None = None):
    """``model`` wrapped by PEFT with the adapters ``settings`` describe, after checking
    them against the model; with ``max_seq_length``, that set first (set_max_seq_length).

    Raises:
        ValueError: the model is already a PeftModel, or a setting is not accepted (the
            message says what is).
    """
    from peft import PeftModel, get_peft_model

    if isinstance(model, PeftModel):
        raise ValueError("this model already has LoRA adapters (it is a PeftModel)")
    config = lora_config(model, settings)
    if max_seq_length is not None:
        set_max_seq_length(model, max_seq_length)
    torch.manual_seed(settings.random_state)
    with warnings.catch_warnings():
        # PEFT reads transformers' deprecated ``is_gradient_checkpointing``: a
        # FutureWarning between two other libraries that no user of slothkit can act on.
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated")
        peft_model = get_peft_model(model, config)
    if has_fused_experts(model):  # PEFT wrapped the experts: the wrappers compute fused too
        patch_experts(model)
    return peft_model


def lora_config(model, settings: LoraSettings):
    """The ``peft.LoraConfig`` for ``settings`` on ``model``, checked."""
    from peft import LoraConfig

    r = settings.r
    if isinstance(r, bool) or not isinstance(r, int) or r <= 0:  # r=True would be rank 1
        raise ValueError(f"r={r!r}; expected a positive integer rank such as 8, 16 or 32")
    target_modules, modules_to_save = lora_targets(settings.target_modules), settings.modules_to_save
    target_parameters = []
    if target_modules != ALL_LINEAR:
        target_modules, modules_to_save = embeddings_trained_in_full(target_modules, modules_to_save)
        target_modules = onto_fused_projections(model, target_modules)
        target_modules = onto_linear_attention(model, target_modules)
        target_modules, target_parameters = onto_expert_parameters(model, target_modules)
    check_lora_shape(model, target_modules, r, settings.lora_alpha, target_parameters)
    if settings.bias not in BIASES:
        raise ValueError(f"bias={settings.bias!r}; accepted: 'none', 'all', 'lora_only'")
    asked = settings.extra.get("target_parameters")
    if asked:
        _check_target_parameters(model, asked)
    if target_parameters:
        _check_expert_settings(settings)
        settings = dataclasses.replace(
            settings, extra={"target_parameters": target_parameters, **settings.extra}
        )
    return LoraConfig(
        r=r,
        lora_alpha=settings.lora_alpha,
        lora_dropout=settings.lora_dropout,
        bias=settings.bias,
        target_modules=target_modules,
        use_rslora=settings.use_rslora,
        modules_to_save=modules_to_save,
        # SEQ_CLS: PEFT trains the score head in full (modules_to_save) and saves it.
        task_type="SEQ_CLS" if is_sequence_classifier(model) else "CAUSAL_LM",
        **settings.extra,
    )


def lora_targets(target_modules):
    """target_modules as PEFT takes it: a list of names, or "all-linear" as it is (a string
    is not split into characters)."""
    if target_modules is None:
        return list(ALL_PROJECTIONS)
    if isinstance(target_modules, str):
        return ALL_LINEAR if target_modules == ALL_LINEAR else [target_modules]
    return list(target_modules)


# Models that compute several projections as one layer (Phi-3: qkv_proj, gate_up_proj):
# the separate names a notebook asks for -> the one layer that computes all of them.
FUSED_PROJECTIONS = {("q_proj", "k_proj", "v_proj"): "qkv_proj", ("gate_proj", "up_proj"): "gate_up_proj"}


def onto_fused_projections(model, target_modules: list) -> list:
    """``target_modules`` with each complete group of separate projection names replaced
    by the fused layer the model has instead (q_proj, k_proj, v_proj -> qkv_proj on
    Phi-3), said once: LoRA on the fused layer adapts the same weights, through one rank-r
    update for the group rather than one per projection. A partial group (q_proj alone) is left, to be refused by name."""
    present = set(linear_module_leaves(model))
    names = list(target_modules)
    for group, fused in FUSED_PROJECTIONS.items():
        if fused in present and not present.intersection(group) and all(n in names for n in group):
            at = min(names.index(n) for n in group)
            names = [n for n in names if n not in group]
            names.insert(at, fused)
            say_once(
                f"slothkit: this model computes {', '.join(group)} as one layer, {fused}; LoRA adapts "
                f"it there with one rank-r update for the whole group, not one per projection "
                f"(target_modules={fused!r} says so directly)",
                SettingChangedWarning,
            )
    return names


# Gated DeltaNet layers (Qwen3.5, Qwen3-Next): linear attention in place of self-attention
# in three layers of four, with its own projections.  Their input projections (queries,
# keys and values; the output gate z) and output projection do what q/k/v/o do in the
# full-attention layers; the two per-head scalars' projections (in_proj_a, in_proj_b: the
# decay and the write strength, one number per head) are left, as they are a few
# thousand weights each.
ATTENTION_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj")
LINEAR_ATTENTION_INPUTS = ("in_proj_qkv", "in_proj_qkvz", "in_proj_z")


def linear_attention_projections(model) -> list[str]:
    """The leaf names of the gated DeltaNet layers' projections that LoRA adapts beside
    q/k/v/o: the input projections and out_proj, where every out_proj is one of them."""
    inputs, outputs, other_outputs = set(), 0, 0
    for _, module in model.named_modules():
        children = module._modules
        found = [name for name in LINEAR_ATTENTION_INPUTS if isinstance(children.get(name), torch.nn.Module)]
        inputs.update(found)
        if "out_proj" in children:
            if found:
                outputs += 1
            else:
                other_outputs += 1
    if not inputs:
        return []
    return sorted(inputs) + (["out_proj"] if outputs and not other_outputs else [])


def onto_linear_attention(model, target_modules: list) -> list:
    """``target_modules`` with the gated DeltaNet projections added where all of q/k/v/o
    are asked for, said once: "the attention" of a hybrid model is both kinds of layer,
    and three of its four layers have no q_proj."""
    names = list(target_modules)
    if not all(name in names for name in ATTENTION_NAMES):
        return names
    added = [name for name in linear_attention_projections(model) if name not in names]
    if added:
        names += added
        say_once(
            f"slothkit: this model's linear-attention (gated DeltaNet) layers project through "
            f"{', '.join(added)} rather than q/k/v/o_proj; LoRA adapts them as it adapts q/k/v/o_proj "
            f"in the full-attention layers",
            SettingChangedWarning,
        )
    return names


# Mixture-of-experts layers (Qwen3-MoE, gpt-oss, Mixtral in transformers 5) hold every
# expert's MLP projections as one 3-D parameter (experts, out, in) or (experts, in, out)
# of their "experts" module, not as linear layers: the MLP names a notebook asks for, or
# the parameter's own name ("gate_up_proj", as Unsloth's MoE notebooks add it) -> those
# parameters, which PEFT adapts through target_parameters.
EXPERT_PARAMETERS = {("gate_proj", "up_proj"): "experts.gate_up_proj", ("down_proj",): "experts.down_proj"}
MLP_NAMES = ("gate_proj", "up_proj", "down_proj")


def expert_parameters(model, suffix: str) -> list[torch.nn.Parameter]:
    """The 3-D parameters whose dotted names end in ``suffix``."""
    return [p for name, p in model.named_parameters() if p.dim() == 3 and name.endswith("." + suffix)]


def onto_expert_parameters(model, target_modules: list) -> tuple[list, list]:
    """(target_modules, target_parameters): each complete group of MLP names that the
    model's experts hold as 3-D parameters, or the parameter's own last name, adds those
    parameters, said once, and leaves the target names only where linear layers still
    bear them (a shared expert)."""
    present = set(linear_module_leaves(model))
    names, parameters = list(target_modules), []
    for group, parameter in EXPERT_PARAMETERS.items():
        own_name = parameter.rsplit(".", 1)[-1]
        asked = all(n in names for n in group) or own_name in names
        if asked and expert_parameters(model, parameter):
            parameters.append(parameter)
            if not present.intersection(group):
                names = [n for n in names if n not in group]
            if own_name not in present:
                names = [n for n in names if n != own_name]
    if parameters:
        where = "in slothkit's fused experts" if has_fused_experts(model) else "on Hugging Face's modules"
        say_once(
            f"slothkit: this model's experts hold their MLP projections as 3-D parameters "
            f"({', '.join(parameters)}), not linear layers; LoRA adapts each expert there through "
            f"PEFT's target_parameters, {where}",
            FallbackWarning,
        )
    return names, parameters


def _check_target_parameters(model, names) -> None:
    """Refuse a target_parameters name that matches no parameter (PEFT only warns, and the
    run then trains without those adapters)."""
    names = [names] if isinstance(names, str) else list(names)
    unknown = [
        name
        for name in names
        if not any(full == name or full.endswith("." + name) for full, _ in model.named_parameters())
    ]
    if unknown:
        three_d = sorted(
            {".".join(full.split(".")[-2:]) for full, p in model.named_parameters() if p.dim() == 3}
        )
        raise ValueError(
            f"target_parameters: {unknown} match no parameter of this model; its 3-D parameters end in "
            f"{three_d or 'nothing (it has none)'}"
        )


def _check_expert_settings(settings: LoraSettings) -> None:
    """What PEFT's LoRA on parameters cannot do, said before PEFT fails on it."""
    if settings.lora_dropout:
        raise ValueError(
            f"lora_dropout={settings.lora_dropout}: LoRA on the experts' 3-D parameters applies its "
            f"update to the weight, where dropout of the input cannot act; use lora_dropout=0"
        )


def _adapted_linears(model, target_modules) -> list:
    """The linear layers LoRA will wrap (PEFT leaves the output head out of "all-linear")."""
    names = set(matching_modules(model, target_modules)) if target_modules != ALL_LINEAR else None
    head = causal_lm_of(model).get_output_embeddings()
    return [
        module
        for name, module in model.named_modules()
        if hasattr(module, "in_features") and hasattr(module, "out_features")
        and (name in names if names is not None else module is not head)
    ]  # fmt: skip


def check_lora_shape(model, target_modules, r: int, lora_alpha, target_parameters=(), chosen=None) -> None:
    """Refuse LoRA settings that would train silently wrong: a target name that matches no
    layer, an alpha that scales the update to nothing (or flips it), and a rank above
    min(in, out) of an adapted layer or expert: B @ A then has no more rank than at
    min(in, out), only more parameters.  `chosen`: the adapted layers' module paths, where
    the caller picked them by path (then target_modules is not read)."""
    if isinstance(lora_alpha, bool) or not isinstance(lora_alpha, (int, float)) or not lora_alpha > 0:
        raise ValueError(
            f"lora_alpha={lora_alpha!r}; expected a positive number (the update is scaled by lora_alpha / r: "
            f"0 trains adapters with no effect), e.g. 16, or 2 * r"
        )
    if chosen is not None:
        modules = dict(model.named_modules())
        adapted = [modules[path] for path in chosen]
    else:
        if target_modules != ALL_LINEAR:
            _check_targets_exist(model, target_modules)
        adapted = _adapted_linears(model, target_modules)
    widths = [min(m.in_features, m.out_features) for m in adapted]
    widths += [min(p.shape[1:]) for suffix in target_parameters for p in expert_parameters(model, suffix)]
    if widths and r > min(widths):
        raise ValueError(
            f"r={r} exceeds {min(widths)}, the smallest min(in_features, out_features) of the adapted "
            f"layers: a LoRA update B @ A cannot have a higher rank than that, so the extra parameters "
            f"add memory and nothing else; use r <= {min(widths)}"
        )


def _check_targets_exist(model, target_modules: list) -> None:
    unknown = [name for name in target_modules if not matching_modules(model, [name])]
    for group, parameter in EXPERT_PARAMETERS.items():
        named = [name for name in group if name in unknown]
        if named and expert_parameters(model, parameter):
            missing = [name for name in group if name not in target_modules]
            raise ValueError(
                f"target_modules: {named} name no linear layer of this model: its experts hold "
                f"{' and '.join(group)} as one 3-D parameter each, {parameter}, which LoRA adapts "
                f"when every name of the group, or {parameter.rsplit('.', 1)[-1]!r}, is given; add "
                f"{missing} (the MLP names {list(MLP_NAMES)} adapt every expert's whole MLP)"
            )
    if unknown == list(target_modules):
        raise ValueError(
            f"target_modules={target_modules} match no layer of this model; its linear "
            f"layers are named {linear_module_leaves(model)}"
        )
    if unknown:
        raise ValueError(
            f"target_modules: {unknown} match no layer of this model (the others do, and only they "
            f"would be trained); its linear layers are named {linear_module_leaves(model)}"
        )
