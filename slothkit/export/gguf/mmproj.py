"""llama.cpp's multimodal projector file (mmproj): an image-text model's vision tower and
projector in llama.cpp's clip layout, read by its libmtmd (`llama-mtmd-cli -m text.gguf
--mmproj mmproj.gguf`) beside the language model's own GGUF.

Which families (the image-text config's `model_type`):

    gemma3      written: SigLIP tower + Gemma 3's pooled projector, clip.projector_type "gemma3"
    qwen2_5_vl  written: Qwen2.5-VL's windowed tower + 2 x 2 patch merger, clip.projector_type
                "qwen2.5vl_merger" (slothkit.export.gguf.mmproj_qwen2_5_vl)
    mllama      refused: llama.cpp's mtmd has no Llama 3.2 Vision projector (its mllama
                vision support was removed)

Any other image-text family is refused naming these. Every file holds the same header
(clip.has_vision_encoder, clip.projector_type, the image mean and std, general.name and
file type); the family's keys and tensors follow llama.cpp's tools/mtmd/clip-impl.h (names)
and the family's graph. Gemma 3's (clip.cpp's SigLIP graph):

| HF (under model.vision_tower.vision_model / model.multi_modal_projector) | mmproj tensor |
|---|---|
| embeddings.patch_embedding.weight, .bias | v.patch_embd.weight, .bias (F32) |
| embeddings.position_embedding.weight | v.position_embd.weight (F32) |
| encoder.layers.N.layer_norm1 / layer_norm2 | v.blk.N.ln1 / ln2 |
| encoder.layers.N.self_attn.{q,k,v}_proj / out_proj | v.blk.N.attn_{q,k,v} / attn_out |
| encoder.layers.N.mlp.fc1 / fc2 | v.blk.N.ffn_up / ffn_down |
| post_layernorm | v.post_ln |
| mm_input_projection_weight (vision width, text width) | mm.input_projection.weight, as it is |
| mm_soft_emb_norm.weight | mm.soft_emb_norm.weight, stored as 1 + w |

The projection is stored untransposed: HF computes x @ W, and clip.cpp multiplies by the
transpose of the stored matrix. Gemma's RMSNorm scales by 1 + w; clip.cpp's by the stored
weight, hence the offset. The pooling between tower and projector averages
`clip.vision.projector.scale_factor` x that many patches (patches per side / tokens per side;
llama.cpp's default of 4 is Gemma 3's 64 / 16, written only when it differs, as llama.cpp's
converter does).
"""

from __future__ import annotations

import math
import os
import pathlib

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter

from slothkit.export.gguf import mmproj_qwen2_5_vl as qwen2_5_vl

T = GGMLQuantizationType

# llama.cpp's clip projector type per written family.
PROJECTOR_TYPES = {"gemma3": "gemma3", "qwen2_5_vl": qwen2_5_vl.PROJECTOR_TYPE}
# Families refused, with the reason the error gives.
REFUSED = {
    "mllama": "llama.cpp's mtmd has no Llama 3.2 Vision (mllama) projector: its mllama vision support was removed",
}
GEMMA3_DEFAULT_POOL = 4  # llama.cpp's n_merge for gemma3 when the key is absent
SIGLIP_LAYER_NAMES = {
    "layer_norm1": "ln1",
    "layer_norm2": "ln2",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.out_proj": "attn_out",
    "mlp.fc1": "ffn_up",
    "mlp.fc2": "ffn_down",
}


class UnsupportedImageTextModel(NotImplementedError):
    """An image-text family whose projector file slothkit does not write."""


def check_projector_family(config) -> str:
    """The clip projector type of an image-text config; raise UnsupportedImageTextModel,
    naming the written and refused families, for any other."""
    family = config.model_type
    if family in PROJECTOR_TYPES:
        return PROJECTOR_TYPES[family]
    written = ", ".join(PROJECTOR_TYPES)
    reason = REFUSED.get(family, f"slothkit writes llama.cpp's projector file for {written} only")
    raise UnsupportedImageTextModel(
        f"GGUF export of the image-text model {family!r} is refused: {reason}. Written: {written} "
        f"(the language model's GGUF plus mmproj-<name>.gguf); refused: {', '.join(REFUSED)}. "
        f"The merged model can still be saved with save_pretrained_merged"
    )


