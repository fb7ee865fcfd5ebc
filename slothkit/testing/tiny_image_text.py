"""Tiny image-text checkpoints, offline: a vision tower, a projector and a tiny text model,
saved as transformers saves such models, with a processor (tokenizer with the image tokens,
image processor, a chat template that reads image parts).

    gemma3       Gemma3ForConditionalGeneration: the tiny Gemma 3 text checkpoint as its
                 language model (the published layout, language_model.model.*), a one-layer
                 SigLIP tower on 28 x 28 images, 4 image tokens per image
    gemma4       Gemma4ForConditionalGeneration: the tiny gemma4_text checkpoint of
                 slothkit.testing.tiny_generic_models (per-layer embeddings, shared keys
                 and values) under a one-layer vision tower, no audio tower, with the text
                 checkpoint's tokenizer alone (no processor)
    qwen2_5_vl   Qwen2_5_VLForConditionalGeneration: the tiny Qwen2 sizes with M-RoPE, a
                 two-block vision tower (one windowed, one full) on 14-pixel patches merged
                 2 x 2, images of 28 x 28 to 56 x 56 pixels (1 to 4 image tokens); windows
                 of 112 pixels, as the published models' (and llama.cpp's, which fixes them)
    mllama       MllamaForConditionalGeneration (Llama 3.2 Vision): three text layers of the
                 tiny Llama sizes, the middle one a cross-attention layer reading the image;
                 a two-layer vision transformer and a one-layer gated global one on tiles of
                 28 x 28 pixels, up to 2 tiles an image; one <|image|> token per image, the
                 first id past the output head's rows, as in the published checkpoints

The Gemma 3 and Gemma 4 ones also stand in for Gemma 3 4B-27B and Gemma 4 E2B-31B,
which FastModel loads as their text model alone (slothkit.loading.text_tower).  Qwen2.5-VL's processor needs torchvision where
transformers builds it (its video processor); `image_text_processor_loads` says whether it
does here.
"""

from __future__ import annotations

import functools
import json
import pathlib
import shutil
import tempfile

import torch

from slothkit.testing.tiny_chat_templates import tiny_chat_template, with_image_parts
from slothkit.testing.tiny_models import tiny_model_path

IMAGE_TEXT_FAMILIES = ("gemma3", "qwen2_5_vl", "mllama")

# The text the chat template writes where an image stands, which the processor expands.
GEMMA3_IMAGE_MARKER = "<start_of_image>"
QWEN_IMAGE_MARKER = "<|vision_start|><|image_pad|><|vision_end|>"
GEMMA3_IMAGE_TOKENS = {
    "boi_token": "<start_of_image>",
    "eoi_token": "<end_of_image>",
    "image_token": "<image_soft_token>",
}
QWEN_VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
MLLAMA_IMAGE_TOKEN = "<|image|>"
# Mllama's processor looks this token up as it is built (the published tokenizer has it).
MLLAMA_PYTHON_TOKEN = "<|python_tag|>"


