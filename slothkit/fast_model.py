"""FastModel: load a causal LM, add LoRA, and train it through the fused kernels.

    model, tokenizer = FastModel.from_pretrained("path/or/hub-id", load_in_4bit=True)
    model = FastModel.get_peft_model(model, r=16)

``get_peft_model`` returns a real ``peft.PeftModel``: it trains with the
Hugging Face Trainer and TRL, and ``save_pretrained`` writes a standard adapter.
The speed-ups are applied to the loaded instance only (slothkit.engine.decoder).
"""

from __future__ import annotations

import functools
import warnings

import torch

from slothkit.configuration import environment_defaults
from slothkit.data.chat_templates import link_model
from slothkit.distributed import device_map_for_process
from slothkit.engine.decoder import decoder_layers, patch_decoder
from slothkit.engine.inspection import causal_lm_of, is_4bit_model, is_sequence_classifier
from slothkit.engine.loading import (
    ALL_PROJECTIONS,
    check_max_seq_length,
    extend_context,
    linear_module_leaves,
    matching_modules,
    nf4_settings,
    pick_dtype,
    require_bitsandbytes,
    resolve_checkpoint,
)
from slothkit.engine.nf4_layout import keep_nf4_layout
from slothkit.engine.offload_checkpoint import enable_checkpointing
from slothkit.engine.recompute_policy import enable_recompute_policy
from slothkit.generation import accept_encoding_in_generate
from slothkit.memory_model import host_budget_bytes
from slothkit.model_state import attach_state, state_of
from slothkit.models import architecture_for, supported_summary
from slothkit.notices import say_once
from slothkit.saved_adapter import is_adapter_folder, load_saved_adapter
from slothkit_kernels.utils import triton_runs_on


@functools.cache
def _warn_unsupported(model_type: str) -> None:
    warnings.warn(
        f"slothkit has no fused path for model_type {model_type!r}; it will train through the "
        f"plain Hugging Face + PEFT path. Fused architectures: {supported_summary()}.",
        stacklevel=3,
    )


@functools.cache
def _notice_plain_path(device_type: str) -> None:
    warnings.warn(
        f"slothkit: Triton cannot run on the {device_type}, so the model keeps its Hugging Face "
        f"modules (faster there than the fused kernels' torch references) and generate stays "
        f"Hugging Face's; fused=True asks for slothkit's fused path anyway.",
        stacklevel=4,  # the caller of FastModel.from_pretrained
    )


def _check_fused_argument(fused) -> None:
    if fused not in (None, True, False):
        raise ValueError(f"fused={fused!r}; accepted: None (automatic), True or False")


def _takes_fused_path(model, arch, fused: bool | None) -> bool:
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


