"""Load a checkpoint and its tokenizer the way FastModel.from_pretrained does: checks
before loading, NF4 through bitsandbytes, the fused path patched onto the instance where
it runs, and the tokenizer set up and linked to the model.

    model, tokenizer = load_model("path/or/hub-id", LoadOptions(load_in_4bit=True))

A folder holding a saved adapter loads through slothkit.loading.saved_adapter, which calls this
for the base model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings

import torch

from slothkit.checkpoint.before_loading import (
    check_max_seq_length,
    extend_context,
    nf4_settings,
    pick_dtype,
    require_bitsandbytes,
    resolve_checkpoint,
)
from slothkit.checkpoint.loaded_weights import check_loaded_weights
from slothkit.core.allocator import prefer_expandable_segments
from slothkit.core.distributed import device_map_for_process
from slothkit.core.folder_paths import check_folder_path
from slothkit.core.inspection import causal_lm_of
from slothkit.core.model_state import attach_state
from slothkit.core.notices import FallbackWarning, say_once
from slothkit.data.chat_template_calls import accept_older_chat_template_calls
from slothkit.data.chat_templates import link_model
from slothkit.engine.decoder import patch_decoder
from slothkit.engine.experts import patch_experts
from slothkit.engine.experts_loading import quantized_experts_while_loading, settle_loaded_experts
from slothkit.engine.gated_deltanet import fuse_deltanet_layers
from slothkit.engine.generic_head import fuse_generic_head
from slothkit.engine.generic_layers import fuse_generic_layers
from slothkit.engine.generic_modules import fuse_generic_modules
from slothkit.engine.nf4_layout import keep_nf4_layout
from slothkit.engine.position_limit import watch_position_limit
from slothkit.inference.generation import accept_encoding_in_generate
from slothkit.inference.vllm_generate import attach_vllm_methods
from slothkit.loading.mxfp4_checkpoint import holds_mxfp4_experts, mxfp4_dequantization, notice_mxfp4_experts
from slothkit.loading.text_tower import (
    TEXT_TOWER_KEYS,
    renders_text_by_default,
    text_tower_config,
    unreported_vision_weights,
)
from slothkit.models import architecture_for, supported_summary
from slothkit_kernels.utils import triton_runs_on


@dataclasses.dataclass(frozen=True)
class LoadOptions:
    """from_pretrained's loading options, which travel together (its docstring says what
    each means); checked when made.

    Attributes:
        max_seq_length, dtype, load_in_4bit, device_map, token, attn_implementation,
        fused, num_labels: as FastModel.from_pretrained.
        hf_kwargs: further keywords for transformers' ``from_pretrained``.
    """

    max_seq_length: int = 2048
    dtype: torch.dtype | str | None = None
    load_in_4bit: bool = True
    device_map: object = None
    token: str | None = None
    attn_implementation: str | None = None
    fused: bool | None = None
    num_labels: int | None = None
    hf_kwargs: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.fused not in (None, True, False):
            raise ValueError(f"fused={self.fused!r}; accepted: None (automatic), True or False")
        labels = self.num_labels
        if labels is not None and (isinstance(labels, bool) or not isinstance(labels, int) or labels < 1):
            raise ValueError(
                f"num_labels={labels!r}; accepted: None (a causal LM) or a positive integer, the outputs of a "
                "sequence classifier's score head (1 for a reward model)"
            )


def _on_cpu_only(device_map) -> bool:
    """Whether a device_map puts every module on the CPU (or disk)."""
    if isinstance(device_map, dict):
        return all(str(place) in ("cpu", "disk") for place in device_map.values())
    return str(device_map) in ("cpu", "disk")


def load_model(model_name: str, options: LoadOptions):
    """``(model, tokenizer)`` from a checkpoint directory or Hub id, as
    FastModel.from_pretrained returns them (its docstring says what each option does)."""
    if options.hf_kwargs.get("cache_dir") is not None:  # transformers would say "File exists"
        check_folder_path(options.hf_kwargs["cache_dir"], "cache_dir")
    device_map = options.device_map
    if torch.cuda.is_available() and not _on_cpu_only(device_map):
        prefer_expandable_segments()  # before anything here starts CUDA
    if device_map is None:
        # Under torchrun: this process's GPU, made current before anything here starts
        # CUDA (pick_dtype, bitsandbytes), which would put a context on GPU 0.
        device_map = device_map_for_process()
    config = resolve_checkpoint(model_name, token=options.token)
    notice_mxfp4_experts(config, model_name, options.load_in_4bit)
    hf_kwargs = dict(options.hf_kwargs)
    hf_kwargs.pop("output_loading_info", None)  # slothkit reads the report itself
    text_config = text_tower_config(config, model_name) if options.num_labels is None else None
    if text_config is not None:  # a multimodal checkpoint: its text model alone
        config = hf_kwargs["config"] = text_config
        hf_kwargs["key_mapping"] = TEXT_TOWER_KEYS
    # max_seq_length=None (Unsloth's tool-calling notebook): the model's own context.
    max_seq_length = options.max_seq_length
    if max_seq_length is None:
        max_seq_length = getattr(config, "max_position_embeddings", None)
    if extend_context(config, max_seq_length):
        hf_kwargs["config"] = config
    if options.num_labels is not None:
        hf_kwargs["num_labels"] = options.num_labels
    from transformers import PreTrainedModel

    if hasattr(PreTrainedModel, "set_use_kernels"):
        # transformers' Hub kernels (on by default where the `kernels` package is
        # installed) re-kernelize the model at each train()/eval() switch, putting back the
        # class forward of every module they decorate (the norms, the gated DeltaNet) over
        # slothkit's patch of that instance; slothkit's own kernels compute those modules.
        hf_kwargs.setdefault("use_kernels", False)
    dtype = pick_dtype(options.dtype)
    tokenizer = load_tokenizer(model_name, options.token)
    if text_config is not None:
        renders_text_by_default(tokenizer)
    quantization_config = _quantization_config(config, options.load_in_4bit, dtype)
    experts_at_load = _experts_quantized_while_loading(config, quantization_config, options)
    with (
        unreported_vision_weights() if text_config is not None else contextlib.nullcontext(),
        experts_at_load as experts_loaded,
    ):
        model, loading_info = _auto_class(options.num_labels).from_pretrained(
            model_name,
            dtype=dtype,
            quantization_config=quantization_config,
            device_map=device_map,
            token=options.token,
            attn_implementation=attention_for(
                config, options.attn_implementation, options.num_labels is not None
            ),
            output_loading_info=True,
            **hf_kwargs,
        )
    check_loaded_weights(model, loading_info, model_name)
    # bitsandbytes would repack 4-bit weights for its CPU kernels at the first
    # eval-mode forward on an AVX512-BF16 CPU, changing the numbers (engine/nf4_layout.py).
    keep_nf4_layout(model)
    prepare_tokenizer(tokenizer, max_seq_length)
    if options.num_labels is not None:
        # The classifier reads the last token before the first pad of each row.
        model.config.pad_token_id = tokenizer.pad_token_id
    arch = architecture_for(model.config)
    if arch is None and options.num_labels is None:
        take_generic_path(model, options.fused)
    elif takes_fused_path(model, arch, options.fused):
        patch_decoder(model, arch)
    if experts_loaded is not None:
        settle_loaded_experts(experts_loaded, causal_lm_of(model))
    watch_position_limit(causal_lm_of(model))
    link_tokenizer(model, tokenizer)
    set_max_seq_length(model, max_seq_length, checked=True)
    return model, tokenizer


def attention_for(config, asked: str | None = None, sequence_classifier: bool = False) -> str:
    """The attention implementation to load with.

    Args:
        config: the checkpoint's transformers config.
        asked: the user's attn_implementation, taken as it is; None (FastModel's default):
            SDPA where the model's class runs it and its attention scores are not
            soft-capped, else eager attention, said once. SDPA cannot soft-cap (Gemma 2):
            newer transformers refuse it for such classes, while older ones (5.17) load
            Gemma 2 with SDPA and then drop the cap without a word.
        sequence_classifier: the model loads as a sequence classifier (num_labels given).
    """
    if asked is not None:
        return asked
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING,
        MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING,
    )

    mapping = (
        MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING if sequence_classifier else MODEL_FOR_CAUSAL_LM_MAPPING
    )
    try:
        model_class = mapping[type(config)]
    except KeyError:  # transformers will say what is wrong with the checkpoint
        return "sdpa"
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    soft_capped = getattr(text_config, "attn_logit_softcapping", None) is not None
    if getattr(model_class, "_supports_sdpa", True) and not soft_capped:
        return "sdpa"
    reason = (
        "its attention scores are soft-capped, which SDPA cannot do"
        if soft_capped
        else "transformers does not support SDPA for this class"
    )
    fused = "; slothkit's fused layers soft-cap in their own tiled attention on a GPU" if soft_capped else ""
    say_once(
        f"slothkit: {model_class.__name__} cannot run SDPA attention ({reason}); transformers' "
        f"modules run eager attention, which is slower and holds the attention weights{fused}. "
        f"Pass attn_implementation='flash_attention_2' where flash-attn is installed",
        FallbackWarning,
    )
    return "eager"


def load_tokenizer(model_name: str, token: str | None = None):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_name, token=token)
    except (OSError, ValueError, TypeError) as error:
        raise FileNotFoundError(
            f"{model_name!r} has no usable tokenizer (tokenizer.json or tokenizer.model "
            f"with tokenizer_config.json); save one with the checkpoint "
            f"(underlying error: {error})"
        ) from None


def prepare_tokenizer(tokenizer, max_seq_length: int) -> None:
    """Right padding with a pad token (its unk or EOS token when it had none), and the
    model's longest sequence as ``model_max_length``."""
    tokenizer.model_max_length = max_seq_length
    tokenizer.padding_side = "right"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.unk_token or tokenizer.eos_token