def build_tiny_image_text_gemma3(
    path: str | pathlib.Path, text_path: str | pathlib.Path | None = None
) -> pathlib.Path:
    """Write the checkpoint to `path` and return it; its language model's weights and its
    tokenizer are those of the Gemma 3 text checkpoint at `text_path` (default
    tiny_model_path("gemma3"); the real Gemma 3 270M makes a real-weights stand-in for
    the text-tower path).  Where Gemma 3's three image tokens fit in the model's rows
    after the tokenizer's vocabulary (the tiny one), they are added and the processor is
    written; otherwise (the 270M's vocabulary fills its rows) the image token ids are the
    rows' last ids and only the tokenizer is written."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Gemma3Config, Gemma3ForConditionalGeneration

    path = pathlib.Path(path)
    text_path = pathlib.Path(text_path) if text_path is not None else tiny_model_path("gemma3")
    text_model = AutoModelForCausalLM.from_pretrained(text_path, dtype=torch.float32)
    rows = text_model.config.vocab_size
    tokenizer = AutoTokenizer.from_pretrained(text_path, extra_special_tokens=GEMMA3_IMAGE_TOKENS)
    with_processor = len(tokenizer) <= rows
    if with_processor:
        ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in GEMMA3_IMAGE_TOKENS.items()}
    else:
        ids = {"image_token": rows - 1, "boi_token": rows - 2, "eoi_token": rows - 3}
    config = Gemma3Config(
        text_config=text_model.config.to_dict(),
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                       "num_attention_heads": 2, "image_size": 28, "patch_size": 14,
                       "vision_use_head": False},  # as Gemma 3's: no pooling head
        mm_tokens_per_image=4,
        image_token_index=ids["image_token"], boi_token_index=ids["boi_token"], eoi_token_index=ids["eoi_token"],
    )  # fmt: skip
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config)
    loaded = model.model.language_model.load_state_dict(text_model.model.state_dict())
    assert not loaded.missing_keys and not loaded.unexpected_keys, loaded
    model.lm_head.weight = model.model.language_model.embed_tokens.weight  # tied, as Gemma 3's
    # transformers starts the projector at zero, which would give every image the same
    # (zero) features and the vision tower no gradient; its input is RMS-normalised, so
    # a 1 / sqrt(width) scale gives features of order one.
    projection = model.model.multi_modal_projector.mm_input_projection_weight
    with torch.no_grad():
        projection.normal_(0.0, projection.shape[0] ** -0.5)
    model.save_pretrained(path)
    if not with_processor:
        return _with_tokenizer_files(path, text_path)
    if (text_path / "generation_config.json").exists():
        shutil.copy(text_path / "generation_config.json", path / "generation_config.json")
    from transformers import Gemma3ImageProcessor, Gemma3Processor

    processor = Gemma3Processor(
        image_processor=Gemma3ImageProcessor(size={"height": 28, "width": 28}),
        tokenizer=tokenizer,
        chat_template=with_image_parts(tokenizer.chat_template, GEMMA3_IMAGE_MARKER),
        image_seq_length=config.mm_tokens_per_image,
    )
    processor.save_pretrained(path)
    return path


def build_tiny_image_text_qwen2_5_vl(path: str | pathlib.Path) -> pathlib.Path:
    """Write the checkpoint to `path` and return it: random weights (seed 0) in the tiny
    Qwen2 sizes, the tiny Qwen tokenizer with Qwen-VL's vision tokens added after its
    vocabulary, and the processor's files (written as files, since transformers builds
    the processor object only where torchvision is installed)."""
    from transformers import (
        AutoConfig,
        AutoTokenizer,
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLImageProcessor,
    )

    path = pathlib.Path(path)
    text_path = tiny_model_path("qwen2")
    text = AutoConfig.from_pretrained(text_path)
    tokenizer = AutoTokenizer.from_pretrained(text_path)
    tokenizer.add_special_tokens({"additional_special_tokens": list(QWEN_VISION_TOKENS)})
    start, end, image, video = tokenizer.convert_tokens_to_ids(list(QWEN_VISION_TOKENS))
    head_dim = text.hidden_size // text.num_attention_heads
    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=text.vocab_size, hidden_size=text.hidden_size, intermediate_size=text.intermediate_size,
            num_hidden_layers=text.num_hidden_layers, num_attention_heads=text.num_attention_heads,
            num_key_value_heads=text.num_key_value_heads, max_position_embeddings=text.max_position_embeddings,
            rms_norm_eps=text.rms_norm_eps, rope_theta=1_000_000.0,
            # M-RoPE: the rotary pairs of a head split over (time, height, width) positions.
            rope_scaling={"type": "mrope", "mrope_section": [2, 3, head_dim // 2 - 5]},
            bos_token_id=text.bos_token_id, eos_token_id=text.eos_token_id, tie_word_embeddings=False,
        ),
        vision_config=dict(
            depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=text.hidden_size,
            patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112, fullatt_block_indexes=[1],
        ),
        image_token_id=image, video_token_id=video, vision_start_token_id=start, vision_end_token_id=end,
    )  # fmt: skip
    if len(tokenizer) > text.vocab_size:
        raise ValueError(f"the tiny Qwen tokenizer with vision tokens outgrows the {text.vocab_size} rows")
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(config)
    # A tiny model's random weights are small; give the vision tower's output an order-one
    # scale, so that image features move the language model's numbers measurably, and its
    # attention sharper scores and a larger share of each block's output, so that which
    # patches attend to which (the windows) moves the features measurably.
    with torch.no_grad():
        for parameter in model.model.visual.merger.parameters():
            parameter.mul_(8.0)
        for block in model.model.visual.blocks:
            block.attn.qkv.weight.mul_(8.0)
            block.attn.proj.weight.mul_(4.0)
    model.save_pretrained(path)
    shutil.copy(text_path / "generation_config.json", path / "generation_config.json")
    tokenizer.chat_template = with_image_parts(tiny_chat_template("qwen-2.5"), QWEN_IMAGE_MARKER)
    tokenizer.save_pretrained(path)
    Qwen2VLImageProcessor(min_pixels=28 * 28, max_pixels=56 * 56).save_pretrained(path)
    processor_config = {"processor_class": "Qwen2_5_VLProcessor"}
    (path / "processor_config.json").write_text(json.dumps(processor_config, indent=2) + "\n")
    return path


def build_tiny_image_text_gemma4(
    path: str | pathlib.Path, text_path: str | pathlib.Path | None = None
) -> pathlib.Path:
    """Write the checkpoint to `path` and return it; its language model's weights and its
    tokenizer are those of the Gemma 4 text checkpoint at `text_path` (default the tiny
    gemma4_text checkpoint of slothkit.testing.tiny_generic_models: per-layer embeddings,
    shared keys and values). No audio tower: the E2B and E4B checkpoints have one, which
    FastModel leaves on disk as it does the vision tower."""
    from transformers import AutoModelForCausalLM, Gemma4Config, Gemma4ForConditionalGeneration

    from slothkit.testing.tiny_generic_models import tiny_generic_model_path

    path = pathlib.Path(path)
    text_path = pathlib.Path(text_path) if text_path is not None else tiny_generic_model_path("gemma4_text")
    text_model = AutoModelForCausalLM.from_pretrained(text_path, dtype=torch.float32)
    vocab = text_model.config.vocab_size
    config = Gemma4Config(
        text_config=text_model.config.to_dict(),
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                       "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16,
                       "patch_size": 14, "position_embedding_size": 64},
        audio_config=None,
        # The last ids of the tiny vocabulary, which its tokenizer never produces.
        image_token_id=vocab - 1, boi_token_id=vocab - 2, eoi_token_id=vocab - 3, video_token_id=vocab - 4,
        audio_token_id=vocab - 5, boa_token_id=vocab - 6, eoa_token_index=vocab - 7,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Gemma4ForConditionalGeneration(config)
    loaded = model.model.language_model.load_state_dict(text_model.model.state_dict())
    assert not loaded.missing_keys and not loaded.unexpected_keys, loaded
    model.lm_head.weight = model.model.language_model.embed_tokens.weight  # tied, as Gemma 4's
    model.save_pretrained(path)
    return _with_tokenizer_files(path, text_path)


def build_tiny_image_text_mllama(path: str | pathlib.Path) -> pathlib.Path:
    """Write the checkpoint to `path` and return it: random weights (seed 0) in the tiny
    Llama sizes, the tiny Llama tokenizer with <|python_tag|> and <|image|> added after
    its vocabulary, and the processor (tile-splitting image processor, a Llama 3 chat
    template that reads image parts).

    As in Llama 3.2 Vision's checkpoints, the output head has one row per text token and
    <|image|> is the first id past them (the embedding has 8 rows more): a label left on
    an image token would fall outside the logits, so the collator must mask it."""
    from transformers import AutoConfig, AutoTokenizer, MllamaConfig, MllamaForConditionalGeneration

    path = pathlib.Path(path)
    text_path = tiny_model_path("llama")
    text = AutoConfig.from_pretrained(text_path)
    tokenizer = AutoTokenizer.from_pretrained(text_path)
    tokenizer.add_special_tokens({"additional_special_tokens": [MLLAMA_PYTHON_TOKEN, MLLAMA_IMAGE_TOKEN]})
    image_token_id = tokenizer.convert_tokens_to_ids(MLLAMA_IMAGE_TOKEN)
    vision_hidden, intermediate_layers = 32, [0]
    config = MllamaConfig(
        text_config=dict(
            vocab_size=image_token_id, hidden_size=text.hidden_size, intermediate_size=text.intermediate_size,
            num_hidden_layers=3, cross_attention_layers=[1], num_attention_heads=text.num_attention_heads,
            num_key_value_heads=text.num_key_value_heads, max_position_embeddings=text.max_position_embeddings,
            rms_norm_eps=text.rms_norm_eps, rope_parameters=dict(text.rope_parameters),
            bos_token_id=text.bos_token_id, eos_token_id=text.eos_token_id, pad_token_id=text.pad_token_id,
        ),
        vision_config=dict(
            hidden_size=vision_hidden, intermediate_size=64, num_hidden_layers=2, num_global_layers=1,
            attention_heads=2, image_size=28, patch_size=14, max_num_tiles=2,
            supported_aspect_ratios=[[1, 1], [1, 2], [2, 1]], intermediate_layers_indices=intermediate_layers,
            # The projector reads the last layer's output beside each intermediate layer's.
            vision_output_dim=vision_hidden * (len(intermediate_layers) + 1),
        ),
        image_token_index=image_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    model = MllamaForConditionalGeneration(config)
    # transformers starts every tanh gate on the image's path at zero (the cross-attention
    # layer's and the tile and position embeddings'), which would leave the text blind to
    # the image and the vision tower without gradient: open them part way.
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(("gate", "_gate")):
                parameter.fill_(0.5)
    model.save_pretrained(path)
    shutil.copy(text_path / "generation_config.json", path / "generation_config.json")
    from transformers import MllamaImageProcessor, MllamaProcessor

    processor = MllamaProcessor(
        image_processor=MllamaImageProcessor(size={"height": 28, "width": 28}, max_image_tiles=2),
        tokenizer=tokenizer,
        chat_template=with_image_parts(tiny_chat_template("llama-3"), MLLAMA_IMAGE_TOKEN),
    )
    processor.save_pretrained(path)
    return path


def _with_tokenizer_files(path: pathlib.Path, text_path: pathlib.Path) -> pathlib.Path:
    """``path`` with the text checkpoint's tokenizer files copied in beside the weights."""
    for name in (p.name for p in text_path.iterdir()):
        if name not in ("config.json", "generation_config.json") and not name.endswith(".safetensors"):
            shutil.copy(text_path / name, path / name)
    return path