class FastModel:
    """Namespace for the loading and LoRA entry points (mirrors Unsloth's API)."""

    @staticmethod
    def from_pretrained(
        model_name: str,
        max_seq_length: int = 2048,
        dtype: torch.dtype | str | None = None,
        load_in_4bit: bool = True,
        device_map=None,
        token: str | None = None,
        attn_implementation: str = "sdpa",
        fused: bool | None = None,
        load_in_8bit: bool = False,
        full_finetuning: bool = False,
        fast_inference: bool = False,
        num_labels: int | None = None,
        **hf_kwargs,
    ):
        """Load a causal LM and its tokenizer, with the fused kernels patched onto the
        instance when slothkit knows its architecture (else a warning, and the plain
        Hugging Face path); with ``num_labels``, the same checkpoint as a sequence
        classifier (a reward model, with num_labels=1).

        Args:
            model_name: a local checkpoint directory (config.json, weights and a
                tokenizer) or a Hugging Face Hub id.
            max_seq_length: the longest sequence to train on (default 2048).  Beyond
                the model's ``max_position_embeddings`` (up to 16 times it) RoPE is
                scaled linearly to reach it, said once.  Set on the model and as the
                tokenizer's ``model_max_length``.
            dtype: torch.float32, torch.float16, torch.bfloat16 or one of the names
                "float32"/"fp32", "float16"/"fp16"/"half", "bfloat16"/"bf16".  None
                (default): bf16 where the GPU supports it, fp16 on T4/V100-class GPUs,
                fp32 on the CPU.  For a 4-bit model, the dtype it computes in.
            load_in_4bit: load NF4 weights with double quantisation through
                bitsandbytes (default True; needs bitsandbytes).  A checkpoint already
                quantised loads as it is, whatever this says.
            device_map: passed to transformers; None (default) puts the whole model on
                the current GPU (under torchrun or accelerate launch, the GPU of this
                process's LOCAL_RANK, made current: slothkit.distributed), or leaves it
                on the CPU when there is none.
            token: a Hugging Face token, for gated or private Hub models (default
                None).
            attn_implementation: transformers' attention, "sdpa" (default), "eager"
                or another it accepts.
            fused: whether to route the model through slothkit's fused kernels.
                None (default): where slothkit knows the architecture and Triton can
                run on the model's device (a CUDA GPU, or the CPU under
                TRITON_INTERPRET=1); elsewhere the plain Hugging Face path, which is
                faster there, with a one-line notice.  True: always (on a CPU the
                kernels then run their torch references); False: never.
            load_in_8bit: False (default); True is refused: slothkit's kernels read 16-bit
                or 4-bit NF4 weights.
            full_finetuning: False (default); True is refused: slothkit trains LoRA
                adapters (get_peft_model).
            fast_inference: accepted and ignored (said once) until slothkit has a fast
                decode path; so are the vLLM options that come with it
                (gpu_memory_utilization, max_lora_rank).
            num_labels: None (default): a causal LM.  A positive integer: the checkpoint's
                decoder with a linear score head of that many outputs
                (``AutoModelForSequenceClassification``), read at each sequence's last
                token that is not padding; the head is new (random) unless the
                checkpoint has one.  num_labels=1 is a reward model
                (slothkit.trainers.reward_trainer).  The decoder runs slothkit's fused
                layers as a causal LM's does; ``get_peft_model`` then trains the head in
                full beside the adapters, and the saved adapter holds it.
            **hf_kwargs: passed on to ``AutoModelForCausalLM.from_pretrained`` (or
                ``AutoModelForSequenceClassification``'s).

        A folder holding a saved LoRA adapter (adapter_config.json, no config.json) loads
        the base model its adapter_config.json names, with these settings, and the adapter
        onto it, trainable: a ``peft.PeftModel`` as ``get_peft_model`` returns, with the
        folder's tokenizer when it holds one (slothkit.saved_adapter).

        Returns:
            ``(model, tokenizer)``: the transformers model and its tokenizer, which pads
            on the right and has a pad token (its unk or EOS token when it had none).

        Raises:
            FileNotFoundError: no such checkpoint, or it has no usable tokenizer.
            ValueError: ``max_seq_length``, ``dtype`` or ``num_labels`` is not accepted.
            ImportError: ``load_in_4bit`` without bitsandbytes installed.
        """
        from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

        _check_fused_argument(fused)
        _check_num_labels(num_labels)
        _check_loading_options(load_in_8bit, full_finetuning, fast_inference, hf_kwargs)
        if is_adapter_folder(model_name):
            return load_saved_adapter(
                model_name,
                max_seq_length=max_seq_length,
                dtype=dtype,
                load_in_4bit=load_in_4bit,
                device_map=device_map,
                token=token,
                attn_implementation=attn_implementation,
                fused=fused,
                num_labels=num_labels,
                **hf_kwargs,
            )
        if device_map is None:
            # Under torchrun: this process's GPU, made current before anything here starts
            # CUDA (pick_dtype, bitsandbytes), which would put a context on GPU 0.
            device_map = device_map_for_process()
        config = resolve_checkpoint(model_name, token=token)
        if extend_context(config, max_seq_length):
            hf_kwargs["config"] = config
        dtype = pick_dtype(dtype)

        try:
            tokenizer = AutoTokenizer.from_pretrained(model_name, token=token)
        except (OSError, ValueError, TypeError) as error:
            raise FileNotFoundError(
                f"{model_name!r} has no usable tokenizer (tokenizer.json or tokenizer.model "
                f"with tokenizer_config.json); save one with the checkpoint "
                f"(underlying error: {error})"
            ) from None

        already_quantized = getattr(config, "quantization_config", None) is not None
        quantization_config = None
        if load_in_4bit or already_quantized:
            require_bitsandbytes()
        if load_in_4bit and not already_quantized:
            quantization_config = BitsAndBytesConfig(**nf4_settings(dtype))

        if num_labels is not None:
            from transformers import AutoModelForSequenceClassification

            auto_class, hf_kwargs = (
                AutoModelForSequenceClassification,
                {**hf_kwargs, "num_labels": num_labels},
            )
        else:
            auto_class = AutoModelForCausalLM
        model = auto_class.from_pretrained(
            model_name,
            dtype=dtype,
            quantization_config=quantization_config,
            device_map=device_map,
            token=token,
            attn_implementation=attn_implementation,
            **hf_kwargs,
        )
        # bitsandbytes would repack 4-bit weights for its CPU kernels at the first
        # eval-mode forward on an AVX512-BF16 CPU, changing the numbers (engine/nf4_layout.py).
        keep_nf4_layout(model)
        model.max_seq_length = max_seq_length  # Unsloth's attribute, for user code
        attach_state(model).max_seq_length = max_seq_length
        tokenizer.model_max_length = max_seq_length
        tokenizer.padding_side = "right"
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.unk_token or tokenizer.eos_token
        if num_labels is not None:
            # The classifier reads the last token before the first pad of each row.
            model.config.pad_token_id = tokenizer.pad_token_id

        arch = architecture_for(model.config)
        if _takes_fused_path(model, arch, fused):
            patch_decoder(model, arch)
        _link_instances(model, tokenizer)
        return model, tokenizer

    @staticmethod
    def get_peft_model(
        model,
        r: int = 16,
        target_modules=None,
        lora_alpha: int = 16,
        lora_dropout: float = 0.0,
        bias: str = "none",
        use_gradient_checkpointing="offload",
        random_state: int = 3407,
        use_rslora: bool = False,
        modules_to_save=None,
        cuda_graphs: bool | str | None = None,
        keep_sums: bool | None = None,
        max_seq_length: int | None = None,
        max_memory: float | None = None,
        batch_size: int | None = None,
        max_host_memory: float | None = None,
        **lora_kwargs,
    ):
        """Add LoRA adapters and set up checkpointing; return a ``peft.PeftModel`` ready
        to train, with the save and push methods (``save_pretrained_merged``,
        ``push_to_hub_merged``, and the GGUF ones when installed) attached.

        Args:
            model: a model from ``FastModel.from_pretrained`` (or any transformers
                causal LM); not already a PeftModel.
            r: the LoRA rank, a positive integer (default 16) no larger than the
                smallest in or out width of the adapted layers.
            target_modules: the names of the linear layers to adapt (each must name
                some layer), one name, or "all-linear" (PEFT's value: every linear layer
                but the output head); None (default): all seven projections, q/k/v/o_proj
                and gate/up/down_proj.
            lora_alpha: the LoRA scale's numerator, a positive number: the update is
                scaled by lora_alpha / r (default 16).
            lora_dropout: dropout on the adapters' input (default 0.0; above 0 the
                fused kernels fall back to PEFT's path for those layers).
            bias: which biases train: "none" (default), "all" or "lora_only".
            use_gradient_checkpointing: "offload" (default: each layer's input is
                kept in pinned host memory, slothkit.engine.offload_checkpoint), "auto"
                (as many of the last layers as fit the memory budget are not
                checkpointed, the others offloaded; slothkit.engine.recompute_policy,
                said in one line), True (torch's checkpoint, inputs kept on the GPU) or
                False (none).
            random_state: the seed of the adapters' initialisation (default 3407).
            use_rslora: scale by lora_alpha / sqrt(r) instead (default False).
            modules_to_save: modules trained in full and saved with the adapter, such
                as ["embed_tokens", "lm_head"] after adding tokens (default None).  A
                sequence classifier's score head is always among them.
            cuda_graphs: with "offload", replay each decoder layer from CUDA graphs:
                True for its forward and its recompute with backward, "forward" for the
                forward only, False for neither.  None (default): the
                SLOTHKIT_CUDA_GRAPHS environment variable if set, else both for 4-bit
                models on GPUs of compute capability 8.0 and up, and none for 16-bit
                models, older GPUs and the CPU (docs/configuration.md).
            keep_sums: with "offload", keep each layer's residual sum after attention
                in pinned host memory for its recompute, which then skips o_proj.  None
                (default): the SLOTHKIT_KEEP_SUMS environment variable if set, else on
                for GPUs of compute capability 8.0 and up, off for older ones and the
                CPU.
            max_seq_length: None (default): the one from_pretrained was given; else the new
                longest sequence to train on, checked and set as from_pretrained does.
            max_memory: with "auto", the memory budget: GiB (e.g. 40), or bytes from
                2**20 up.  None (default): the GPU's free memory plus what this process
                already holds, less 5 %.
            batch_size: with "auto", the batch size training will use: the policy then
                decides now, for batch_size x max_seq_length tokens per step.  None
                (default): it decides at the first training step, from its shape, and
                again when a step with more tokens comes.
            max_host_memory: with "auto" or "offload", the host memory the offloaded
                layers' inputs may pin: GiB or bytes.  None (default): the host's
                available memory less 10 %.  The layers it cannot take are checkpointed
                on the GPU ("auto" plans for it; "offload" keeps the next layers'
                inputs on the GPU once it is spent, said once).
            **lora_kwargs: passed on to ``peft.LoraConfig``.

        Returns:
            The ``peft.PeftModel``, in training mode.

        Raises:
            ValueError: an argument is not accepted (the message says what is), or a
                SLOTHKIT_* variable is set to a value it does not accept.
            slothkit.memory_model.MemoryBudgetError: with "auto" and batch_size, the
                step does not fit the budget even with every layer offloaded (the
                message gives the least it needs).
        """
        from peft import LoraConfig, PeftModel, get_peft_model

        if isinstance(model, PeftModel):
            raise ValueError("this model already has LoRA adapters (it is a PeftModel)")
        if not isinstance(r, int) or r <= 0:
            raise ValueError(f"r={r!r}; expected a positive integer rank such as 8, 16 or 32")
        target_modules = _lora_targets(target_modules)
        if target_modules != ALL_LINEAR:
            target_modules, modules_to_save = _embeddings_trained_in_full(target_modules, modules_to_save)
        _check_lora_shape(model, target_modules, r, lora_alpha)
        if bias not in ("none", "all", "lora_only"):
            raise ValueError(f"bias={bias!r}; accepted: 'none', 'all', 'lora_only'")
        _check_checkpointing(use_gradient_checkpointing, max_memory, batch_size, max_host_memory)
        if max_seq_length is not None:
            _set_max_seq_length(model, max_seq_length)

        torch.manual_seed(random_state)
        config = LoraConfig(
            r=r,
            lora_alpha=lora_alpha,
            lora_dropout=lora_dropout,
            bias=bias,
            target_modules=target_modules,
            use_rslora=use_rslora,
            modules_to_save=modules_to_save,
            # SEQ_CLS: PEFT trains the score head in full (modules_to_save) and saves it.
            task_type="SEQ_CLS" if is_sequence_classifier(model) else "CAUSAL_LM",
            **lora_kwargs,
        )
        with warnings.catch_warnings():
            # PEFT reads transformers' deprecated ``is_gradient_checkpointing``: a
            # FutureWarning between two other libraries that no user of slothkit can act on.
            warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated")
            peft_model = get_peft_model(model, config)
        return ready_for_training(
            peft_model,
            model,
            use_gradient_checkpointing,
            cuda_graphs,
            keep_sums,
            max_memory,
            batch_size,
            max_host_memory,
        )

    @staticmethod
    def for_training(model):
        """Put the model in training mode with the KV cache off, and its tokenizer (when
        it came from FastModel) back to padding on the right.

        Args:
            model: a model from ``FastModel.from_pretrained`` or ``get_peft_model``.

        Returns:
            The same model.
        """
        from slothkit.inference import disable_fast_decode

        disable_fast_decode(model)  # frees the decode cache and graph
        model.train()
        causal_lm, _ = decoder_layers(model)
        causal_lm.config.use_cache = (
            False  # a KV cache is of no use in training, and clashes with checkpointing
        )
        tokenizer = _tokenizer_of(model)
        if tokenizer is not None:
            tokenizer.padding_side = "right"
        return model

    @staticmethod
    def for_inference(model, fast_decode: bool | None = None):
        """Put the model in evaluation mode with the KV cache on, its tokenizer (when it
        came from FastModel) to padding on the left, as batched generation wants, and its
        ``generate`` on slothkit's fast decode loop (slothkit.inference: a static KV cache
        and the decode step captured as a CUDA graph; LoRA adapters and 4-bit weights
        applied as in training, nothing merged).  ``for_training`` goes back to training
        mode and right padding, and frees the decode cache.

        Args:
            model: a model from ``FastModel.from_pretrained`` or ``get_peft_model``.
            fast_decode: None: the fast loop on a CUDA GPU (compute capability 7.0 or
                newer) for Llama, Mistral and Gemma, else Hugging Face's generate with a
                one-line notice; True: the fast loop on a CPU too (no graph: for
                checking); False: Hugging Face's generate.

        Returns:
            The same model.
        """
        from slothkit.inference import enable_fast_decode

        model.eval()
        causal_lm, _ = decoder_layers(model)
        causal_lm.config.use_cache = True
        accept_encoding_in_generate(model)
        enable_fast_decode(model, fast_decode)
        tokenizer = _tokenizer_of(model)
        if tokenizer is not None:
            tokenizer.padding_side = "left"
        return model


