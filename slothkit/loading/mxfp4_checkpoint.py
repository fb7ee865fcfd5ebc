"""A checkpoint whose experts are stored in MXFP4 (gpt-oss as OpenAI released it) loads
through transformers' MXFP4 dequantisation, said once before it loads.

transformers would keep MXFP4 experts as they are on a GPU, in kernels that do not train.
slothkit asks it to dequantise them as they load (``Mxfp4Config(dequantize=True)``), one
tensor at a time, into the model's dtype; with ``load_in_4bit=True`` each experts tensor
is then quantised to NF4 the moment it is registered (slothkit.engine.experts_loading), so
no 16-bit copy of all the experts is ever held.  The checkpoint's other layers (attention,
router, embeddings) are stored in 16 bits, and they load in 16 bits: bitsandbytes' 4-bit
loading cannot be combined with the checkpoint's own quantisation config.  The loaded
model carries no MXFP4 config, so its merged saves are plain 16-bit checkpoints.
"""

from __future__ import annotations

from slothkit.core.notices import FallbackWarning, say_once


def quantization_method(config) -> str | None:
    """The checkpoint's quantisation method ("mxfp4", "bitsandbytes", ...), or None."""
    quantization = getattr(config, "quantization_config", None)
    if quantization is None:
        return None
    if isinstance(quantization, dict):
        return quantization.get("quant_method")
    return getattr(quantization, "quant_method", None)


def holds_mxfp4_experts(config) -> bool:
    return quantization_method(config) == "mxfp4"  # transformers' QuantizationMethod is a str enum


def mxfp4_dequantization():
    """What transformers is given to load MXFP4 experts as 16-bit (or, through slothkit's
    experts hook, NF4) tensors rather than its untrainable MXFP4 modules."""
    from transformers import Mxfp4Config

    return Mxfp4Config(dequantize=True)


def notice_mxfp4_experts(config, model_name: str, load_in_4bit: bool) -> None:
    """Say once that `model_name` holds MXFP4 experts and what they load as."""
    if not holds_mxfp4_experts(config):
        return
    if load_in_4bit:
        what = (
            "slothkit quantises each to NF4 as it arrives, so no 16-bit copy of all the experts is held; "
            "its attention, router and embeddings stay 16-bit as the checkpoint stores them "
            "(bitsandbytes' 4-bit loading does not combine with an MXFP4 checkpoint)"
        )
    else:
        what = (
            "they stay in the model's dtype (gpt-oss-20b: about 39 GiB of weights in 16 bits); "
            "load_in_4bit=True keeps them in NF4"
        )
    say_once(
        f"slothkit: {model_name} stores its experts in MXFP4, which trains in no kernel: transformers "
        f"dequantises them as they load, and {what}",
        FallbackWarning,
    )
