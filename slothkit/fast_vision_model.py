"""FastVisionModel: load an image-text model with its processor, add LoRA to its vision
and language layers, and train it on images and text.

    model, processor = FastVisionModel.from_pretrained("path/or/hub-id", load_in_4bit=True)
    model = FastVisionModel.get_peft_model(model, finetune_vision_layers=False, r=16)

``get_peft_model`` returns a real ``peft.PeftModel``; ``slothkit.VisionDataCollator`` turns
chat messages with images into its batches for TRL's SFTTrainer.
"""

from __future__ import annotations

import torch

from slothkit.compat.unsloth_options import check_loading_options
from slothkit.core.notices import FallbackWarning, say_once
from slothkit.loading import training_mode
from slothkit.loading.load_model import LoadOptions
from slothkit.loading.lora_setup import LoraSettings
from slothkit.loading.saved_adapter import is_adapter_folder
from slothkit.loading.saved_vision_adapter import load_saved_vision_adapter
from slothkit.loading.training_mode import CheckpointingOptions
from slothkit.loading.vision_lora import VisionTargets, add_vision_lora, ready_vision_model
from slothkit.loading.vision_model import image_text_config, load_processor, load_vision_model


class FastVisionModel:
    """Namespace for the image-text entry points (Unsloth's FastVisionModel API); each
    gathers its keywords into the options of one concern and hands them on
    (slothkit.loading.vision_model, slothkit.loading.vision_lora, slothkit.loading.training_mode)."""

    @staticmethod
    def from_pretrained(
        model_name: str,
        max_seq_length: int | None = 2048,
        dtype: torch.dtype | str | None = None,
        load_in_4bit: bool = True,
        device_map=None,
        token: str | None = None,
        attn_implementation: str | None = None,
        use_gradient_checkpointing="offload",
        load_in_8bit: bool = False,
        full_finetuning: bool = False,
        fused: bool | None = None,
        **hf_kwargs,
    ):
        """Load the whole image-text model (``AutoModelForImageTextToText``: vision tower,
        projector, language model) and its processor.

        Args:
            model_name: a local checkpoint directory (config.json with a vision_config,
                weights, the processor's files) or a Hugging Face Hub id; or a folder
                holding a saved LoRA adapter (adapter_config.json, no config.json): the
                base its adapter_config.json names loads with these settings and the
                adapter onto it, trainable, with the folder's processor where it holds
                one (slothkit.loading.saved_vision_adapter).
            max_seq_length: the longest sequence to train on, image tokens included
                (default 2048; None: the language model's context).
            dtype: as FastModel.from_pretrained (None: bf16 where the GPU has it, fp16 on
                older GPUs, fp32 on the CPU).
            load_in_4bit: NF4 weights with double quantisation through bitsandbytes for the
                language model's linear layers (default True); the vision tower, the
                projector and the output head stay 16-bit.
            device_map: passed to transformers; None (default): the current GPU, or the CPU
                without one.
            token: a Hugging Face token for gated or private Hub models.
            attn_implementation: transformers' attention; None (default): "sdpa".
            use_gradient_checkpointing: accepted here as Unsloth's notebooks pass it; the
                checkpointing is get_peft_model's (its own argument), except for a saved
                adapter, which is ready to train as it loads, with this checkpointing.
            load_in_8bit, full_finetuning: False; True is refused, as by FastModel.
            fused: the language model on slothkit's fused layers (where its family has a
                record: Gemma 3's, Qwen2.5-VL's) and, where the loss is the plain one, the
                fused linear cross-entropy. None (default): where Triton runs on the
                model's device (a CUDA GPU); True: everywhere (refused for a language
                model without a record); False: Hugging Face's modules.
            **hf_kwargs: passed on to ``AutoModelForImageTextToText.from_pretrained``.

        Returns:
            ``(model, processor)``: the transformers model and its processor, whose
            tokenizer pads on the right and has a pad token.

        Raises:
            FileNotFoundError: no such checkpoint, or it has no processor.
            ValueError: the checkpoint is not of an image-text model, an option is not
                accepted, or fused=True where the language model has no fused path.
            ImportError: load_in_4bit without bitsandbytes, or transformers needs a package
                to build the processor (Qwen-VL's: torchvision).
        """
        check_loading_options(load_in_8bit, full_finetuning, False, hf_kwargs)
        options = LoadOptions(
            max_seq_length=max_seq_length, dtype=dtype, load_in_4bit=load_in_4bit, device_map=device_map,
            token=token, attn_implementation=attn_implementation, fused=fused, hf_kwargs=hf_kwargs,
        )  # fmt: skip
        if is_adapter_folder(model_name):
            return load_saved_vision_adapter(model_name, options, use_gradient_checkpointing)
        image_text_config(model_name, token)  # before the processor: a text checkpoint is refused as such
        processor = load_processor(model_name, token)
        return load_vision_model(model_name, options, processor), processor

    @staticmethod
    def get_peft_model(
        model,
        finetune_vision_layers: bool = True,
        finetune_language_layers: bool = True,
        finetune_attention_modules: bool = True,
        finetune_mlp_modules: bool = True,
        r: int = 16,
        target_modules=None,
        lora_alpha: int = 16,
        lora_dropout: float = 0.0,
        bias: str = "none",
        random_state: int = 3407,
        use_rslora: bool = False,
        modules_to_save=None,
        use_gradient_checkpointing="offload",
        **lora_kwargs,
    ):
        """Add LoRA adapters to the vision tower's and/or the language model's attention
        and/or MLP layers, and set up checkpointing; return a ``peft.PeftModel`` ready to
        train, with ``save_pretrained_merged`` attached.

        Args:
            model: a model from ``FastVisionModel.from_pretrained``; not already a
                PeftModel.
            finetune_vision_layers: adapt the vision tower's layers (default True).
            finetune_language_layers: adapt the language model's layers (default True).
            finetune_attention_modules: adapt the linear layers of attention blocks
                (default True).
            finetune_mlp_modules: adapt the linear layers of MLP blocks (default True).
            r: the LoRA rank, a positive integer (default 16).
            target_modules: None (default): the layers the four flags pick, by module
                path (said once, with the count per part); "all-linear" or a list of layer
                names: PEFT's, as given (the flags are then not read).
            lora_alpha: the update is scaled by lora_alpha / r (default 16).
            lora_dropout: dropout on the adapters' input (default 0.0).
            bias: which biases train: "none" (default), "all" or "lora_only".
            random_state: the seed of the adapters' initialisation (default 3407).
            use_rslora: scale by lora_alpha / sqrt(r) instead (default False).
            modules_to_save: modules trained in full and saved with the adapter.
            use_gradient_checkpointing: "offload" (default; Unsloth's "unsloth" reads
                the same): the language model's layers offload their inputs to pinned host
                memory and the vision tower's take torch's checkpoint; True: torch's
                checkpoint on both; False: none. "auto" is read as "offload" here, said
                once.
            **lora_kwargs: passed on to ``peft.LoraConfig``.

        Returns:
            The ``peft.PeftModel``, in training mode.

        Raises:
            ValueError: an argument is not accepted (the message says what is).
        """
        mode = use_gradient_checkpointing
        CheckpointingOptions(mode=mode)  # checks the value
        if mode == "auto":
            say_once(
                "use_gradient_checkpointing='auto' plans the fused text path's memory; an image-text model "
                "offloads every language layer's input instead ('offload')",
                FallbackWarning,
            )
        targets = VisionTargets(
            vision=finetune_vision_layers, language=finetune_language_layers,
            attention=finetune_attention_modules, mlp=finetune_mlp_modules,
        )  # fmt: skip
        lora = LoraSettings(
            r=r, target_modules=target_modules, lora_alpha=lora_alpha, lora_dropout=lora_dropout, bias=bias,
            random_state=random_state, use_rslora=use_rslora, modules_to_save=modules_to_save, extra=lora_kwargs,
        )  # fmt: skip
        return ready_vision_model(add_vision_lora(model, lora, targets), mode)

    @staticmethod
    def for_training(model):
        """Training mode, the KV cache off, the processor's tokenizer padding on the right.
        Returns the same model."""
        return training_mode.for_training(model)

    @staticmethod
    def for_inference(model, fast_decode: bool | None = None):
        """Evaluation mode, the KV cache on, the processor's tokenizer padding on the left,
        and ``generate`` on slothkit's fast decode loop where the language model's family
        has a fused record (Gemma 3, Qwen2.5-VL's Qwen2): the prompt's images go through
        the model's own vision tower and merge (slothkit.inference.image_prompt), the new
        tokens through the captured decode step.  Elsewhere Hugging Face's generate, said
        once.

        Args:
            model: a model from ``FastVisionModel.from_pretrained`` or ``get_peft_model``.
            fast_decode: as FastModel.for_inference's: None: the fast loop on a CUDA GPU;
                True: also on a CPU (no graph: for checking); False: Hugging Face's
                generate.

        Returns:
            The same model.
        """
        return training_mode.for_inference(model, fast_decode)
