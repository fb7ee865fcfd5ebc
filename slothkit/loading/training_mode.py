"""The training/inference switch: set a PEFT model up to train (checkpointing, the save
and push methods), and move a model between training and generation.

    ready_for_training(peft_model, CheckpointingOptions("auto", max_memory=40))
    for_inference(model)   # eval mode, left padding, generate on the fast decode loop
    for_training(model)    # back: train mode, right padding, the decode cache freed

FastModel.get_peft_model, FastModel.for_training and FastModel.for_inference call these;
so does loading a saved adapter (slothkit.loading.saved_adapter).
"""

from __future__ import annotations

import dataclasses

from torch import nn

from slothkit.core.configuration import environment_defaults
from slothkit.core.inspection import causal_lm_of, is_4bit_model, text_tokenizer
from slothkit.core.model_state import attach_state, patched_module, state_of
from slothkit.engine.checkpointing.choice import enable_checkpointing
from slothkit.engine.checkpointing.recompute_policy import enable_recompute_policy
from slothkit.engine.decoder import decoder_layers
from slothkit.engine.experts import has_fused_experts
from slothkit.inference.generation import accept_encoding_in_generate
from slothkit.inference.vllm_generate import attach_vllm_methods
from slothkit.memory.memory_model import host_budget_bytes
from slothkit.models import architecture_named

CHECKPOINTING_CHOICES = ("offload", "auto", "unsloth", True, False)
_OFFLOADING = ("offload", "unsloth", "auto")


@dataclasses.dataclass(frozen=True)
class CheckpointingOptions:
    """get_peft_model's checkpointing options, which travel together (its docstring says
    what each means); checked when made.

    Attributes:
        mode: use_gradient_checkpointing: "offload", "auto", True or False ("unsloth" is
            read as "offload").
        cuda_graphs: with "offload", replay each layer from CUDA graphs; None: the default.
        keep_sums: with "offload", keep each layer's sum after attention (and its
            experts' forward); None: the default.
        max_memory: with "auto", the GPU memory budget (GiB or bytes).
        batch_size: with "auto", the per-device batch size, to decide now.
        max_host_memory: with "auto" or "offload", the host memory the offloaded inputs
            may pin (GiB or bytes).
    """

    mode: bool | str = "offload"
    cuda_graphs: bool | str | None = None
    keep_sums: bool | None = None
    max_memory: float | None = None
    batch_size: int | None = None
    max_host_memory: float | None = None

    def __post_init__(self) -> None:
        _check_mode(self.mode)
        _check_budget_options(self)

    @property
    def offloads(self) -> bool:
        return self.mode in _OFFLOADING


def _check_mode(mode) -> None:
    if not any(
        mode is choice or (isinstance(choice, str) and mode == choice) for choice in CHECKPOINTING_CHOICES
    ):
        raise ValueError(
            f"use_gradient_checkpointing={mode!r}; accepted: 'offload', 'auto', True, False "
            f"('unsloth' is read as 'offload')"
        )


def _check_budget_options(options: CheckpointingOptions) -> None:
    """Refuse the "auto" policy's options given without it (they would do nothing)."""
    given = [name for name in ("max_memory", "batch_size") if getattr(options, name) is not None]
    if options.max_host_memory is not None and not options.offloads:
        given.append("max_host_memory")
    if given and options.mode != "auto":
        raise ValueError(
            f"{' and '.join(given)} set the memory budget of use_gradient_checkpointing='auto' "
            f"(max_host_memory: of 'offload' too); "
            f"with use_gradient_checkpointing={options.mode!r} they do nothing: pass 'auto' or leave them out"
        )
    batch_size = options.batch_size
    if batch_size is not None and (
        isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0
    ):
        raise ValueError(
            f"batch_size={batch_size!r}; expected a positive integer (the per-device batch size)"
        )


def ready_for_training(peft_model, checkpointing: CheckpointingOptions = CheckpointingOptions()):
    """What get_peft_model (and loading a saved adapter) does after PEFT wraps the model:
    checkpointing, the save and push methods, training mode.

    Args:
        peft_model: the ``peft.PeftModel``.
        checkpointing: get_peft_model's checkpointing options.

    Returns:
        The same PeftModel, in training mode.
    """
    causal_lm, layers = decoder_layers(peft_model)
    causal_lm.config.use_cache = False
    _enable_checkpointing(causal_lm, layers, checkpointing)
    if checkpointing.mode:
        # Checkpointed layers recompute in backward; their input must require grad.
        causal_lm.enable_input_require_grads()
    if checkpointing.mode == "auto":
        _enable_recompute_policy(causal_lm, peft_model, layers, checkpointing)
    from slothkit.export import attach_export_methods

    attach_export_methods(peft_model)  # save_pretrained_merged, save_pretrained_gguf, push_to_hub_*
    accept_encoding_in_generate(peft_model)
    attach_vllm_methods(peft_model)  # fast_generate, save_lora, load_lora
    return for_training(peft_model)


