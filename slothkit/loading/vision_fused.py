"""The language model of an image-text model on slothkit's fused path.

An image-text model (Gemma3ForConditionalGeneration, Qwen2_5_VLForConditionalGeneration)
runs its vision tower and projector, writes the image features into the input embeddings
at the image tokens, and hands those to its language model: a decoder of a family
slothkit has a record for (Gemma 3's text model: the gemma3 record; Qwen2.5-VL's: qwen2,
by its `language_model_types`). From the embeddings on, the layers compute what that
family's text model computes, so the record's fused layers replace them on this instance
(slothkit.engine.decoder.patch_decoder, which finds the language model's layers); the
vision tower and projector keep Hugging Face's modules.

    what_runs = fuse_language_model(model, fused=None)

Rotary positions: the fused attention rotates by the (B, T, D) cos/sin tables the model's
rotary module hands each layer. Qwen2.5-VL's M-RoPE gives the frequency bands of each
head (mrope_section) the temporal, height or width position of the token; transformers
(5.2x) composes those bands into one such table per row, which the fused RoPE reads as it
is. Where a language model's rotary module returns anything else (one table per section,
as older transformers did), it keeps its own layers, said once.

The head: both outer models compute transformers' plain causal LM loss (labels shifted
by one, -100 ignored, the image tokens masked by the collator) from lm_head's logits,
which is what the fused linear cross-entropy computes from the last hidden state; the
head is fused only where the model's own loss on a random batch agrees
(slothkit.engine.generic_head.why_head_stays), else the model keeps its loss.
"""

from __future__ import annotations

import torch
from torch import nn

from slothkit.core.inspection import language_model_of
from slothkit.engine.decoder import patch_decoder
from slothkit.engine.generic_head import why_head_stays
from slothkit.loading.load_model import takes_fused_path
from slothkit.models import language_model_architecture, supported_summary

HF_MODULES = "Hugging Face's modules"


def why_rotary_stays(language_model: nn.Module) -> str | None:
    """Why the fused attention cannot rotate by this language model's rotary tables, or
    None. Only multimodal rotary positions (a config with mrope_section) are probed: their
    module is called on (3, 1, T) positions, as Qwen2.5-VL's text model calls it."""
    config = language_model.config
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if "mrope_section" not in rope:
        return None
    rotary = getattr(language_model, "rotary_emb", None)
    if not isinstance(rotary, nn.Module):
        return "its multimodal rotary positions come from no rotary_emb module to check"
    embeddings = language_model.get_input_embeddings().weight
    x = torch.zeros(1, 4, 1, device=embeddings.device, dtype=embeddings.dtype)
    positions = torch.arange(4, device=embeddings.device).view(1, 1, -1).expand(3, 1, -1)
    with torch.no_grad():
        cos, _ = rotary(x, positions)
    if cos.dim() != 3:
        return (
            f"its rotary module returns M-RoPE tables of shape {tuple(cos.shape)}, one per section, "
            f"which the fused RoPE does not compose (it reads one (B, T, D) table)"
        )
    return None


def fuse_language_model(model: nn.Module, fused: bool | None) -> str:
    """Patch the fused layers (and, where its loss is the plain one, the fused linear
    cross-entropy) onto the language model of the image-text `model` where they apply;
    return what its language model runs, for the load notice.

    fused: as FastModel's: None runs the fused path where Triton runs on the model's
    device (elsewhere the kernels would run their slower torch references), True
    everywhere, False nowhere.

    Raises:
        ValueError: fused=True and slothkit has no fused path for the language model (the
            reason named).
    """
    language_model = language_model_of(model)
    text_type = model.config.get_text_config().model_type
    arch = language_model_architecture(model.config)
    if arch is None:
        if fused:
            raise ValueError(
                f"fused=True, but slothkit has no fused path for this image-text model's {text_type!r} "
                f"language model; fused families: {supported_summary()}; pass fused=None or False"
            )
        return f"{HF_MODULES} (slothkit has no fused path for its {text_type!r} language model)"
    if fused is False:
        return f"{HF_MODULES} (fused=False)"
    if not takes_fused_path(model, arch, fused):
        return (
            f"{HF_MODULES} (the fused {arch.name} layers need Triton on its device; fused=True asks anyway)"
        )
    reason = why_rotary_stays(language_model)
    if reason is not None:
        if fused:
            raise ValueError(
                f"fused=True, but the {text_type!r} language model cannot run the fused layers: {reason}"
            )
        return f"{HF_MODULES} (not the fused {arch.name} layers: {reason})"
    head_reason = why_head_stays(model)
    patch_decoder(model, arch, fused_head=head_reason is None)
    head = "the fused linear cross-entropy" if head_reason is None else f"its own loss ({head_reason})"
    return f"slothkit's fused {arch.name} layers (norms, attention with LoRA and RoPE, MLP) and {head}"