FastLanguageModel = FastModel


def ready_for_training(
    peft_model,
    model,
    use_gradient_checkpointing="offload",
    cuda_graphs=None,
    keep_sums=None,
    max_memory=None,
    batch_size=None,
    max_host_memory=None,
):
    """What get_peft_model (and loading a saved adapter) does after PEFT wraps the model:
    checkpointing, the tokenizer link, the save and push methods, training mode.

    Args:
        peft_model: the ``peft.PeftModel``.
        model: the model it wraps, as from_pretrained returned it.
        use_gradient_checkpointing: as get_peft_model.
        cuda_graphs: as get_peft_model.
        keep_sums: as get_peft_model.
        max_memory: as get_peft_model.
        batch_size: as get_peft_model.
        max_host_memory: as get_peft_model.

    Returns:
        The same PeftModel, in training mode.
    """
    _check_checkpointing(use_gradient_checkpointing, max_memory, batch_size, max_host_memory)
    causal_lm, layers = decoder_layers(peft_model)
    causal_lm.config.use_cache = False
    defaults = environment_defaults()
    auto = use_gradient_checkpointing == "auto"
    offloads = auto or use_gradient_checkpointing in ("offload", "unsloth")
    enable_checkpointing(
        layers,
        "offload" if auto else use_gradient_checkpointing,
        cuda_graphs=defaults.cuda_graphs if cuda_graphs is None else cuda_graphs,
        quantized=is_4bit_model(causal_lm),
        keep_sums=defaults.keep_sums if keep_sums is None else keep_sums,
        host_limit_bytes=host_budget_bytes(max_host_memory) if offloads else None,
    )
    if use_gradient_checkpointing:
        # Checkpointed layers recompute in backward; their input must require grad.
        causal_lm.enable_input_require_grads()
    if auto:
        seq = attach_state(causal_lm).max_seq_length
        if batch_size is not None and seq is None:
            raise ValueError(
                f"batch_size={batch_size} needs the sequence length too: pass max_seq_length= "
                f"to get_peft_model (or leave batch_size out: the first training step decides)"
            )
        tokens = batch_size * seq if batch_size is not None else None
        enable_recompute_policy(causal_lm, peft_model, layers, max_memory, tokens)
    from slothkit.export import attach_export_methods

    attach_export_methods(peft_model)  # save_pretrained_merged, save_pretrained_gguf, push_to_hub_*
    accept_encoding_in_generate(peft_model)
    FastModel.for_training(peft_model)
    return peft_model