def mmproj_file_name(stem: str, float_type: GGMLQuantizationType) -> str:
    """`mmproj-<model>.F16.gguf`: labelled by its matrices' type, as the language model's
    files are by their method."""
    return f"mmproj-{stem}.{float_type.name}.gguf"


def pool_size(config) -> int:
    """Patches averaged per side into one image token (Gemma 3: 64 patches a side, 16 tokens)."""
    vision = config.vision_config
    patches_per_side = vision.image_size // vision.patch_size
    tokens_per_side = math.isqrt(config.mm_tokens_per_image)
    if tokens_per_side**2 != config.mm_tokens_per_image or patches_per_side % tokens_per_side:
        raise ValueError(
            f"mm_tokens_per_image {config.mm_tokens_per_image} is not a square whose side divides the "
            f"{patches_per_side} patches a side; llama.cpp's gemma3 projector pools square blocks"
        )
    return patches_per_side // tokens_per_side


def image_normalisation(processor, family: str = "gemma3") -> tuple[list[float], list[float]]:
    """The image processor's mean and std; without one, the family's (Gemma 3's: 0.5, 0.5;
    Qwen2.5-VL's: OpenAI CLIP's). llama.cpp normalises with those written in the file."""
    image_processor = getattr(processor, "image_processor", None)
    if image_processor is None:
        if family == "qwen2_5_vl":
            return list(qwen2_5_vl.IMAGE_MEAN), list(qwen2_5_vl.IMAGE_STD)
        return [0.5] * 3, [0.5] * 3
    return [float(v) for v in image_processor.image_mean], [float(v) for v in image_processor.image_std]


def mmproj_tensors(model) -> dict[str, torch.Tensor]:
    """The file's tensors in llama.cpp's layout, float32, from a merged image-text model of
    a written family."""
    if model.config.model_type == "qwen2_5_vl":
        return qwen2_5_vl.tensors(model)
    return gemma3_tensors(model)


def gemma3_tensors(model) -> dict[str, torch.Tensor]:
    """Gemma 3's tensors (table above) from a merged Gemma3ForConditionalGeneration."""
    tower = model.model.vision_tower
    tower = getattr(tower, "vision_model", tower)  # SiglipVisionModel wraps its transformer
    projector = model.model.multi_modal_projector
    embeddings = tower.embeddings
    tensors = {
        "v.patch_embd.weight": embeddings.patch_embedding.weight,
        "v.patch_embd.bias": embeddings.patch_embedding.bias,
        "v.position_embd.weight": embeddings.position_embedding.weight,
    }
    for n, layer in enumerate(tower.encoder.layers):
        for hf_name, gguf_name in SIGLIP_LAYER_NAMES.items():
            module = layer.get_submodule(hf_name)
            tensors[f"v.blk.{n}.{gguf_name}.weight"] = module.weight
            tensors[f"v.blk.{n}.{gguf_name}.bias"] = module.bias
    tensors["v.post_ln.weight"] = tower.post_layernorm.weight
    tensors["v.post_ln.bias"] = tower.post_layernorm.bias
    tensors["mm.input_projection.weight"] = projector.mm_input_projection_weight
    tensors["mm.soft_emb_norm.weight"] = 1.0 + projector.mm_soft_emb_norm.weight
    return {name: t.detach().to(torch.float32).cpu() for name, t in tensors.items()}


def planned_bytes(model, float_type: GGMLQuantizationType) -> int:
    """About what the projector file takes on disk: its weights at float_type's size (the
    F32 norms, biases and embeddings are a small part)."""
    if model.config.model_type == "qwen2_5_vl":
        parts = qwen2_5_vl.parts(model)
    else:
        parts = (model.model.vision_tower, model.model.multi_modal_projector)
    return sum(p.numel() for part in parts for p in part.parameters()) * (4 if float_type == T.F32 else 2)


