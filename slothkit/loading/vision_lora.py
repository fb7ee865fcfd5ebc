"""LoRA on an image-text model: the linear layers chosen by part and block (Unsloth's
finetune_vision_layers, finetune_language_layers, finetune_attention_modules,
finetune_mlp_modules), PEFT's wrap, and checkpointing of both towers.

    peft_model = add_vision_lora(model, LoraSettings(r=16), VisionTargets(vision=False))
    ready_vision_model(peft_model, "offload")

The parts and blocks are read from each layer's module path (slothkit.models.image_text);
the projector and the output head get no adapter.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import types
import warnings

import torch
import torch.utils.checkpoint
from torch import nn

from slothkit.core.inspection import causal_lm_of
from slothkit.core.notices import SettingChangedWarning, say_once
from slothkit.engine.checkpointing.choice import enable_checkpointing
from slothkit.inference.generation import accept_encoding_in_generate
from slothkit.loading.lora_setup import ALL_LINEAR, BIASES, LoraSettings, check_lora_shape
from slothkit.loading.training_mode import for_training
from slothkit.models.image_text import block_of, part_of


@dataclasses.dataclass(frozen=True)
class VisionTargets:
    """Which linear layers get adapters: those of the vision tower and/or the language
    model, in attention and/or MLP blocks (Unsloth's finetune_* flags)."""

    vision: bool = True
    language: bool = True
    attention: bool = True
    mlp: bool = True

    def __post_init__(self) -> None:
        if not (self.vision or self.language):
            raise ValueError(
                "finetune_vision_layers=False and finetune_language_layers=False leave no layer to adapt; "
                "turn one of them on"
            )
        if not (self.attention or self.mlp):
            raise ValueError(
                "finetune_attention_modules=False and finetune_mlp_modules=False leave no layer to adapt; "
                "turn one of them on"
            )

    def takes(self, path: str) -> bool:
        """Whether the linear layer at `path` is one of these: inside a tower's stack of
        layers (a numbered component; a pooling head after the stack is not), in the parts
        and blocks asked for."""
        part, block = part_of(path), block_of(path)
        in_stack = any(component.isdigit() for component in path.split("."))
        return in_stack and (
            (part == "vision" and self.vision or part == "language" and self.language)
            and (block == "attention" and self.attention or block == "mlp" and self.mlp)
        )  # fmt: skip


def linear_paths(model: nn.Module) -> list[str]:
    """The module paths of every linear layer (16-bit or 4-bit) of `model`."""
    return [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]


def chosen_layers(model: nn.Module, targets: VisionTargets) -> list[str]:
    """The paths of the linear layers `targets` picks, in the model's order."""
    return [path for path in linear_paths(model) if targets.takes(path)]


def paths_pattern(model: nn.Module, paths: list[str]) -> str | list[str]:
    """A regular expression that PEFT matches against whole module paths, naming exactly
    `paths` with each layer index written as digits; `paths` themselves where none does.
    One line per kind of layer keeps adapter_config.json short for deep models."""
    leaves_by_stem: dict[str, list[str]] = {}
    for path in paths:
        stem, leaf = path.rsplit(".", 1)
        stem = r"\.".join(r"\d+" if c.isdigit() else re.escape(c) for c in stem.split("."))
        leaves = leaves_by_stem.setdefault(stem, [])
        if leaf not in leaves:
            leaves.append(leaf)
    pattern = "|".join(
        rf"{stem}\.(?:{'|'.join(map(re.escape, leaves))})" for stem, leaves in leaves_by_stem.items()
    )
    matched = [path for path in linear_paths(model) if re.fullmatch(pattern, path)]
    return pattern if matched == paths else list(paths)


def _summary(paths: list[str]) -> str:
    counts: dict[tuple[str, str], int] = {}
    for path in paths:
        key = (part_of(path), block_of(path))
        counts[key] = counts.get(key, 0) + 1
    names = {"vision": "vision tower", "language": "language model"}
    return ", ".join(f"{names[part]} {block} {count}" for (part, block), count in counts.items())


def vision_lora_config(model: nn.Module, settings: LoraSettings, targets: VisionTargets):
    """PEFT's LoraConfig for `settings` on `model`, its targets chosen by `targets` where
    settings.target_modules is None (said once, with what was chosen); "all-linear" and
    lists of names are PEFT's as given."""
    from peft import LoraConfig

    r = settings.r
    if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
        raise ValueError(f"r={r!r}; expected a positive integer rank such as 8, 16 or 32")
    if settings.bias not in BIASES:
        raise ValueError(f"bias={settings.bias!r}; accepted: 'none', 'all', 'lora_only'")
    asked = settings.target_modules
    if asked is None:
        paths = chosen_layers(model, targets)
        if not paths:
            raise ValueError(
                f"the finetune_* flags ({targets}) pick no linear layer of this {type(model).__name__}: its "
                f"vision and language layers are named {sorted({p.rsplit('.', 1)[-1] for p in linear_paths(model)})}; "
                f"name them in target_modules"
            )
        check_lora_shape(model, ALL_LINEAR, r, settings.lora_alpha, chosen=paths)
        target_modules = paths_pattern(model, paths)
        say_once(
            f"slothkit: LoRA adapts {len(paths)} linear layers of this image-text model ({_summary(paths)}); "
            f"the projector and the output head get none",
            SettingChangedWarning,
        )
    elif asked == ALL_LINEAR:
        target_modules = ALL_LINEAR
        check_lora_shape(model, ALL_LINEAR, r, settings.lora_alpha)
    else:
        target_modules = [asked] if isinstance(asked, str) else list(asked)
        check_lora_shape(model, target_modules, r, settings.lora_alpha)
    return LoraConfig(
        r=r,
        lora_alpha=settings.lora_alpha,
        lora_dropout=settings.lora_dropout,
        bias=settings.bias,
        target_modules=target_modules,
        use_rslora=settings.use_rslora,
        modules_to_save=settings.modules_to_save,
        task_type="CAUSAL_LM",
        **settings.extra,
    )


def add_vision_lora(model: nn.Module, settings: LoraSettings, targets: VisionTargets):
    """`model` wrapped by PEFT with the adapters `settings` and `targets` describe.

    Raises:
        ValueError: the model is already a PeftModel, or a setting is not accepted.
    """
    from peft import PeftModel, get_peft_model

    if isinstance(model, PeftModel):
        raise ValueError("this model already has LoRA adapters (it is a PeftModel)")
    config = vision_lora_config(model, settings, targets)
    torch.manual_seed(settings.random_state)
    with warnings.catch_warnings():
        # PEFT reads transformers' deprecated ``is_gradient_checkpointing`` (as in lora_setup).
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated")
        return get_peft_model(model, config)


def tower_layers(model: nn.Module) -> tuple[list[nn.Module], list[nn.Module]]:
    """(the language model's layers, the vision tower's layers): transformers' checkpointed
    layers (GradientCheckpointingLayer) by the part their path is in."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    language, vision = [], []
    for path, module in causal_lm_of(model).named_modules():
        if isinstance(module, GradientCheckpointingLayer):
            {"language": language, "vision": vision}.get(part_of(path), []).append(module)
    return language, vision


def plain_vision_layers(model: nn.Module) -> list[nn.Module]:
    """The vision tower's stacked layers (the numbered members of its layer lists) where
    transformers gives the tower no checkpointed layer: Mllama's vision encoder layers are
    plain modules, which transformers never checkpoints.  Empty for towers it does."""
    if tower_layers(model)[1]:
        return []
    return [
        module
        for path, module in causal_lm_of(model).named_modules()
        if part_of(path) == "vision" and path.rsplit(".", 1)[-1].isdigit()
    ]


def _checkpointed_forward(self, *args, **kwargs):
    """A plain layer's forward through torch's checkpoint while it trains with gradients:
    its inputs are kept, its activations recomputed in the backward.  Bound to the layer
    (so that a deep copy of the model rebinds it to the copy), the class's forward inside."""
    forward = functools.partial(type(self).forward, self)
    if self.training and torch.is_grad_enabled():
        return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return forward(*args, **kwargs)


def checkpoint_plain_layers(layers: list[nn.Module]) -> None:
    """Give each of `layers` (modules without transformers' checkpointing hooks) torch's
    non-reentrant checkpoint, on the instance."""
    for layer in layers:
        layer.forward = types.MethodType(_checkpointed_forward, layer)


def ready_vision_model(peft_model, mode) -> nn.Module:
    """Checkpointing on both towers, the save methods, training mode.

    The language model's layers take `mode` ("offload": their inputs kept in pinned host
    memory; True: torch's checkpoint; False: none); the vision tower's layers take torch's
    checkpoint whenever `mode` is on, since their inputs (patches of a few images) are
    small beside the language model's and their arguments differ by family.  A tower
    whose layers lack transformers' hooks (Mllama's) has them wrapped on the instance:
    each of Llama 3.2 Vision's 40 vision layers, adapted, would otherwise keep 481 MiB of
    activations for one image of four 560 x 560 tiles (6,432 patches; bfloat16, sdpa,
    measured on the CPU) against its 16 MiB input.
    """
    causal_lm = causal_lm_of(peft_model)
    language, vision = tower_layers(peft_model)
    mode = "offload" if mode in ("unsloth", "auto") else mode
    enable_checkpointing(language, mode, cuda_graphs=False, keep_sums=False)
    enable_checkpointing(vision, bool(mode), cuda_graphs=False, keep_sums=False)
    if mode:
        checkpoint_plain_layers(plain_vision_layers(peft_model))
        causal_lm.enable_input_require_grads()
    from slothkit.export import attach_export_methods

    attach_export_methods(peft_model)
    accept_encoding_in_generate(peft_model)
    return for_training(peft_model)