def _quantization_config(config, load_in_4bit: bool, dtype: torch.dtype):
    """bitsandbytes' NF4 settings for a 16-bit checkpoint loaded in 4 bits; for MXFP4
    experts, transformers' dequantisation as they load (slothkit.loading.mxfp4_checkpoint);
    else None (a checkpoint already quantised carries its own)."""
    if holds_mxfp4_experts(config):
        return mxfp4_dequantization()
    already_quantized = getattr(config, "quantization_config", None) is not None
    if load_in_4bit or already_quantized:
        require_bitsandbytes()
    if not load_in_4bit or already_quantized:
        return None
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(**nf4_settings(dtype))


def _experts_quantized_while_loading(config, quantization_config, options: LoadOptions):
    """quantized_experts_while_loading where the loaded model's experts will be fused and
    quantised to NF4 (bitsandbytes quantises it while loading, and it takes the generic
    path, whose fused experts run where Triton does or everywhere with fused=True), so that
    they are quantised one parameter at a time as they load; else a block that does
    nothing (and yields None)."""
    takes_generic_path = options.num_labels is None and architecture_for(config) is None
    not_nf4 = quantization_config is None or not options.load_in_4bit
    if not_nf4 or not takes_generic_path or options.fused is False:
        return contextlib.nullcontext()
    if options.fused:
        return quantized_experts_while_loading(lambda device: True)
    return quantized_experts_while_loading(lambda device: device.type == "cuda" and triton_runs_on(device))


