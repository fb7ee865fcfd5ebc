"""A checkpoint whose experts are stored in MXFP4 (gpt-oss as OpenAI released it): said once
before it loads, with what transformers will do and what loads for training instead.

transformers keeps MXFP4 experts as they are on a GPU with its MXFP4 kernels, and warns that
it does not train them; elsewhere it dequantises them to 16 bits, which for gpt-oss-20b is
about 39 GiB. slothkit has no MXFP4 path: a 16-bit copy loaded with load_in_4bit=True has its
experts quantised to NF4 as they load (slothkit.engine.experts_loading), which trains.
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


def notice_mxfp4_experts(config, model_name: str) -> None:
    """Say once that `model_name` holds MXFP4 experts and what to load to fine-tune it."""
    if quantization_method(config) != "mxfp4":  # transformers' QuantizationMethod is a str enum
        return
    say_once(
        f"slothkit: {model_name} stores its experts in MXFP4, which slothkit does not train: "
        "transformers keeps them in MXFP4 on a GPU with its MXFP4 kernels (and warns that it "
        "does not train them), else dequantises them to 16 bits (gpt-oss-20b: about 39 GiB). "
        "To fine-tune, load a 16-bit copy (for gpt-oss-20b, unsloth/gpt-oss-20b-BF16) with "
        "load_in_4bit=True: slothkit quantises its experts to NF4 as they load",
        FallbackWarning,
    )
