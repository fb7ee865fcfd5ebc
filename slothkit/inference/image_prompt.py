"""The prefill of a prompt with images: what an image-text model's language model receives.

An image-text model (Gemma3ForConditionalGeneration, Qwen2_5_VLForConditionalGeneration)
runs its vision tower and projector on the pixels, writes the image features into the
token embeddings at the image tokens and hands those embeddings to its language model,
with positions and a mask of its own making.  The fast loop steps that language model
(model_step.py reads it through ``language_model_of``); the prompt's embeddings and
positions are taken where the model hands them over: the outer model's forward runs up to
its language model's call, which a pre-hook stops after reading its arguments.  So the
merge, the processor's token layout and the vision LoRA are the model's own, and the
prompt's decoder layers run once, in the step.

What the language model would also have been given, and the step does itself:
- Positions.  Qwen2.5-VL hands over M-RoPE positions, (3, B, T): temporal, height and
  width, equal on text tokens; the rotary module composes them into one table.  A model
  that hands over none (Gemma 3) counts them as generate does: real tokens from 0.  Each
  new token then takes the row's largest position so far plus one, which is where
  transformers' generate puts it (Qwen2.5-VL: its rope_deltas).
- The mask.  Gemma 3 lets the tokens of one image read each other in both directions
  when the call carries token_type_ids (1 on image tokens), as its generate does in the
  prefill: each run of consecutive image tokens is one image (transformers'
  get_block_sequence_ids_for_mask); the sliding layers' window still applies.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from slothkit.core.inspection import language_model_of

# generate's keywords that carry the images of an image-text model's prompt, passed to its
# forward as they come: the pixels, Qwen2.5-VL's patch grid per image and its token types
# (text 0, image 1; M-RoPE needs them), Gemma 3's token types (its images' two-way mask).
IMAGE_INPUTS = ("pixel_values", "image_grid_thw", "mm_token_type_ids", "token_type_ids")

# Families whose language model lets the tokens of one image read each other in both
# directions (token_type_ids marking the image tokens): Gemma 3.
TWO_WAY_IMAGE_TYPES = ("gemma3",)


@dataclass
class ImagePrompt:
    """A prompt's input to the language model.

    Attributes:
        embeds: (B, T, hidden) the layers' input, the image features merged.
        positions: (B, T) RoPE positions, or (3, B, T) M-RoPE's.
        both_ways: (B, T, T) pairs of tokens that read each other whatever their order
            (one image's tokens), or None.
    """

    embeds: torch.Tensor
    positions: torch.Tensor
    both_ways: torch.Tensor | None


class _LanguageModelCalled(Exception):
    """Raised by the pre-hook on the language model, carrying its call's arguments."""

    def __init__(self, arguments: dict):
        super().__init__("the language model's arguments")
        self.arguments = arguments


def _stop_with_arguments(module, args, kwargs):
    raise _LanguageModelCalled(dict(kwargs))


def last_positions(positions: torch.Tensor) -> torch.Tensor:
    """(B,) each row's largest position, from (B, T) or (3, B, T) positions: the next token
    takes it plus one."""
    batch, tokens = positions.shape[-2:]
    return positions.reshape(-1, batch, tokens).amax(dim=(0, 2))


def image_blocks(token_type_ids: torch.Tensor) -> torch.Tensor:
    """(B, T, T) pairs of tokens in one image: token_type_ids (B, T) is 1 on image tokens,
    and each run of consecutive image tokens is one image."""
    is_image = token_type_ids == 1
    starts = is_image & ~torch.nn.functional.pad(is_image, (1, 0))[:, :-1]
    block = torch.where(is_image, starts.long().cumsum(-1), 0)  # 0: text
    return (block[:, :, None] == block[:, None, :]) & is_image[:, :, None] & is_image[:, None, :]


@torch.no_grad()
def image_prompt(
    causal_lm: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    positions: torch.Tensor,
    image_inputs: dict,
) -> ImagePrompt:
    """What the language model of the image-text ``causal_lm`` receives for this prompt.

    Args:
        causal_lm: the *ForConditionalGeneration model (the one inside a PeftModel).
        input_ids: (B, T) the prompt, with the processor's image tokens, left-padded.
        attention_mask: (B, T), 1 on real tokens.
        positions: (B, T) the positions generate counts (real tokens from 0), used where
            the model hands over none.
        image_inputs: the call's IMAGE_INPUTS (pixel_values and the rest), on any device.

    Raises:
        RuntimeError: the model's forward ended without calling its language model.
    """
    language_model = language_model_of(causal_lm)
    device = input_ids.device
    inputs = {
        name: value.to(device) if torch.is_tensor(value) else value for name, value in image_inputs.items()
    }
    handle = language_model.register_forward_pre_hook(_stop_with_arguments, with_kwargs=True)
    try:
        causal_lm.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **inputs)
    except _LanguageModelCalled as called:
        arguments = called.arguments
    else:
        raise RuntimeError(
            f"{type(causal_lm).__name__}'s forward did not call its language model; its prompt cannot be prefilled"
        )
    finally:
        handle.remove()
    handed = arguments.get("position_ids")
    if handed is not None and handed.dim() == 3:
        positions = handed[-3:]  # (3, B, T); a fourth leading row, text positions, is for packing
    both_ways = None
    token_types = inputs.get("token_type_ids")
    if causal_lm.config.model_type in TWO_WAY_IMAGE_TYPES and token_types is not None:
        both_ways = image_blocks(token_types)
    return ImagePrompt(arguments["inputs_embeds"], positions, both_ways)