def _auto_class(num_labels: int | None):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    return AutoModelForCausalLM if num_labels is None else AutoModelForSequenceClassification


@functools.cache
def _warn_unsupported(model_type: str) -> None:
    warnings.warn(
        f"slothkit has no fused path for model_type {model_type!r}; it will train through the "
        f"plain Hugging Face + PEFT path. Fused architectures: {supported_summary()}.",
        stacklevel=4,
    )


@functools.cache
def _notice_generic_path(model_type: str, layers: str, head: str) -> None:
    warnings.warn(
        f"slothkit has no fused path for model_type {model_type!r}; it trains through {layers} "
        f"with slothkit's offloaded checkpointing and {head}. Fused architectures: "
        f"{supported_summary()}.",
        stacklevel=5,
    )


def take_generic_path(model, fused: bool | None) -> None:
    """A causal LM slothkit has no record for keeps its modules, except where Triton runs (a
    CUDA GPU by default, anywhere with fused=True): there its head gets the fused linear
    cross-entropy if its loss is the plain one (slothkit.engine.generic_head), its
    mixture-of-experts layers the fused experts (slothkit.engine.experts), and its layers
    the fused norms, attention, MLP and residual sums where those compute what its own
    modules do (slothkit.engine.generic_layers), and its gated DeltaNet layers the delta
    rule kernel where that computes what they do (slothkit.engine.gated_deltanet). Said
    once, with what runs.

    Raises:
        ValueError: fused=True and not even the loss can be fused (the reason named).
    """
    if fused is False:
        return
    causal_lm = causal_lm_of(model)
    model_type = causal_lm.config.model_type
    device = next(model.parameters()).device
    if fused is None and (device.type != "cuda" or not triton_runs_on(device)):
        _warn_unsupported(model_type)
        return
    # The gated DeltaNet layers before any other patch: fusing them resets transformers' hub
    # kernels, which restores the class forward of the modules those decorate.
    deltanet_layers = _fuse_deltanet_layers(causal_lm)
    # The experts next: the head's check runs the model, whose experts may already be NF4
    # (slothkit.engine.experts_loading), which only the fused experts read.
    expert_blocks = patch_experts(causal_lm)
    reason = fuse_generic_head(causal_lm)
    layers_reason = fuse_generic_layers(causal_lm)
    norms = mlps = 0
    if layers_reason is not None:  # the layers stay: their norms and MLPs one by one
        norms, mlps, modules_reason = fuse_generic_modules(causal_lm)
        if modules_reason is not None:
            layers_reason += f"; {modules_reason}"
    if (
        reason is not None
        and fused
        and not expert_blocks
        and layers_reason is not None
        and not deltanet_layers
        and not (norms or mlps)
    ):
        raise ValueError(
            f"fused=True, but slothkit has no fused path for model_type {model_type!r} and cannot "
            f"fuse its loss: {reason}, nor its layers: {layers_reason}; fused architectures: "
            f"{supported_summary()}"
        )
    head = "its fused cross-entropy on the head" if reason is None else f"the model's own loss ({reason})"
    if expert_blocks:
        head += f", and the experts of its {expert_blocks} mixture-of-experts layers fused"
    layers = (
        "slothkit's fused norms, attention and residual sums (checked against its own modules on a random batch)"
        if layers_reason is None
        else f"its Hugging Face modules (not the fused layers: {layers_reason})"
    )
    if norms or mlps:
        layers += (
            f", its {norms} RMSNorms and {mlps} gated MLPs in slothkit's kernels (each checked against "
            f"its own output at load),"
        )
    _notice_generic_path(model_type, layers, head)