CHECKPOINTING_CHOICES = ("offload", "auto", "unsloth", True, False)


def _check_checkpointing(mode, max_memory, batch_size, max_host_memory=None) -> None:
    """Refuse a use_gradient_checkpointing slothkit does not know, and the "auto"
    policy's options given without it (they would do nothing)."""
    if not any(
        mode is choice or (isinstance(choice, str) and mode == choice) for choice in CHECKPOINTING_CHOICES
    ):
        raise ValueError(
            f"use_gradient_checkpointing={mode!r}; accepted: 'offload', 'auto', True, False "
            f"('unsloth' is read as 'offload')"
        )
    given = [
        name for name, value in (("max_memory", max_memory), ("batch_size", batch_size)) if value is not None
    ]
    if max_host_memory is not None and mode not in ("offload", "unsloth", "auto"):
        given.append("max_host_memory")
    if given and mode != "auto":
        raise ValueError(
            f"{' and '.join(given)} set the memory budget of use_gradient_checkpointing='auto' "
            f"(max_host_memory: of 'offload' too); "
            f"with use_gradient_checkpointing={mode!r} they do nothing: pass 'auto' or leave them out"
        )
    if batch_size is not None and (
        isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0
    ):
        raise ValueError(
            f"batch_size={batch_size!r}; expected a positive integer (the per-device batch size)"
        )


