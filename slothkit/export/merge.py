"""Fold LoRA adapters into the base weights, in fp32, one tensor at a time.

For a LoRA-adapted linear layer with adapters i (all active, not yet merged)

    W' = W + sum_i s_i * B_i @ A_i          A_i: (r, in), B_i: (out, r)
    s_i = alpha_i / r_i                     (rsLoRA: alpha_i / sqrt(r_i))

and for an adapted embedding (peft stores A: (r, vocab), B: (dim, r); rows are tokens)

    E' = E + sum_i s_i * (B_i @ A_i)^T

The sum is formed in fp32 from fp32 copies of W, A and B and cast once, at the end, to the
dtype the weight is saved in: a bf16 W + bf16 delta would round twice and lose the small
updates LoRA makes. `s_i` is read from the layer (peft derives it from alpha, r, use_rslora
and rank/alpha patterns), so the merged model computes what the adapted model computes.
A LoRA bias (lora_bias=True) merges the same way: b' = b + s_i * b_B.

W itself comes from one of three places (`MergeSource`):

    "16bit"                the model's own 16-bit weights;
    "dequantized_4bit"     bitsandbytes 4-bit weights, dequantised (the weights the QLoRA
                           adapter was trained against: the merged model reproduces the
                           4-bit LoRA model's outputs);
    "original_checkpoint"  the 16-bit checkpoint the 4-bit model was quantised from: no
                           quantisation error in W, at the price of a W slightly different
                           from the one the adapter was trained on.

Modules in `modules_to_save` contribute their trained copy. For a model with tied input and
output embeddings the output weight is written only when it still equals the input one after
merging; otherwise the merged checkpoint unties them (`ties_broken`), since LoRA on either
side, or a trained lm_head, makes the two differ.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import pathlib
from collections.abc import Iterator

import torch
from torch import nn

from slothkit.core.inspection import (
    causal_lm_of,
    is_4bit_model,
    is_4bit_parameter,
    nf4_experts_of,
    weights_dtype,
)
from slothkit.export.checkpoint_files import SafetensorsCheckpoint, is_unquantized_safetensors_checkpoint

MERGE_SOURCES = ("16bit", "dequantized_4bit", "original_checkpoint")


@dataclasses.dataclass(frozen=True)
class MergeSource:
    kind: str  # one of MERGE_SOURCES
    checkpoint: pathlib.Path | None = None  # for "original_checkpoint"

    def describe(self) -> str:
        if self.kind == "16bit":
            return "the base model's 16-bit weights"
        if self.kind == "dequantized_4bit":
            return "the dequantised 4-bit (bitsandbytes) base weights the adapter was trained against"
        return f"the original 16-bit base checkpoint at {self.checkpoint}"


@dataclasses.dataclass
class MergeReport:
    """Filled in while the merged tensors are produced."""

    source: MergeSource
    merged_layers: list[str] = dataclasses.field(default_factory=list)
    saved_modules: list[str] = dataclasses.field(default_factory=list)  # modules_to_save copies used
    ties_broken: bool = False


# ---------------------------------------------------------------------------------------
# Model inspection
# ---------------------------------------------------------------------------------------


def lora_configs(model: nn.Module) -> dict:
    """{adapter name: LoraConfig} of a PeftModel; {} for a plain model."""
    configs = getattr(model, "peft_config", None) or {}
    for name, config in configs.items():
        peft_type = str(getattr(config, "peft_type", ""))
        if "LORA" not in peft_type.upper():
            raise ValueError(
                f"adapter {name!r} is a {peft_type} adapter; slothkit merges and exports LoRA adapters only"
            )
    return dict(configs)


def active_lora_config(model: nn.Module):
    configs = lora_configs(model)
    if not configs:
        return None
    active = getattr(model, "active_adapter", None)
    if isinstance(active, (list, tuple)):
        active = active[0] if active else None
    return configs.get(active) or next(iter(configs.values()))


def is_8bit_parameter(param) -> bool:
    return type(param).__name__ == "Int8Params"


def dequantize_4bit(param) -> torch.Tensor:
    import bitsandbytes.functional as bnbf

    return bnbf.dequantize_4bit(param.data, param.quant_state)


def base_model_name(model: nn.Module) -> str | None:
    """What the adapter says its base is (adapter_config.json's base_model_name_or_path)."""
    config = active_lora_config(model)
    name = getattr(config, "base_model_name_or_path", None) if config is not None else None
    if not name:
        name = getattr(causal_lm_of(model).config, "_name_or_path", None) or None
    return name


# ---------------------------------------------------------------------------------------
# Choosing W
# ---------------------------------------------------------------------------------------


def local_checkpoint_folder(name: str | None) -> pathlib.Path | None:
    """The folder on this machine that holds checkpoint `name`: the folder itself, or the
    Hub id's snapshot already in the local Hugging Face cache (never downloads); else None."""
    if not name:
        return None
    folder = pathlib.Path(name).expanduser()
    if folder.is_dir():
        return folder
    if folder.is_absolute() or name.startswith("."):
        return None
    try:
        from huggingface_hub import snapshot_download

        return pathlib.Path(snapshot_download(name, local_files_only=True))
    except Exception:  # not a Hub id, or not cached: nothing to detect
        return None


def find_original_checkpoint(name: str | None) -> pathlib.Path | None:
    """A local unquantised safetensors checkpoint for `name` (local_checkpoint_folder)."""
    folder = local_checkpoint_folder(name)
    return folder if folder is not None and is_unquantized_safetensors_checkpoint(folder) else None


def _refuse_nf4_experts(model: nn.Module) -> None:
    """Refuse, before anything is written, a model with experts slothkit quantised to NF4
    (slothkit.engine.experts_nf4): merging into them is not supported."""
    for name, param in causal_lm_of(model).named_parameters():
        if nf4_experts_of(param) is not None:
            raise ValueError(
                f"{name} holds mixture-of-experts weights that slothkit quantised to NF4 at loading "
                f"(load_in_4bit=True), and merging into them is not supported: load the model with "
                f"load_in_4bit=False to save it merged (the adapters alone save as they are)"
            )


def choose_merge_source(model: nn.Module, base_weights: str | os.PathLike | None = "auto") -> MergeSource:
    """Where W comes from.

    base_weights="auto": a 16-bit model merges into its own weights; a 4-bit model merges
        into the original 16-bit checkpoint when its adapter's base_model_name_or_path is a
        local (or locally cached) unquantised safetensors checkpoint, else into its
        dequantised weights.
    base_weights=None: the model's own weights (dequantised when 4-bit).
    base_weights=PATH: that unquantised checkpoint folder.
    """
    if any(is_8bit_parameter(p) for p in causal_lm_of(model).parameters()):
        raise ValueError(
            "this model has bitsandbytes 8-bit weights; slothkit merges into 16-bit or 4-bit (NF4/FP4) "
            "bases only: load the base with load_in_4bit=True or in 16-bit"
        )
    _refuse_nf4_experts(model)
    quantized = is_4bit_model(model)
    own = MergeSource("dequantized_4bit" if quantized else "16bit")
    if base_weights is None:
        return own
    if isinstance(base_weights, str) and base_weights == "auto":
        if not quantized:
            return own
        found = find_original_checkpoint(base_model_name(model))
        return MergeSource("original_checkpoint", found) if found is not None else own
    folder = pathlib.Path(base_weights).expanduser()
    if not folder.is_dir():
        raise FileNotFoundError(
            f"base_weights={str(base_weights)!r} is not a directory; pass the folder of the original "
            f"16-bit checkpoint, 'auto', or None"
        )
    if not is_unquantized_safetensors_checkpoint(folder):
        raise ValueError(
            f"base_weights={str(folder)!r} is not an unquantised safetensors checkpoint (expected config.json "
            f"without quantization_config, and model.safetensors or model.safetensors.index.json)"
        )
    return MergeSource("original_checkpoint", folder)


# ---------------------------------------------------------------------------------------
# The deltas
# ---------------------------------------------------------------------------------------


def _unsupported_variant(module, adapter: str) -> str | None:
    if getattr(module, "use_dora", {}).get(adapter, False):
        return "DoRA (use_dora=True)"
    variant = getattr(module, "lora_variant", {}).get(adapter)
    if variant is not None:
        return f"a LoRA variant ({type(variant).__name__})"
    return None


def adapters_to_merge(module) -> list[str]:
    """Active adapters of a LoRA layer whose delta is not already in its base weight."""
    if getattr(module, "disable_adapters", False):
        return []
    present = set(module.lora_A) | set(module.lora_embedding_A)
    merged = set(getattr(module, "merged_adapters", []))
    return [a for a in module.active_adapters if a in present and a not in merged]


def lora_delta(module, adapter: str) -> torch.Tensor:
    """s * B @ A in fp32, laid out like the base weight ((out, in), or (vocab, dim) for embeddings)."""
    variant = _unsupported_variant(module, adapter)
    if variant is not None:
        raise ValueError(f"cannot merge {variant}; slothkit merges plain LoRA and rsLoRA adapters")
    scale = float(module.scaling[adapter])
    if adapter in module.lora_embedding_A:
        a = module.lora_embedding_A[adapter].detach().float()  # (r, vocab)
        b = module.lora_embedding_B[adapter].detach().float()  # (dim, r)
        return (b @ a).T * scale  # (vocab, dim)
    lora_a, lora_b = module.lora_A[adapter], module.lora_B[adapter]
    if not isinstance(lora_a, nn.Linear):
        raise ValueError(
            f"cannot merge a LoRA adapter on a {type(module.get_base_layer()).__name__} layer; "
            f"slothkit merges LoRA on Linear and Embedding layers"
        )
    delta = (lora_b.weight.detach().float() @ lora_a.weight.detach().float()) * scale  # (out, in)
    if getattr(module, "fan_in_fan_out", False):  # Conv1D-style (in, out) storage
        delta = delta.T
    return delta


def expert_delta(wrapper, adapter: str) -> torch.Tensor:
    """s * B @ A of each expert for LoRA on a mixture-of-experts layer's 3-D parameter
    (PEFT's ParamWrapper), laid out like that parameter, in fp32: PEFT's own delta (which
    knows the parameter's (experts, out, in) or (experts, in, out) order) computed with
    the adapter's weights in fp32."""
    variant = _unsupported_variant(wrapper, adapter)
    if variant is not None:
        raise ValueError(f"cannot merge {variant}; slothkit merges plain LoRA and rsLoRA adapters")
    lora_a, lora_b = wrapper.lora_A[adapter].weight, wrapper.lora_B[adapter].weight
    param = wrapper.get_param()
    with torch.no_grad():
        kept = lora_a.data, lora_b.data, param.data
        try:
            # get_delta_weight computes in the adapter's dtype and casts to the parameter's:
            # both fp32 for the duration, so the sum is rounded once, after the add.
            lora_a.data, lora_b.data = lora_a.data.float(), lora_b.data.float()
            param.data = param.data.float()
            delta = wrapper.get_delta_weight(adapter).detach().clone()
        finally:
            lora_a.data, lora_b.data, param.data = kept
    if delta.shape != param.shape:
        raise ValueError(
            f"cannot merge LoRA on {wrapper.parameter_name}: its delta is {tuple(delta.shape)} for a "
            f"parameter of {tuple(param.shape)}"
        )
    return delta


def lora_bias_delta(module, adapter: str) -> torch.Tensor | None:
    if not getattr(module, "lora_bias", {}).get(adapter, False) or adapter not in module.lora_B:
        return None
    bias = module.lora_B[adapter].bias
    return None if bias is None else bias.detach().float() * float(module.scaling[adapter])


# ---------------------------------------------------------------------------------------
# Walking the model
# ---------------------------------------------------------------------------------------


def _lora_layer_class():
    from peft.tuners.lora.layer import LoraLayer

    return LoraLayer


def _wrapper_classes():
    from peft.utils.other import ModulesToSaveWrapper

    try:
        from peft.utils.other import TrainableTokensWrapper
    except ImportError:  # older peft
        TrainableTokensWrapper = ()
    return ModulesToSaveWrapper, TrainableTokensWrapper


def _trained_copy(wrapper) -> nn.Module:
    """The module a ModulesToSaveWrapper runs: its active trained copy, else the original."""
    if not getattr(wrapper, "disable_adapters", False):
        for name in wrapper.active_adapters:
            if name in wrapper.modules_to_save:
                return wrapper.modules_to_save[name]
    return wrapper.original_module


def _own_tensors(module: nn.Module, prefix: str, recurse: bool) -> Iterator[tuple[str, torch.Tensor]]:
    for name, param in module.named_parameters(recurse=recurse):
        yield prefix + name, param
    for name, buffer in module.named_buffers(recurse=recurse):
        owner_name, _, leaf = name.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        if leaf not in owner._non_persistent_buffers_set:
            yield prefix + name, buffer


def parameter_wrappers(module) -> list:
    """PEFT's LoRA wrappers of one module's parameters (ParamWrapper: LoRA through
    target_parameters, one per parameter, each wrapping the next), outermost first; empty
    for any other module."""
    wrappers = []
    while hasattr(module, "parameter_name") and isinstance(module, _lora_layer_class()):
        wrappers.append(module)
        module = module.base_layer
    return wrappers


def _walk(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, str, nn.Module]]:
    """(kind, dotted prefix, module) in state-dict order: "lora" layers, "experts" (LoRA
    on a module's parameters, the outermost wrapper), "saved" copies of modules_to_save,
    and "plain" modules (their own tensors only)."""
    lora_layer = _lora_layer_class()
    modules_to_save, trainable_tokens = _wrapper_classes()
    if trainable_tokens and isinstance(module, trainable_tokens):
        raise ValueError(
            "cannot merge trainable_token_indices adapters; slothkit merges LoRA and modules_to_save"
        )
    if parameter_wrappers(module):
        yield "experts", prefix, module
        return
    if isinstance(module, lora_layer):
        yield "lora", prefix, module
        return
    if isinstance(module, modules_to_save):
        yield "saved", prefix, module
        return
    yield "plain", prefix, module
    for name, child in module.named_children():
        yield from _walk(child, f"{prefix}{name}.")


