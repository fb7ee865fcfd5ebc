"""Load a whole image-text model and its processor, as FastVisionModel.from_pretrained does:
``AutoModelForImageTextToText`` in 16 bits, or with NF4 weights through bitsandbytes where
the vision tower, the projector and the output head stay 16-bit, and ``AutoProcessor``
beside it.

    processor = load_processor("path/or/hub-id")
    model = load_vision_model("path/or/hub-id", LoadOptions(load_in_4bit=True), processor)

The vision tower and projector train on Hugging Face's modules; the language model on
slothkit's fused layers where its family has a record and Triton runs
(slothkit.loading.vision_fused). slothkit adds its checkpointing, LoRA targets by part
(slothkit.loading.vision_lora) and the saves.
"""

from __future__ import annotations

from slothkit.checkpoint.before_loading import (
    check_max_seq_length,
    nf4_settings,
    pick_dtype,
    require_bitsandbytes,
    resolve_checkpoint,
)
from slothkit.checkpoint.loaded_weights import check_loaded_weights
from slothkit.core.distributed import device_map_for_process
from slothkit.core.model_state import attach_state
from slothkit.core.notices import FallbackWarning, say_once
from slothkit.engine.nf4_layout import keep_nf4_layout
from slothkit.loading.load_model import LoadOptions, prepare_tokenizer, set_max_seq_length
from slothkit.loading.vision_fused import fuse_language_model
from slothkit.models.image_text import SIXTEEN_BIT_MODULES, is_image_text_config


def image_text_config(model_name: str, token: str | None = None):
    """The checkpoint's config, checked to be an image-text model's.

    Raises:
        ValueError: the checkpoint is not of an image-text model.
    """
    config = resolve_checkpoint(model_name, token=token)
    if not is_image_text_config(config):
        raise ValueError(
            f"{model_name!r} is a {config.model_type!r} checkpoint without a vision tower (its config has no "
            f"vision_config); FastVisionModel loads image-text models: load a text model with FastModel"
        )
    return config


def load_vision_model(model_name: str, options: LoadOptions, processor=None):
    """The image-text model at `model_name` (a checkpoint directory or Hub id; the options
    as FastVisionModel.from_pretrained describes them), linked to `processor` when given:
    the save methods and the training/inference switch use it.

    Raises:
        ValueError: the checkpoint is not of an image-text model, or max_seq_length is not
            accepted.
        ImportError: load_in_4bit without bitsandbytes.
    """
    config = image_text_config(model_name, options.token)
    max_seq_length = options.max_seq_length
    if max_seq_length is None:  # the language model's own context
        max_seq_length = getattr(config.get_text_config(), "max_position_embeddings", None)
    check_max_seq_length(config.get_text_config(), max_seq_length)
    dtype = pick_dtype(options.dtype)
    quantization = None
    if options.load_in_4bit and getattr(config, "quantization_config", None) is None:
        require_bitsandbytes()
        from transformers import BitsAndBytesConfig

        quantization = BitsAndBytesConfig(
            **nf4_settings(dtype), llm_int8_skip_modules=list(SIXTEEN_BIT_MODULES)
        )
    from transformers import AutoModelForImageTextToText

    hf_kwargs = dict(options.hf_kwargs)
    hf_kwargs.pop("output_loading_info", None)
    hf_kwargs.setdefault("use_kernels", False)  # as FastModel: transformers' Hub kernels off
    model, loading_info = AutoModelForImageTextToText.from_pretrained(
        model_name,
        dtype=dtype,
        quantization_config=quantization,
        device_map=options.device_map if options.device_map is not None else device_map_for_process(),
        token=options.token,
        attn_implementation=options.attn_implementation or "sdpa",
        output_loading_info=True,
        **hf_kwargs,
    )
    check_loaded_weights(model, loading_info, model_name)
    keep_nf4_layout(model)
    if processor is not None:
        prepare_tokenizer(processor.tokenizer, max_seq_length)
        attach_state(model).tokenizer = processor
    set_max_seq_length(model, max_seq_length, checked=True)
    language = fuse_language_model(model, options.fused)
    say_once(
        f"slothkit: {model_name} is an image-text {config.model_type} model; FastVisionModel trains its vision "
        f"tower and projector on Hugging Face's modules and its language model on {language}, with slothkit's "
        f"checkpointing and LoRA targets",
        FallbackWarning,
    )
    return model


def load_processor(model_name: str, token: str | None = None):
    """The checkpoint's processor (tokenizer, image processor, chat template).

    Raises:
        FileNotFoundError: the checkpoint has no processor files.
        ImportError: transformers needs a package to build it that is not installed.
    """
    from transformers import AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(model_name, token=token)
    except ImportError as error:
        raise ImportError(
            f"transformers cannot build the processor of {model_name!r} here: {str(error).strip().splitlines()[0]} "
            f"(Qwen-VL's processors need torchvision: pip install torchvision)"
        ) from None
    except (OSError, ValueError) as error:
        raise FileNotFoundError(
            f"{model_name!r} has no usable processor (preprocessor_config.json or processor_config.json, with a "
            f"tokenizer); save one with the checkpoint (underlying error: {error})"
        ) from None
    if not hasattr(processor, "image_processor"):
        raise FileNotFoundError(
            f"{model_name!r} has a tokenizer but no image processor (preprocessor_config.json); "
            f"FastVisionModel needs the checkpoint's processor"
        )
    return processor