# vLLM settings that older notebooks pass with fast_inference=True.
_FAST_INFERENCE_OPTIONS = ("gpu_memory_utilization", "max_lora_rank", "float8_kv_cache")


def _check_num_labels(num_labels) -> None:
    if num_labels is not None and (
        isinstance(num_labels, bool) or not isinstance(num_labels, int) or num_labels < 1
    ):
        raise ValueError(
            f"num_labels={num_labels!r}; accepted: None (a causal LM) or a positive integer, the outputs of a "
            "sequence classifier's score head (1 for a reward model)"
        )


def _check_loading_options(load_in_8bit, full_finetuning, fast_inference, hf_kwargs: dict) -> None:
    """Refuse what slothkit cannot do, in one line each; drop (saying once) the fast
    inference options it does not use yet."""
    if load_in_8bit:
        raise ValueError(
            "load_in_8bit=True is not supported: slothkit's kernels read 16-bit or 4-bit NF4 weights; "
            "use load_in_4bit=True (QLoRA) or load_in_4bit=False (16-bit LoRA)"
        )
    if full_finetuning:
        raise ValueError(
            "full_finetuning=True is not supported: slothkit trains LoRA adapters; load with "
            "full_finetuning=False and call FastModel.get_peft_model (a high r comes closest)"
        )
    given = [name for name in _FAST_INFERENCE_OPTIONS if name in hf_kwargs]
    for name in given:
        hf_kwargs.pop(name)
    if fast_inference or given:
        say_once(
            "from_pretrained(fast_inference=True"
            + "".join(f", {name}=..." for name in given)
            + ") is ignored: slothkit has no vLLM decode path yet, and generate runs through transformers"
        )


