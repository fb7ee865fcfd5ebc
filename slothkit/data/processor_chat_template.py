"""`get_chat_template` on an image-text model's processor (Unsloth's vision notebooks call
``processor = get_chat_template(processor, "gemma-3")``).

slothkit's chat formats render text parts only; a processor's own chat template (the
checkpoint's) also writes the marker its processor expands into each image's tokens.  So
the processor keeps its template when that renders text conversations as the named format
does (it is that format, with images), said once, and a format it does not render is
refused: installing it would lose the images.
"""

from __future__ import annotations

import copy

from slothkit.core.notices import FallbackWarning, say_once
from slothkit.data.chat_formats import format_named


def is_processor(candidate) -> bool:
    """Whether `candidate` is a multimodal processor (a tokenizer beside an image processor)."""
    return hasattr(candidate, "tokenizer") and hasattr(candidate, "image_processor")


def keep_processor_template(processor, chat_template: str, matching_format):
    """The processor, unchanged, when its own chat template renders as `chat_template`.

    Args:
        processor: an image-text model's processor (FastVisionModel.from_pretrained's).
        chat_template: a slothkit format name ("gemma-3", "qwen-2.5", ...).
        matching_format: slothkit.data.chat_templates.matching_format (given by its caller
            there, which imports this module).

    Raises:
        ValueError: the name is not a format, the processor has no chat template, or its
            template renders another format (or none slothkit knows).
    """
    if not isinstance(chat_template, str):
        raise ValueError(
            f"get_chat_template(processor, {chat_template!r}): an image-text model's processor takes a format "
            f"name only; its own chat template places the images"
        )
    requested = format_named(chat_template)
    own = getattr(processor, "chat_template", None) or processor.tokenizer.chat_template
    if not own:
        raise ValueError(
            f"get_chat_template(processor, {chat_template!r}): this processor has no chat template of its own "
            f"to place the images, and slothkit's formats render text parts only"
        )
    probe = copy.copy(processor.tokenizer)  # a shallow copy: the processor's tokenizer is left as it is
    probe.chat_template = own
    found = matching_format(probe)
    if found is None or found.name != requested.name:
        renders = f"the {found.name} format" if found is not None else "no format slothkit knows"
        raise ValueError(
            f"get_chat_template(processor, {chat_template!r}): this processor's own chat template renders "
            f"{renders}; slothkit's formats render text parts only, so an image-text model keeps its "
            f"checkpoint's template, which places the images. "
            + (f"Pass {found.name!r}, or " if found is not None else "")
            + "leave the call out"
        )
    say_once(
        f"get_chat_template(processor, {chat_template!r}): the processor's own chat template renders the "
        f"{requested.name} format and places the images: kept",
        FallbackWarning,
    )
    return processor