def _module_names(causal_lm: nn.Module) -> tuple[str | None, str | None]:
    """Dotted names of the input and output embedding modules."""
    wanted = {id(causal_lm.get_input_embeddings()): "in"}
    output = causal_lm.get_output_embeddings()
    if output is not None:
        wanted[id(output)] = "out"
    names = {"in": None, "out": None}
    for name, module in causal_lm.named_modules():
        role = wanted.get(id(module))
        if role and names[role] is None:
            names[role] = name
    return names["in"], names["out"]


def ties_embeddings(config) -> bool:
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return bool(getattr(text_config, "tie_word_embeddings", getattr(config, "tie_word_embeddings", False)))


def stored_names(model: nn.Module, names: list[str]) -> dict[str, str]:
    """{name in the model: name in its checkpoint} for the checkpoint's tensor `names` that
    transformers renames as it loads them (an image-text checkpoint's
    ``language_model.model.*`` and ``vision_tower.*`` are ``model.language_model.*`` and
    ``model.vision_tower.*`` in transformers 5), read off transformers' own renamings."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, rename_source_key
    except ImportError:  # a transformers without load-time renamings: the names are the model's
        return {}
    renamings = [t for t in get_model_conversion_mapping(model) if isinstance(t, WeightRenaming)]
    if not renamings:
        return {}
    return {rename_source_key(name, renamings, [])[0]: name for name in names}


class _WeightReader:
    """W for a tensor name: from the model (dequantised when 4-bit) or the original checkpoint."""

    def __init__(
        self,
        source: MergeSource,
        target_dtype: torch.dtype,
        tied_names: tuple[str, str] | None,
        model: nn.Module,
    ):
        self.source = source
        self.target_dtype = target_dtype
        self.checkpoint = (
            SafetensorsCheckpoint(source.checkpoint) if source.kind == "original_checkpoint" else None
        )
        self.tied_names = tied_names  # (input embedding weight, output weight) when tied
        self._stored = stored_names(model, self.checkpoint.names()) if self.checkpoint is not None else {}

    def stored_name(self, name: str) -> str:
        """The checkpoint's name for the model's tensor `name`."""
        return name if name in self.checkpoint else self._stored.get(name, name)

    def read(self, name: str, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.dtype]:
        """(value, dtype to save in)."""
        if self.checkpoint is not None:
            key = self.stored_name(name)
            if key not in self.checkpoint and self.tied_names and name == self.tied_names[1]:
                key = self.stored_name(self.tied_names[0])  # a tied head is stored once, as the embedding
            if key not in self.checkpoint:
                raise KeyError(
                    f"the original checkpoint {str(self.source.checkpoint)!r} has no tensor {name!r}; "
                    f"is it the checkpoint this model was loaded from?"
                )
            value = self.checkpoint.get(key)
            expected = tuple(self._logical_shape(tensor))
            if tuple(value.shape) != expected:
                raise ValueError(
                    f"tensor {name!r} is {tuple(value.shape)} in the original checkpoint but {expected} in "
                    f"the model; base_weights must be the checkpoint this model was loaded from"
                )
            return value, value.dtype
        if is_4bit_parameter(tensor):
            return dequantize_4bit(tensor), self.target_dtype
        return tensor.detach(), tensor.dtype

    @staticmethod
    def _logical_shape(tensor) -> torch.Size:
        if is_4bit_parameter(tensor):
            return tensor.quant_state.shape
        return tensor.shape


def merged_tensors(
    model: nn.Module, source: MergeSource, report: MergeReport
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of the merged checkpoint, names as transformers saves them."""
    causal_lm = causal_lm_of(model)
    target_dtype = weights_dtype(model)
    tied = ties_embeddings(causal_lm.config)
    in_name, out_name = _module_names(causal_lm)
    in_weight = f"{in_name}.weight" if in_name is not None else None
    out_weight = f"{out_name}.weight" if out_name is not None else None
    reader = _WeightReader(
        source,
        target_dtype,
        (in_weight, out_weight) if tied and in_weight and out_weight else None,
        causal_lm,
    )
    merged_input_embedding = None

    def finish(name: str, value: torch.Tensor, dtype: torch.dtype):
        nonlocal merged_input_embedding
        value = value.to(dtype) if value.is_floating_point() else value
        if name == in_weight:
            merged_input_embedding = value
        if tied and name == out_weight:
            if merged_input_embedding is not None and torch.equal(value, merged_input_embedding):
                return None  # still tied: stored once, as the embedding
            report.ties_broken = True  # differs (or came first, unchecked): store both, untied
        return name, value

    for kind, prefix, module in _walk(causal_lm):
        if kind == "plain":
            for name, tensor in _own_tensors(module, prefix, recurse=False):
                value, dtype = reader.read(name, tensor)
                item = finish(name, value, dtype)
                if item is not None:
                    yield item
        elif kind == "saved":
            trained = _trained_copy(module)
            report.saved_modules.append(prefix.rstrip("."))
            for name, tensor in _own_tensors(trained, prefix, recurse=True):
                value = tensor.detach()
                dtype = value.dtype
                if reader.checkpoint is not None and reader.stored_name(name) in reader.checkpoint:
                    dtype = reader.checkpoint.dtype_of(reader.stored_name(name))  # as the original stored it
                item = finish(name, value, dtype)
                if item is not None:
                    yield item
        elif kind == "experts":  # each adapted parameter + its experts' deltas
            deltas = {}  # parameter name -> the deltas to add
            for wrapper in parameter_wrappers(module):
                for adapter in adapters_to_merge(wrapper):
                    deltas.setdefault(wrapper.parameter_name, []).append(expert_delta(wrapper, adapter))
                    report.merged_layers.append(prefix + wrapper.parameter_name)
            for name, tensor in _own_tensors(module.get_base_layer(), prefix, recurse=True):
                value, dtype = reader.read(name, tensor)
                for delta in deltas.get(name[len(prefix) :], []):
                    value = value.float() + delta.to(value.device)
                item = finish(name, value, dtype)
                if item is not None:
                    yield item
        else:  # a LoRA layer: W + deltas, bias + bias deltas, nothing of the adapter itself
            base = module.get_base_layer()
            adapters = adapters_to_merge(module)
            weight_name = prefix + "weight"
            weight, dtype = reader.read(weight_name, base.weight)
            weight = weight.float()
            for adapter in adapters:
                weight = weight + lora_delta(module, adapter).to(weight.device)
            if adapters:
                report.merged_layers.append(prefix.rstrip("."))
            item = finish(weight_name, weight, dtype)
            if item is not None:
                yield item
            for name, tensor in _own_tensors(base, prefix, recurse=True):
                if name == weight_name:
                    continue
                value, dtype = reader.read(name, tensor)
                if name == prefix + "bias":
                    value = value.float()
                    for adapter in adapters:
                        extra = lora_bias_delta(module, adapter)
                        if extra is not None:
                            value = value + extra.to(value.device)
                item = finish(name, value, dtype)
                if item is not None:
                    yield item


def merged_state_dict(model: nn.Module, base_weights="auto") -> tuple[dict[str, torch.Tensor], MergeReport]:
    """The whole merged state dict in memory (small models, tests); see `merged_tensors`."""
    report = MergeReport(choose_merge_source(model, base_weights))
    return dict(merged_tensors(model, report.source, report)), report


def save_config(model: nn.Module, directory: pathlib.Path, dtype: torch.dtype, untie: bool) -> None:
    """config.json for the merged checkpoint: the base's, without quantization settings,
    with the saved dtype, the KV cache on (training turns it off) and the ties as written."""
    config = copy.deepcopy(causal_lm_of(model).config)
    for key in ("quantization_config", "_pre_quantization_dtype"):
        if key in config.__dict__:
            delattr(config, key)
    if hasattr(config, "dtype"):  # transformers >= 4.56
        config.dtype = dtype
    else:
        config.torch_dtype = dtype
    config.use_cache = True
    if untie:
        config.tie_word_embeddings = False
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        text_config.tie_word_embeddings = False
    config.save_pretrained(directory)