_EMBEDDING_MODULES = ("embed_tokens", "lm_head")


ALL_LINEAR = "all-linear"  # PEFT's target_modules value for every linear layer but the head


def _lora_targets(target_modules):
    """target_modules as PEFT takes it: a list of names, or "all-linear" as it is (a string
    is not split into characters)."""
    if target_modules is None:
        return list(ALL_PROJECTIONS)
    if isinstance(target_modules, str):
        return ALL_LINEAR if target_modules == ALL_LINEAR else [target_modules]
    return list(target_modules)


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


def _check_lora_shape(model, target_modules, r: int, lora_alpha) -> None:
    """Refuse LoRA settings that would train silently wrong: a target name that matches no
    layer, an alpha that scales the update to nothing (or flips it), and a rank above
    min(in, out) of an adapted layer: B @ A then has no more rank than at min(in, out),
    only more parameters."""
    if isinstance(lora_alpha, bool) or not isinstance(lora_alpha, (int, float)) or not lora_alpha > 0:
        raise ValueError(
            f"lora_alpha={lora_alpha!r}; expected a positive number (the update is scaled by lora_alpha / r: "
            f"0 trains adapters with no effect), e.g. 16, or 2 * r"
        )
    if target_modules != ALL_LINEAR:
        unknown = [name for name in target_modules if not matching_modules(model, [name])]
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
    widths = [min(m.in_features, m.out_features) for m in _adapted_linears(model, target_modules)]
    if widths and r > min(widths):
        raise ValueError(
            f"r={r} exceeds {min(widths)}, the smallest min(in_features, out_features) of the adapted "
            f"layers: a LoRA update B @ A cannot have a higher rank than that, so the extra parameters "
            f"add memory and nothing else; use r <= {min(widths)}"
        )


