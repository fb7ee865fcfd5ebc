"""GGUF export, written by slothkit itself: no llama.cpp checkout, compiler or binary needed.

    from slothkit.export.gguf import save_pretrained_gguf, push_to_hub_gguf
    paths = save_pretrained_gguf(model, "out/gguf", tokenizer, quantization_method=["q4_k_m", "q8_0"])

- writer: the file's tensors (save_pretrained_gguf, push_to_hub_gguf, write_gguf).
- metadata: the model's hyperparameters as the metadata llama.cpp builds its graph from.
- layout: where each Hugging Face weight goes in the file and how it is transformed on the way
  (Q/K row permutation, norm offset), from the architecture record; and the way back
  (hf_weights_from_gguf).
- deltanet: gated DeltaNet layers (Qwen3.5) in llama.cpp's qwen35 layout: names, transforms, keys.
- gemma4: Gemma 4's per-layer inputs, shared key/value layers and per-layer shapes in llama.cpp's
  gemma4 layout.
- tensor_types: the quantization methods (parsed once, where users pass them: quantization_methods),
  which GGML type each tensor gets for a method, and its encoding.
- kquants: the K-quant encoders and decoders (Q4_K, Q5_K, Q6_K).
- tokenizer: the vocabulary and pre-tokenizer metadata llama.cpp reads.
- pre_tokenizer: which pre-tokenizer llama.cpp runs for a byte-level tokenizer, named as its converter names it.
- modelfile: Ollama's Modelfile for an exported file.
- verify: llama.cpp (llama-cpp-python) reads the file back and is compared with the HF model.
- image_text: an image-text model's language model as a text model of its own, for its GGUF.
- mmproj: an image-text model's vision tower and projector as llama.cpp's projector file.
- mmproj_qwen2_5_vl: Qwen2.5-VL's tower and patch merger in that file (its keys and tensors),
  and the pixels its reference features are computed from.
- verify_mmproj: llama.cpp's libmtmd encodes an image with the projector file, compared with
  the HF model's image features.

Imports go one way (tests/slothkit/export/gguf/test_imports.py checks it, imports inside
functions included): layout and tensor_types need neither writer nor verify; verify reads
files back through layout; layout reads deltanet, gemma4 and experts; metadata reads layout,
attention, deltanet and gemma4; mmproj reads mmproj_qwen2_5_vl; verify_mmproj reads verify
and mmproj_qwen2_5_vl; writer uses all of them.
"""

from slothkit.export.gguf.tensor_types import QUANTIZATION_METHODS, QuantizationMethod, quantization_methods
from slothkit.export.gguf.writer import push_to_hub_gguf, save_pretrained_gguf, write_gguf

__all__ = [
    "QUANTIZATION_METHODS",
    "QuantizationMethod",
    "push_to_hub_gguf",
    "quantization_methods",
    "save_pretrained_gguf",
    "verify_gguf",
    "write_gguf",
]


def __getattr__(name):
    # verify imports llama-cpp-python's loader helpers; load it only when asked for.
    if name == "verify_gguf":
        from slothkit.export.gguf.verify import verify_gguf

        return verify_gguf
    raise AttributeError(f"module 'slothkit.export.gguf' has no attribute {name!r}")