def _fuse_deltanet_layers(causal_lm) -> int:
    """Route the gated DeltaNet layers through the delta rule kernel; say once what runs."""
    count, reason = fuse_deltanet_layers(causal_lm)
    if count:
        say_once(
            f"slothkit: the {count} gated DeltaNet layers of this {causal_lm.config.model_type!r} model "
            f"compute the gated delta rule with slothkit's chunked Triton kernel in training (checked "
            f"against their own forward on a random batch); with a cache or packed sequences their "
            f"own forward runs.",
            FallbackWarning,  # part of the generic path's notice: no record, HF's decode
        )
    elif reason is not None:
        say_once(
            f"slothkit: the gated DeltaNet layers of this {causal_lm.config.model_type!r} model keep "
            f"their own forward: {reason}.",
            FallbackWarning,
        )
    return count


@functools.cache
def _notice_plain_path(device_type: str) -> None:
    warnings.warn(
        f"slothkit: Triton cannot run on the {device_type}, so the model keeps its Hugging Face "
        f"modules (faster there than the fused kernels' torch references) and generate stays "
        f"Hugging Face's; fused=True asks for slothkit's fused path anyway.",
        stacklevel=5,  # the caller of FastModel.from_pretrained
    )


def takes_fused_path(model, arch, fused: bool | None) -> bool:
    """Whether to patch the fused path onto `model`: always with fused=True (refused for an
    architecture slothkit has no fused path for), never with fused=False, and with None
    where slothkit knows the architecture and its Triton kernels can run on the model's
    device.  Elsewhere (a CPU without the Triton interpreter) the kernels would run their
    plain-torch references, which compute the same numbers but are slower than the
    Hugging Face modules they replace, so the model keeps those."""
    if arch is None:
        if fused:
            raise ValueError(
                f"fused=True, but slothkit has no fused path for model_type "
                f"{model.config.model_type!r}; fused architectures: {supported_summary()}"
            )
        if fused is None:
            _warn_unsupported(model.config.model_type)
        return False
    if fused is not None:
        return fused
    device = next(model.parameters()).device
    if triton_runs_on(device):
        return True
    _notice_plain_path(device.type)
    return False


def link_tokenizer(model, tokenizer) -> None:
    """The model knows its tokenizer (slothkit.core.model_state) and the tokenizer its model
    (weakly: get_chat_template grows the embeddings without model=); generate takes
    apply_chat_template's dict (slothkit.inference.generation); apply_chat_template takes a
    datasets column of conversations and returns token ids as a list
    (slothkit.data.chat_template_calls); the model has vLLM's fast_generate
    (slothkit.inference.vllm_generate): glue for code written against transformers 4, datasets 3,
    vLLM and Unsloth."""
    attach_state(model).tokenizer = tokenizer
    link_model(tokenizer, model)
    accept_encoding_in_generate(model)
    accept_older_chat_template_calls(tokenizer)
    attach_vllm_methods(model)


def set_max_seq_length(model, max_seq_length: int, checked: bool = False) -> None:
    """Make ``max_seq_length`` the model's (its state, and Unsloth's
    ``model.max_seq_length`` for user code) and its tokenizer's, after checking it
    against the model's context unless ``checked``."""
    causal_lm = causal_lm_of(model)
    if not checked:
        check_max_seq_length(causal_lm.config, max_seq_length)
    causal_lm.max_seq_length = max_seq_length
    state = attach_state(causal_lm)
    state.max_seq_length = max_seq_length
    if state.tokenizer is not None:
        state.tokenizer.model_max_length = max_seq_length
