"""Image-text models' sizes, no weights: what `slothkit bench` builds with random weights
for its image-text runs.

An image-text shape is a language model's Shape (slothkit.models.shape) under a vision
tower, with the token ids the processor writes around an image and the side of the
square image the processor makes at its default resolution:

    gemma3       Gemma3ForConditionalGeneration: a SigLIP tower on 896 x 896 images in
                 14-pixel patches (64 x 64 of them), average-pooled 4 x 4 to
                 mm_tokens_per_image = 256 tokens an image, between <start_of_image> and
                 <end_of_image>
    qwen2_5_vl   Qwen2_5_VLForConditionalGeneration: a windowed ViT on 14-pixel patches
                 taken two frames deep (temporal_patch_size; an image is its frame twice),
                 each 2 x 2 of them merged into one token: a 448 x 448 image is a
                 (1, 32, 32) grid of patches and 256 tokens, between <|vision_start|> and
                 <|vision_end|>

    shape = IMAGE_TEXT_SHAPES["qwen2.5-vl-7b"]
    shape.config()          # the transformers config
    shape.image_tokens()    # placeholder tokens one default-resolution image takes
"""

from __future__ import annotations

from dataclasses import dataclass, field

from slothkit.models.gemma3 import GEMMA3
from slothkit.models.qwen2 import QWEN2
from slothkit.models.shape import Shape


@dataclass(frozen=True)
class ImageTextShape:
    model_type: str  # transformers model_type of the whole model
    text: Shape  # the language model
    vision: dict  # the vision_config's fields
    image_size: int  # the side in pixels of a default-resolution (square) image
    extra: dict = field(default_factory=dict)  # the outer config's fields (token ids, ...)
    text_extra: dict = field(default_factory=dict)  # text_config fields the Shape does not hold

    def config(self):
        from transformers import AutoConfig

        text_config = {**self.text.config_fields(), **self.text_extra}
        return AutoConfig.for_model(
            self.model_type, text_config=text_config, vision_config=dict(self.vision), **self.extra
        )

    def image_tokens(self) -> int:
        """The placeholder tokens one default-resolution image takes in a row."""
        if self.model_type == "gemma3":
            return self.extra["mm_tokens_per_image"]
        side = self.image_size // self.vision["patch_size"]
        return side * side // self.vision["spatial_merge_size"] ** 2

    def image_markers(self) -> tuple[int, int, int]:
        """(start, placeholder, end): the ids the processor writes before an image's
        placeholders, at each of them, and after them."""
        if self.model_type == "gemma3":
            extra = self.extra
            return extra["boi_token_index"], extra["image_token_index"], extra["eoi_token_index"]
        extra = self.extra
        return extra["vision_start_token_id"], extra["image_token_id"], extra["vision_end_token_id"]


def _text_shape(shape: Shape, **changes) -> Shape:
    """``shape`` as an image-text model's language model names itself (model_type)."""
    return Shape(**{**shape.__dict__, **changes})


# Gemma 3 4B: the gemma-3-4b text shape under SigLIP-so400m's tower (27 layers, width 1152,
# no pooling head), with the published checkpoints' image token ids.
_GEMMA3_IDS = {"boi_token_index": 255_999, "eoi_token_index": 256_000, "image_token_index": 262_144}
_GEMMA3_4B_VISION = ImageTextShape(
    "gemma3",
    GEMMA3.shapes["gemma-3-4b"],
    {
        "hidden_size": 1152,
        "intermediate_size": 4304,
        "num_hidden_layers": 27,
        "num_attention_heads": 16,
        "image_size": 896,
        "patch_size": 14,
        "vision_use_head": False,
    },
    896,
    {**_GEMMA3_IDS, "mm_tokens_per_image": 256},
)

# Qwen2.5-VL 7B: Qwen2.5-7B's text shape with M-RoPE (each head's 64 rotary pairs split
# 16 / 24 / 24 over time, height and width) and a 128,000-token context, under a 32-block
# ViT of width 1280 (blocks 7, 15, 23 and 31 attend over the whole image, the others
# within 112-pixel windows) whose merger maps to the language model's 3584.
_QWEN_IDS = {
    "vision_start_token_id": 151_652,
    "vision_end_token_id": 151_653,
    "image_token_id": 151_655,
    "video_token_id": 151_656,
}
_QWEN2_5_VL_7B = ImageTextShape(
    "qwen2_5_vl",
    _text_shape(QWEN2.shapes["qwen2.5-7b"], model_type="qwen2_5_vl_text", max_position_embeddings=128_000),
    {
        "depth": 32,
        "hidden_size": 1280,
        "intermediate_size": 3420,
        "num_heads": 16,
        "out_hidden_size": 3584,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "window_size": 112,
        "fullatt_block_indexes": [7, 15, 23, 31],
        "tokens_per_second": 2,
        "hidden_act": "silu",
    },
    448,
    _QWEN_IDS,
    {"rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}},
)

# Tiny ones for CPU tests: the tiny text shapes under one- or two-block towers, the image
# ids the last of their 512-token vocabularies.
_TINY_GEMMA3_VISION = ImageTextShape(
    "gemma3",
    GEMMA3.shapes["tiny-gemma3"],
    {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "image_size": 28,
        "patch_size": 14,
        "vision_use_head": False,
    },
    28,
    {"boi_token_index": 509, "eoi_token_index": 510, "image_token_index": 511, "mm_tokens_per_image": 4},
)
_TINY_QWEN2_5_VL = ImageTextShape(
    "qwen2_5_vl",
    _text_shape(QWEN2.shapes["tiny-qwen2"], model_type="qwen2_5_vl_text"),
    {
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "out_hidden_size": 64,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "window_size": 56,
        "fullatt_block_indexes": [1],
    },
    56,  # a (1, 4, 4) grid: 4 tokens
    {"vision_start_token_id": 508, "vision_end_token_id": 509, "image_token_id": 510, "video_token_id": 511},
    # head_dim 16: 8 rotary pairs; Qwen's special ids are past this vocabulary.
    {"rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}, "bos_token_id": 1, "eos_token_id": 2},
)

IMAGE_TEXT_SHAPES: dict[str, ImageTextShape] = {
    "gemma-3-4b-vision": _GEMMA3_4B_VISION,
    "qwen2.5-vl-7b": _QWEN2_5_VL_7B,
    "tiny-gemma3-vision": _TINY_GEMMA3_VISION,
    "tiny-qwen2.5-vl": _TINY_QWEN2_5_VL,
}