def tensor_type(name: str, tensor: torch.Tensor, float_type: GGMLQuantizationType) -> GGMLQuantizationType:
    """F32 for norms, biases and the embeddings (as llama.cpp's converter keeps them);
    `float_type` (F16 or F32) for the matrices."""
    if tensor.ndim == 1 or name.startswith(("v.patch_embd", "v.position_embd")):  # Qwen's .weight.1 too
        return T.F32
    return float_type


def write_mmproj(
    model,
    path: str | os.PathLike,
    processor=None,
    float_type: GGMLQuantizationType = T.F16,
    name: str = "model",
    tensors: dict[str, torch.Tensor] | None = None,
) -> pathlib.Path:
    """Write the projector file of a merged image-text model of a written family; return its path.

    Args:
        model: the merged (plain) Gemma3ForConditionalGeneration or
            Qwen2_5_VLForConditionalGeneration.
        path: the file to write.
        processor: the model's processor, for the image mean and std (default: the
            family's, image_normalisation).
        float_type: T.F16 (llama.cpp's converter's default for projectors) or T.F32.
        name: general.name.
        tensors: the file's tensors (mmproj_tensors(model) when None); the tests pass
            altered ones to see verification fail.
    """
    config = model.config
    projector_type = check_projector_family(config)
    family = config.model_type
    if float_type not in (T.F16, T.F32):
        raise ValueError(f"the projector file is written in F16 or F32, not {float_type.name}")
    if family == "qwen2_5_vl":
        qwen2_5_vl.check_vision_config(config.vision_config)
    elif getattr(config.vision_config, "vision_use_head", False):
        raise ValueError(
            "a SigLIP tower with a pooling head is not Gemma 3's; llama.cpp's gemma3 graph has none"
        )
    tensors = mmproj_tensors(model) if tensors is None else tensors
    mean, std = image_normalisation(processor, family)

    path = pathlib.Path(path)
    writer = GGUFWriter(path, "clip")
    writer.add_name(name)
    writer.add_file_type(1 if float_type == T.F16 else 0)
    writer.add_bool("clip.has_vision_encoder", True)
    writer.add_string("clip.projector_type", projector_type)
    writer.add_array("clip.vision.image_mean", mean)
    writer.add_array("clip.vision.image_std", std)
    if family == "qwen2_5_vl":
        qwen2_5_vl.write_keys(writer, config)
    else:
        _write_gemma3_keys(writer, config)
    for tensor_name, tensor in tensors.items():
        qtype = tensor_type(tensor_name, tensor, float_type)
        array = tensor.numpy().astype(np.float16 if qtype == T.F16 else np.float32)
        writer.add_tensor(tensor_name, array, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _write_gemma3_keys(writer: GGUFWriter, config) -> None:
    vision = config.vision_config
    writer.add_uint32("clip.vision.image_size", vision.image_size)
    writer.add_uint32("clip.vision.patch_size", vision.patch_size)
    writer.add_uint32("clip.vision.embedding_length", vision.hidden_size)
    writer.add_uint32("clip.vision.feed_forward_length", vision.intermediate_size)
    writer.add_uint32("clip.vision.block_count", vision.num_hidden_layers)
    writer.add_uint32("clip.vision.attention.head_count", vision.num_attention_heads)
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", vision.layer_norm_eps)
    # The language model's width, which mtmd checks against the text GGUF's.
    writer.add_uint32("clip.vision.projection_dim", config.text_config.hidden_size)
    writer.add_bool("clip.use_gelu", True)  # SigLIP's gelu_pytorch_tanh: ggml's gelu is the tanh form
    pool = pool_size(config)
    if pool != GEMMA3_DEFAULT_POOL:
        writer.add_uint32("clip.vision.projector.scale_factor", pool)
