"""Random image-text batches for the bench, laid out as the processor lays them out but
built without one (no processor or image file is at hand for a random-weight shape).

Each row holds one default-resolution image (slothkit.models.image_text_shapes): its
placeholder tokens between the start and end markers, after a few text tokens, the rest
of the row random text.  Beside the ids:

    pixel_values     Gemma 3: (images, 3, side, side), the normalised image.
                     Qwen2.5-VL: (sum of t * h * w, 3 * temporal_patch * patch * patch),
                     one row per patch as its image processor flattens them, with
                     image_grid_thw (images, 3) = (1, side / patch, side / patch)
    token_type_ids   Gemma 3: 1 on the placeholders (its image tokens read each other
                     both ways)
    mm_token_type_ids  Qwen2.5-VL: 1 on the placeholders (M-RoPE positions read them)
    labels           the ids, -100 on the image's tokens and markers (the collator's
                     masking), for training

The text ids are drawn below the smallest image id, so no text token is read as an image.
"""

from __future__ import annotations

import torch

from slothkit.models.image_text_shapes import ImageTextShape

# Text tokens before the image in each row (after them the image, then the rest).
TEXT_BEFORE_IMAGE = 3


def image_block(shape: ImageTextShape) -> list[int]:
    """The ids of one image in a row: the start marker, the placeholders, the end marker."""
    start, placeholder, end = shape.image_markers()
    return [start] + [placeholder] * shape.image_tokens() + [end]


def image_pixels(shape: ImageTextShape, images: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """pixel_values (and Qwen2.5-VL's image_grid_thw) of ``images`` random
    default-resolution images, in fp32 as the image processor returns them."""
    side = shape.image_size
    if shape.model_type == "gemma3":
        return {"pixel_values": torch.randn(images, 3, side, side, generator=generator)}
    vision = shape.vision
    patch, frames = vision["patch_size"], vision["temporal_patch_size"]
    grid = side // patch
    patches = torch.randn(images * grid * grid, 3 * frames * patch * patch, generator=generator)
    return {"pixel_values": patches, "image_grid_thw": torch.tensor([[1, grid, grid]] * images)}


def token_types(shape: ImageTextShape, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The token types the processor writes beside the ids: 1 on the image placeholders."""
    marked = (ids == shape.image_markers()[1]).long()
    name = "token_type_ids" if shape.model_type == "gemma3" else "mm_token_type_ids"
    return {name: marked}


def _text(shape: ImageTextShape, rows: int, tokens: int, generator: torch.Generator) -> torch.Tensor:
    lowest_image_id = min(shape.image_markers())
    return torch.randint(3, lowest_image_id, (rows, tokens), generator=generator)


def training_batch(shape: ImageTextShape, rows: int, seq: int, generator: torch.Generator) -> dict:
    """``rows`` rows of ``seq`` tokens, each with one image: ids, attention mask, labels,
    pixels and token types.

    Raises:
        ValueError: ``seq`` leaves no room for the image and some text.
    """
    block = image_block(shape)
    text_tokens = seq - len(block)
    if text_tokens <= TEXT_BEFORE_IMAGE:
        raise ValueError(
            f"--seq {seq} leaves no room for text: one image takes {len(block)} tokens; "
            f"give --seq {len(block) + TEXT_BEFORE_IMAGE + 1} or more"
        )
    text = _text(shape, rows, text_tokens, generator)
    images = torch.tensor([block] * rows)
    ids = torch.cat([text[:, :TEXT_BEFORE_IMAGE], images, text[:, TEXT_BEFORE_IMAGE:]], dim=1)
    labels = ids.clone()
    labels[:, TEXT_BEFORE_IMAGE : TEXT_BEFORE_IMAGE + len(block)] = -100
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "labels": labels,
        **token_types(shape, ids),
        **image_pixels(shape, rows, generator),
    }


def generation_prompts(
    shape: ImageTextShape, rows: int, text_tokens: int, generator: torch.Generator
) -> dict:
    """``rows`` prompts, each one image and up to ``text_tokens`` text tokens, left-padded
    (id 0, mask 0) to one length: row r > 0 has r * text_tokens // (2 * rows) text tokens
    fewer, as the text bench's prompts have padding of various lengths.  Ids, attention
    mask, token types and pixels: generate's keywords."""
    block = image_block(shape)
    text = _text(shape, rows, text_tokens, generator)
    length = text_tokens + len(block)
    ids = torch.zeros(rows, length, dtype=torch.long)
    mask = torch.zeros(rows, length, dtype=torch.long)
    for row in range(rows):
        kept = text_tokens - row * text_tokens // (2 * rows)
        before = min(TEXT_BEFORE_IMAGE, kept)
        prompt = torch.cat([text[row, :before], torch.tensor(block), text[row, before:kept]])
        ids[row, length - len(prompt) :] = prompt
        mask[row, length - len(prompt) :] = 1
    return {
        "input_ids": ids,
        "attention_mask": mask,
        **token_types(shape, ids),
        **image_pixels(shape, rows, generator),
    }


def on_device(batch: dict, device, dtype: torch.dtype) -> dict:
    """The batch's tensors on ``device``, its pixels in the model's ``dtype`` (as the
    vision collator casts them)."""
    moved = {name: value.to(device) for name, value in batch.items()}
    moved["pixel_values"] = moved["pixel_values"].to(dtype)
    return moved