_BUILDERS = {
    "gemma3": build_tiny_image_text_gemma3,
    "gemma4": build_tiny_image_text_gemma4,
    "mllama": build_tiny_image_text_mllama,
    "qwen2_5_vl": build_tiny_image_text_qwen2_5_vl,
}


def tiny_image_text_path(family: str) -> pathlib.Path:
    """The family's tiny image-text checkpoint, built once per process into a temporary
    folder removed at exit. Treat it as read-only."""
    if family not in _BUILDERS:
        raise ValueError(f"no tiny image-text checkpoint of {family!r}; built: {', '.join(_BUILDERS)}")
    return _built(family)


@functools.cache
def _built(family: str) -> pathlib.Path:
    return _BUILDERS[family](pathlib.Path(_folder().name) / f"{family}-image-text")


def tiny_image_text_gemma3_path() -> pathlib.Path:
    """tiny_image_text_path("gemma3")."""
    return tiny_image_text_path("gemma3")


def tiny_image_text_gemma4_path() -> pathlib.Path:
    """tiny_image_text_path("gemma4")."""
    return tiny_image_text_path("gemma4")


@functools.cache
def image_text_processor_loads(family: str) -> str | None:
    """None where transformers loads the family's processor here; else why not (Qwen-VL's
    video processor needs torchvision)."""
    from transformers import AutoProcessor

    try:
        AutoProcessor.from_pretrained(tiny_image_text_path(family))
    except (ImportError, AttributeError) as error:
        return f"transformers cannot build the {family} processor here: {str(error).strip()[:200]}"
    return None


@functools.cache
def _folder() -> tempfile.TemporaryDirectory:
    return tempfile.TemporaryDirectory(prefix="slothkit-tiny-image-text-")
