"""An image-text bench model made ready the way each implementation's users make it:
LoRA r on the language model's attention and MLP layers (the vision tower and projector
frozen: finetune_vision_layers=False, the default of Unsloth's vision notebooks for
these models), each with its own checkpointing.

    slothkit  what FastVisionModel.from_pretrained does to the model it loads (the
              language model on the fused layers where Triton runs, the fused loss where
              it agrees), then FastVisionModel.get_peft_model
    hf        PEFT's LoraConfig with a pattern for the language model's seven
              projections, and transformers' gradient checkpointing
    unsloth   the random model saved with a processor, loaded back through Unsloth's
              FastVisionModel, and its get_peft_model

The model comes from slothkit.bench.model_setup.build_model (an image-text shape's name),
which builds it in memory as FastVisionModel would load it (16-bit, or with NF4 language
projections for QLoRA).
"""

from __future__ import annotations

import torch

from slothkit.bench.model_setup import CHECKPOINTING, LORA_TARGETS

# PEFT matches a string target against whole module paths: the seven projections of the
# language model's layers (model.language_model.layers.N...), none of the vision tower's.
HF_LANGUAGE_TARGETS = rf".*language_model\.layers\.\d+\..*\.(?:{'|'.join(LORA_TARGETS)})"


def take_fast_vision_path(model, seq: int) -> None:
    """What FastVisionModel.from_pretrained does to a loaded image-text model
    (slothkit.loading.vision_model.load_vision_model, after transformers' loading):
    bitsandbytes' weights kept in their layout, the longest sequence set, and the
    language model on the fused path where it runs."""
    from slothkit.engine.nf4_layout import keep_nf4_layout
    from slothkit.loading.load_model import set_max_seq_length
    from slothkit.loading.vision_fused import fuse_language_model

    keep_nf4_layout(model)
    set_max_seq_length(model, seq)
    fuse_language_model(model, None)


def prepare_image_text(
    impl: str, model, rank: int, seq: int, checkpointing: str = "offload", hf_checkpointing: str = "on"
):
    """LoRA (alpha = r) and checkpointing on the image-text ``model``, as ``impl``'s users
    add them.

    Args:
        impl: "slothkit" or "hf".
        model: the model from ``build_model``.
        rank: the LoRA rank.
        seq: the longest sequence trained on (slothkit's max_seq_length).
        checkpointing: slothkit's, a word of CHECKPOINTING ("auto" is read as "offload"
            by FastVisionModel, said once).
        hf_checkpointing: HF + PEFT's gradient checkpointing, "on" (non-reentrant) or "off".
    """
    if impl == "slothkit":
        from slothkit import FastVisionModel

        take_fast_vision_path(model, seq)
        return FastVisionModel.get_peft_model(
            model,
            finetune_vision_layers=False,
            r=rank,
            lora_alpha=rank,
            use_gradient_checkpointing=CHECKPOINTING[checkpointing],
        )
    if impl == "hf":
        from peft import LoraConfig, get_peft_model

        config = LoraConfig(
            r=rank,
            lora_alpha=rank,
            lora_dropout=0.0,
            target_modules=HF_LANGUAGE_TARGETS,
            task_type="CAUSAL_LM",
        )
        model = get_peft_model(model, config)
        if hf_checkpointing == "on":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.enable_input_require_grads()
        model.config.use_cache = False
        model.train()
        return model
    raise ValueError(f"implementation {impl!r} does not train image-text shapes here")


def adapted_layers(model) -> list[str]:
    """The module paths (in the transformers model) of the layers with LoRA adapters."""
    return sorted(
        name.removeprefix("base_model.model.")
        for name, module in model.named_modules()
        if hasattr(module, "lora_A") and len(module.lora_A)
    )


def load_with_unsloth_vision(model, shape_name: str, args, dtype, inference: bool = False):
    """Unsloth loads from a checkpoint on disk with its processor: save the random model
    with one (``write_processor``), load it as Unsloth's vision notebooks do and add LoRA
    on the language layers (deleting the checkpoint once loaded).  Returns (model, bytes
    allocated once loaded)."""
    import shutil
    import tempfile

    from unsloth import FastVisionModel as UnslothVisionModel

    folder = tempfile.mkdtemp(prefix="slothkit-bench-unsloth-vision-")
    try:
        model.save_pretrained(folder, safe_serialization=True)
        write_processor(folder, shape_name)
        del model
        torch.cuda.empty_cache()
        unsloth_model, _ = UnslothVisionModel.from_pretrained(
            folder, max_seq_length=args.seq, dtype=dtype, load_in_4bit=args.mode == "qlora"
        )
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    torch.cuda.synchronize()
    loaded = torch.cuda.memory_allocated()
    unsloth_model = UnslothVisionModel.get_peft_model(
        unsloth_model,
        finetune_vision_layers=False,
        finetune_language_layers=True,
        finetune_attention_modules=True,
        finetune_mlp_modules=True,
        r=args.rank,
        lora_alpha=args.rank,
        lora_dropout=0.0,
        bias="none",
        random_state=args.seed,
        use_gradient_checkpointing=False if inference else "unsloth",
    )
    if not inference:
        unsloth_model.train()
    return unsloth_model, loaded


def write_processor(folder: str, shape_name: str) -> None:
    """A processor's files beside the weights, as a checkpoint has them: a small tokenizer
    of the family's kind with the image markers added (at its own ids, not the config's:
    the bench writes the ids itself, the processor is only loaded), the family's chat
    template reading image parts, and its image processor at the shape's default
    resolution."""
    import json
    import pathlib

    from transformers import AutoTokenizer

    from slothkit.models import IMAGE_TEXT_SHAPES
    from slothkit.testing import build_tiny_tokenizer
    from slothkit.testing.tiny_chat_templates import with_image_parts
    from slothkit.testing.tiny_image_text import (
        GEMMA3_IMAGE_MARKER,
        GEMMA3_IMAGE_TOKENS,
        QWEN_IMAGE_MARKER,
        QWEN_VISION_TOKENS,
    )

    shape = IMAGE_TEXT_SHAPES[shape_name]
    side = shape.image_size
    if shape.model_type == "gemma3":
        from transformers import Gemma3ImageProcessor, Gemma3Processor

        build_tiny_tokenizer("sentencepiece", folder, arch="gemma3")
        tokenizer = AutoTokenizer.from_pretrained(folder, extra_special_tokens=GEMMA3_IMAGE_TOKENS)
        Gemma3Processor(
            image_processor=Gemma3ImageProcessor(size={"height": side, "width": side}),
            tokenizer=tokenizer,
            chat_template=with_image_parts(tokenizer.chat_template, GEMMA3_IMAGE_MARKER),
            image_seq_length=shape.image_tokens(),
        ).save_pretrained(folder)
        return
    # Qwen2.5-VL's processor object needs torchvision to be built (its video processor):
    # its files are written as such, as the tiny Qwen2.5-VL checkpoint's are.
    from transformers import Qwen2VLImageProcessor

    build_tiny_tokenizer("qwen", folder, arch="qwen2")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.add_special_tokens({"additional_special_tokens": list(QWEN_VISION_TOKENS)})
    tokenizer.chat_template = with_image_parts(tokenizer.chat_template, QWEN_IMAGE_MARKER)
    tokenizer.save_pretrained(folder)
    Qwen2VLImageProcessor(min_pixels=side * side, max_pixels=side * side).save_pretrained(folder)
    config = {"processor_class": "Qwen2_5_VLProcessor"}
    (pathlib.Path(folder) / "processor_config.json").write_text(json.dumps(config, indent=2) + "\n")
