"""Where an image-text model keeps its parts, by module path.

transformers builds every image-text model (Gemma 3, Qwen2-VL / Qwen2.5-VL / Qwen3-VL,
Llama 3.2 Vision, Pixtral / Llava, ...) from a vision encoder, a projector that maps its
features to the language model's width, and a language model, under names that differ by
family but come from a short list.  A module path is read component by component:

    vision      under vision_tower (Gemma 3, Llava, Pixtral), visual (Qwen-VL),
                vision_model (Mllama, Idefics), vision_encoder
    projector   under multi_modal_projector, mm_projector, or the vision tower's merger
                (Qwen-VL), which maps merged patches to the language width
    language    everything else (language_model.*, lm_head)

and a linear layer inside a block as attention (under self_attn, attn, attention,
cross_attn) or MLP (under mlp, feed_forward, ffn).
"""

from __future__ import annotations

VISION_TOWERS = ("vision_tower", "visual", "vision_model", "vision_encoder")
PROJECTORS = ("multi_modal_projector", "mm_projector", "merger")
ATTENTION_BLOCKS = ("self_attn", "attn", "attention", "cross_attn")
MLP_BLOCKS = ("mlp", "feed_forward", "ffn")

# bitsandbytes' modules to leave in 16 bits (transformers matches each from the start of a
# module's path up to a component boundary): the vision tower with its merger, the
# projector, and the output head.
SIXTEEN_BIT_MODULES = (
    rf"(?:model\.)?(?:{'|'.join(VISION_TOWERS + PROJECTORS)})",
    "lm_head",
)


def part_of(path: str) -> str:
    """ "vision", "projector" or "language": the part of the model a module path is in."""
    components = path.split(".")
    if any(name in PROJECTORS for name in components):
        return "projector"
    if any(name in VISION_TOWERS for name in components):
        return "vision"
    return "language"


def block_of(path: str) -> str | None:
    """ "attention" or "mlp": the kind of block a module path lies in (the innermost one
    named), or None."""
    for name in reversed(path.split(".")[:-1]):
        if name in ATTENTION_BLOCKS:
            return "attention"
        if name in MLP_BLOCKS:
            return "mlp"
    return None


def is_image_text_config(config) -> bool:
    """Whether a transformers config is of an image-text model (it has a vision config)."""
    return getattr(config, "vision_config", None) is not None