def _embeddings_trained_in_full(target_modules: list, modules_to_save):
    """Older notebooks list embed_tokens and lm_head in target_modules for continued
    pretraining, meaning "train them in full"; PEFT's spelling of that is modules_to_save
    (an adapter on them would be a low-rank update instead)."""
    named = [name for name in _EMBEDDING_MODULES if name in target_modules]
    if not named:
        return target_modules, modules_to_save
    say_once(
        f"get_peft_model(target_modules=[..., {', '.join(map(repr, named))}]) is written "
        f"modules_to_save={named!r} in PEFT: they are trained in full, not through an adapter"
    )
    saved = list(modules_to_save or [])
    return [m for m in target_modules if m not in named], saved + [m for m in named if m not in saved]


def _set_max_seq_length(model, max_seq_length: int) -> None:
    causal_lm = causal_lm_of(model)
    check_max_seq_length(causal_lm.config, max_seq_length)
    causal_lm.max_seq_length = max_seq_length  # Unsloth's attribute, for user code
    state = attach_state(causal_lm)
    state.max_seq_length = max_seq_length
    tokenizer = state.tokenizer
    if tokenizer is not None:
        tokenizer.model_max_length = max_seq_length


def _link_instances(model, tokenizer) -> None:
    """Instance-level glue for code written against transformers 4 and Unsloth: the
    tokenizer knows its model (so get_chat_template can grow the embeddings without
    model=), the model its tokenizer (slothkit.model_state), and generate takes
    apply_chat_template's dict (slothkit.generation)."""
    attach_state(model).tokenizer = tokenizer
    link_model(tokenizer, model)
    accept_encoding_in_generate(model)


def _tokenizer_of(model):
    state = state_of(model)
    return state.tokenizer if state is not None else None