def _asked_keep_sums(options: CheckpointingOptions) -> bool | None:
    """keep_sums as the user asked for it (the argument, else SLOTHKIT_KEEP_SUMS); None:
    the default."""
    return environment_defaults().keep_sums if options.keep_sums is None else options.keep_sums


def _enable_checkpointing(causal_lm, layers, options: CheckpointingOptions) -> None:
    defaults = environment_defaults()
    enable_checkpointing(
        layers,
        "offload" if options.mode == "auto" else options.mode,
        cuda_graphs=defaults.cuda_graphs if options.cuda_graphs is None else options.cuda_graphs,
        launch_bound=is_launch_bound(causal_lm),
        keep_sums=_layers_keep_sums(causal_lm) and _asked_keep_sums(options),
        host_limit_bytes=host_budget_bytes(options.max_host_memory) if options.offloads else None,
    )


def _layers_keep_sums(causal_lm) -> bool:
    """Whether the fused layers offer their sum after attention to the re-run: not Gemma 3's
    (Architecture.keeps_attention_sum). There the checkpointer is built not to keep, so that
    the "auto" policy's memory model counts no kept sums either."""
    state = state_of(causal_lm)
    fused = state is not None and state.architecture is not None
    return not fused or architecture_named(state.architecture).keeps_attention_sum


def is_launch_bound(causal_lm) -> bool:
    """Whether the host issuing kernels, not the GPU running them, limits a decoder layer on a
    fast GPU: 4-bit weights (a dequantisation per projection), per-head q/k RMSNorms (four
    more kernels each way per layer, Qwen3 and Qwen3-MoE, by record or on the generic path;
    Gemma 3 adds two more norms), or fused mixture-of-experts blocks (the router, its top-k
    and the routing's sort and tile schedule: about 25 more launches each way), which CUDA
    graphs replay without the host. Gemma 3's layers replay like the others: their extra
    norms and per-layer rotary tables and masks are tensors the graph reads (the CPU harness
    of tests/slothkit/engine/test_layer_graphs.py replays them). On an H100 a 12-layer
    Qwen3-30B-A3B step at 2 x 2048 took 0.210 s in 16-bit LoRA without graphs and 0.152 s
    in QLoRA with them (results/bench/h100-2026-12-06-qwen3-30b-a3b-12l-lora-no-autocast-
    760480a.json, ...-qlora-no-autocast-de6468a.json)."""
    if is_4bit_model(causal_lm) or has_fused_experts(causal_lm):
        return True
    layers = getattr(getattr(causal_lm, "model", None), "layers", None) or []
    for layer in layers:
        attention = getattr(layer, "self_attn", None)
        record = patched_module(attention) if isinstance(attention, nn.Module) else None
        if getattr(record, "qk_norm", False):
            return True
    return False


def _enable_recompute_policy(causal_lm, peft_model, layers, options: CheckpointingOptions) -> None:
    seq = attach_state(causal_lm).max_seq_length
    if options.batch_size is not None and seq is None:
        raise ValueError(
            f"batch_size={options.batch_size} needs the sequence length too: pass max_seq_length= "
            f"to get_peft_model (or leave batch_size out: the first training step decides)"
        )
    tokens = options.batch_size * seq if options.batch_size is not None else None
    enable_recompute_policy(
        causal_lm,
        peft_model,
        layers,
        options.max_memory,
        tokens,
        keeps_as_asked=_asked_keep_sums(options) is True,
    )


def for_training(model):
    """FastModel.for_training: train mode, no KV cache, the tokenizer padding on the right."""
    from slothkit.inference import disable_fast_decode

    disable_fast_decode(model)  # frees the decode cache and graph
    model.train()
    # A KV cache is of no use in training, and clashes with checkpointing.
    _use_cache(model, False)
    _pad_tokenizer(model, "right")
    return model


def for_inference(model, fast_decode: bool | None = None):
    """FastModel.for_inference: eval mode, the KV cache on, the tokenizer padding on the
    left, generate through the fast decode loop where it runs."""
    from slothkit.inference import enable_fast_decode

    model.eval()
    _use_cache(model, True)
    accept_encoding_in_generate(model)
    enable_fast_decode(model, fast_decode)
    _pad_tokenizer(model, "left")
    return model


def _use_cache(model, on: bool) -> None:
    """The KV cache on or off, in the model's config and its language model's (an
    image-text model's decoder layers read their text config)."""
    config = causal_lm_of(model).config
    config.use_cache = on
    if hasattr(config, "get_text_config"):
        config.get_text_config().use_cache = on


def _pad_tokenizer(model, side: str) -> None:
    state = state_of(model)
    if state is not None and state.tokenizer is not None:
        text_tokenizer(state.tokenizer).padding_side = side
