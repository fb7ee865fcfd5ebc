"""FastModel: load a causal LM, add LoRA, and train it through the fused kernels.

    model, tokenizer = FastModel.from_pretrained("path/or/hub-id", load_in_4bit=True)
    model = FastModel.get_peft_model(model, r=16)

``get_peft_model`` returns a real ``peft.PeftModel``: it trains with the
Hugging Face Trainer and TRL, and ``save_pretrained`` writes a standard adapter.
The speed-ups are applied to the loaded instance only (slothkit.engine.decoder).
"""

from __future__ import annotations

import torch

from slothkit.compat.unsloth_options import check_loading_options, targets_from_layer_flags
from slothkit.loading import training_mode
from slothkit.loading.load_model import LoadOptions, load_model
from slothkit.loading.lora_setup import LoraSettings, add_lora
from slothkit.loading.saved_adapter import is_adapter_folder, load_saved_adapter
from slothkit.loading.training_mode import CheckpointingOptions, ready_for_training


class FastModel:
    """Namespace for the loading and LoRA entry points (mirrors Unsloth's API): each
    gathers its keywords into the options of one concern and hands them on
    (slothkit.loading.load_model, slothkit.loading.lora_setup, slothkit.loading.training_mode,
    slothkit.compat.unsloth_options)."""

    @staticmethod
    def from_pretrained(
        model_name: str,
        max_seq_length: int = 2048,
        dtype: torch.dtype | str | None = None,
        load_in_4bit: bool = True,
        device_map=None,
        token: str | None = None,
        attn_implementation: str | None = None,
        fused: bool | None = None,
        load_in_8bit: bool = False,
        full_finetuning: bool = False,
        fast_inference: bool = False,
        num_labels: int | None = None,
        allow_other_base: bool = False,
        **hf_kwargs,
    ):
        """Load a causal LM and its tokenizer, with the fused kernels patched onto the
        instance when slothkit knows its architecture (else the generic path, said once:
        Hugging Face's modules, and the fused loss on the head where it is the model's
        own, slothkit.engine.generic_head); with ``num_labels``, the same checkpoint as a sequence
        classifier (a reward model, with num_labels=1).

        Args:
            model_name: a local checkpoint directory (config.json, weights and a
                tokenizer) or a Hugging Face Hub id.
            max_seq_length: the longest sequence to train on (default 2048; None: the
                model's own context, config.max_position_embeddings).  Beyond
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
                process's LOCAL_RANK, made current: slothkit.core.distributed), or leaves it
                on the CPU when there is none.
            token: a Hugging Face token, for gated or private Hub models (default
                None).
            attn_implementation: transformers' attention, "sdpa", "eager" or another
                it accepts, taken as given. None (default): "sdpa" where the model's class
                runs it, else "eager", said once (Gemma 2, whose attention scores are
                soft-capped).
            fused: whether to route the model through slothkit's fused kernels.
                None (default): where slothkit knows the architecture and Triton can
                run on the model's device (a CUDA GPU, or the CPU under
                TRITON_INTERPRET=1); elsewhere the plain Hugging Face path, which is
                faster there, with a one-line notice.  For an architecture without a
                record, None fuses the loss on a CUDA GPU only.  True: always (on a CPU
                the kernels then run their torch references; without a record, the loss,
                or an error saying why it cannot be); False: never.
            load_in_8bit: False (default); True is refused: slothkit's kernels read 16-bit
                or 4-bit NF4 weights.
            full_finetuning: False (default); True is refused: slothkit trains LoRA
                adapters (get_peft_model).
            fast_inference: accepted (said once): the models slothkit returns always
                have vLLM's ``fast_generate`` (and ``save_lora`` / ``load_lora`` after
                get_peft_model: slothkit.inference.vllm_generate), without a vLLM engine; the vLLM
                options that come with it (gpu_memory_utilization, max_lora_rank) are
                unused.
            num_labels: None (default): a causal LM.  A positive integer: the checkpoint's
                decoder with a linear score head of that many outputs
                (``AutoModelForSequenceClassification``), read at each sequence's last
                token that is not padding; the head is new (random) unless the
                checkpoint has one.  num_labels=1 is a reward model
                (slothkit.trl.RewardTrainer).  The decoder runs slothkit's fused
                layers as a causal LM's does; ``get_peft_model`` then trains the head in
                full beside the adapters, and the saved adapter holds it.
            allow_other_base: for a saved adapter folder: load it onto its base even
                when the base's weights are not those the adapter recorded it was trained
                on (slothkit.export.base_fingerprint); default False: refused.
            **hf_kwargs: passed on to ``AutoModelForCausalLM.from_pretrained`` (or
                ``AutoModelForSequenceClassification``'s).

        A folder holding a saved LoRA adapter (adapter_config.json, no config.json) loads
        the base model its adapter_config.json names, with these settings, and the adapter
        onto it, trainable: a ``peft.PeftModel`` as ``get_peft_model`` returns, with the
        folder's tokenizer when it holds one (slothkit.loading.saved_adapter).

        Returns:
            ``(model, tokenizer)``: the transformers model and its tokenizer, which pads
            on the right and has a pad token (its unk or EOS token when it had none).

        Raises:
            FileNotFoundError: no such checkpoint, or it has no usable tokenizer.
            ValueError: ``max_seq_length``, ``dtype`` or ``num_labels`` is not accepted;
                the checkpoint lacks tensors or holds NaN or Inf (slothkit.checkpoint.loaded_weights);
                a saved adapter's base holds other weights than it was trained on.
            ImportError: ``load_in_4bit`` without bitsandbytes installed.
        """
        check_loading_options(load_in_8bit, full_finetuning, fast_inference, hf_kwargs)
        options = LoadOptions(
            max_seq_length=max_seq_length, dtype=dtype, load_in_4bit=load_in_4bit, device_map=device_map,
            token=token, attn_implementation=attn_implementation, fused=fused, num_labels=num_labels,
            hf_kwargs=hf_kwargs,
        )  # fmt: skip
        if is_adapter_folder(model_name):
            return load_saved_adapter(model_name, options, allow_other_base=allow_other_base)
        return load_model(model_name, options)

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
                kept in pinned host memory, slothkit.engine.checkpointing.offload_checkpoint), "auto"
                (as many of the last layers as fit the memory budget are not
                checkpointed, the others offloaded; slothkit.engine.checkpointing.recompute_policy,
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
                in pinned host memory for its recompute, which then skips o_proj (and a
                mixture-of-experts layer's experts' forward, so that the recompute runs
                none of their products).  None
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
            **lora_kwargs: passed on to ``peft.LoraConfig``, except Unsloth's
                finetune_attention_modules and finetune_mlp_modules (False: those
                projections get no adapter), finetune_language_layers and
                finetune_vision_layers (FastModel loads text models: language layers
                only; slothkit.compat.unsloth_options; FastVisionModel adapts the
                vision layers of an image-text model).

        Returns:
            The ``peft.PeftModel``, in training mode.

        Raises:
            ValueError: an argument is not accepted (the message says what is), or a
                SLOTHKIT_* variable is set to a value it does not accept.
            slothkit.memory.memory_model.MemoryBudgetError: with "auto" and batch_size, the
                step does not fit the budget even with every layer offloaded (the
                message gives the least it needs).
        """
        checkpointing = CheckpointingOptions(
            mode=use_gradient_checkpointing, cuda_graphs=cuda_graphs, keep_sums=keep_sums,
            max_memory=max_memory, batch_size=batch_size, max_host_memory=max_host_memory,
        )  # fmt: skip
        target_modules = targets_from_layer_flags(target_modules, lora_kwargs)  # Unsloth's finetune_* flags
        lora = LoraSettings(
            r=r, target_modules=target_modules, lora_alpha=lora_alpha, lora_dropout=lora_dropout, bias=bias,
            random_state=random_state, use_rslora=use_rslora, modules_to_save=modules_to_save, extra=lora_kwargs,
        )  # fmt: skip
        return ready_for_training(add_lora(model, lora, max_seq_length), checkpointing)

    @staticmethod
    def for_training(model):
        """Put the model in training mode with the KV cache off, and its tokenizer (when
        it came from FastModel) back to padding on the right.

        Args:
            model: a model from ``FastModel.from_pretrained`` or ``get_peft_model``.

        Returns:
            The same model.
        """
        return training_mode.for_training(model)

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
                newer) for the fused families (slothkit.models.ARCHITECTURES), else
                Hugging Face's generate with a one-line notice; True: the fast loop on a CPU too (no graph: for
                checking); False: Hugging Face's generate.

        Returns:
            The same model.
        """
        return training_mode.for_inference(model, fast_decode)


FastLanguageModel = FastModel

# Unsloth's per-family loader names (its tool-calling and older notebooks import them):
# the same loader, which reads the family from the checkpoint.
FastLlamaModel = FastModel
FastMistralModel = FastModel
FastGemmaModel = FastModel
FastGemma2Model = FastModel
FastQwen2Model = FastModel
FastQwen3Model = FastModel
