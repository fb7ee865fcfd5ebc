"""Qwen2.5-VL's vision tower and patch merger in llama.cpp's projector file (clip.projector_type
"qwen2.5vl_merger", the graph of tools/mtmd/models/qwen2vl.cpp), and the pixels its
reference features are computed from.

The tower: a patch embedding (a Conv3d over two frames of 14 x 14 patches, no bias), blocks
of RMSNorm, attention with a fused qkv and 2-D rotary positions (height, width) and a gated
SiLU MLP, most blocks attending within windows of window_size pixels and those of
fullatt_block_indexes to the whole image; then the merger: an RMSNorm, each 2 x 2 block of
neighbouring patches concatenated (4 x width) and a two-layer GELU MLP to the text width.

| HF (under model.visual) | mmproj tensor |
|---|---|
| patch_embed.proj.weight (width, 3, 2, 14, 14) | v.patch_embd.weight = [:, :, 0], v.patch_embd.weight.1 = [:, :, 1] (F32) |
| blocks.N.norm1 / norm2 (RMSNorm) | v.blk.N.ln1 / ln2 |
| blocks.N.attn.qkv (rows q, k, v) | v.blk.N.attn_q / attn_k / attn_v, the rows cut in three |
| blocks.N.attn.proj | v.blk.N.attn_out |
| blocks.N.mlp.gate_proj / up_proj / down_proj | v.blk.N.ffn_gate / ffn_up / ffn_down |
| merger.ln_q (RMSNorm) | v.post_ln |
| merger.mlp.0 / merger.mlp.2 | mm.0 / mm.2 |

The Conv3d's two temporal slices become two 2-D kernels: a still image is both frames (the
image processor repeats it), so the 3-D convolution is the sum of the two 2-D ones, which is
what llama.cpp computes. Keys beyond the common ones: clip.use_silu (the gated MLP),
clip.vision.n_wa_pattern (every n-th block attends fully: the full-attention blocks must be
n - 1, 2n - 1, ..., as llama.cpp's graph reads no list), clip.vision.window_size and
clip.vision.spatial_merge_size. llama.cpp fixes the vision rotary base (10000) and the
window (112 pixels: LLAMA_CPP_WINDOW) and reads the RMSNorm epsilon from the file;
transformers' base and epsilon are 10000 and 1e-6, and a tower with another window is
refused.
"""

from __future__ import annotations

import math

import numpy as np
import torch

PROJECTOR_TYPE = "qwen2.5vl_merger"
# OpenAI CLIP's normalisation, which every Qwen2.5-VL image processor uses: written when no
# processor is given.
IMAGE_MEAN = [0.48145466, 0.4578275, 0.40821073]
IMAGE_STD = [0.26862954, 0.26130258, 0.27577711]
RMS_EPS = 1e-6  # transformers' Qwen2.5-VL vision RMSNorms (blocks and merger)
ROPE_THETA = 10_000.0  # transformers' vision rotary base; llama.cpp's graph fixes the same
# llama.cpp's qwen2vl image preprocessing gives an image at least this many tokens
# (hparams.set_limit_image_tokens(8, ...)); a smaller image is scaled up.
LLAMA_CPP_MIN_IMAGE_TOKENS = 8
# llama.cpp's qwen2.5vl graph (llama-cpp-python 0.3.36) groups the patches into windows of
# 112 pixels a side, every published Qwen2.5-VL's window_size, and reads no key for it:
# a file stating 56 encodes as one stating 112 (measured).
LLAMA_CPP_WINDOW = 112
LAYER_NAMES = {
    "norm1": "ln1",
    "norm2": "ln2",
    "attn.proj": "attn_out",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def window_pattern(vision) -> int:
    """clip.vision.n_wa_pattern: llama.cpp's graph lets block i attend fully when (i + 1) is
    a multiple of it, windowed otherwise; refused where fullatt_block_indexes is not that, or
    names every block (n_wa_pattern 1: llama.cpp's graph then aborts, its window mask unused)."""
    full = list(vision.fullatt_block_indexes)
    pattern = full[0] + 1 if full else 0
    expected = [i for i in range(vision.depth) if pattern and (i + 1) % pattern == 0]
    if not full or full != expected:
        raise ValueError(
            f"Qwen2.5-VL's fullatt_block_indexes {full} over {vision.depth} blocks are not every n-th block "
            f"(n - 1, 2n - 1, ...), the only pattern llama.cpp's qwen2.5vl graph reads (clip.vision.n_wa_pattern)"
        )
    if pattern == 1:
        raise ValueError(
            "every block of this Qwen2.5-VL tower attends fully (fullatt_block_indexes); llama.cpp's qwen2.5vl "
            "graph fails on such a file (n_wa_pattern 1: 'Failed to get tensor window_mask')"
        )
    return pattern


def check_vision_config(vision) -> None:
    """Refuse a tower that llama.cpp's graph would compute otherwise than transformers."""
    if vision.temporal_patch_size != 2:
        raise ValueError(
            f"llama.cpp's qwen2.5vl graph splits the patch embedding into two frames; this tower's "
            f"temporal_patch_size is {vision.temporal_patch_size}"
        )
    if vision.spatial_merge_size != 2:
        raise ValueError(
            f"llama.cpp's qwen2.5vl graph merges 2 x 2 patches; this tower's spatial_merge_size is "
            f"{vision.spatial_merge_size}"
        )
    if vision.hidden_act != "silu":
        raise ValueError(
            f"llama.cpp's qwen2.5vl graph gates the MLP by SiLU; this tower uses {vision.hidden_act!r}"
        )
    theta = float((getattr(vision, "rope_parameters", None) or {}).get("rope_theta", ROPE_THETA))
    if theta != ROPE_THETA:
        raise ValueError(
            f"llama.cpp's qwen2.5vl graph rotates with base {ROPE_THETA:g}; this tower's is {theta:g}"
        )
    if vision.window_size != LLAMA_CPP_WINDOW:
        raise ValueError(
            f"llama.cpp's qwen2.5vl graph attends within windows of {LLAMA_CPP_WINDOW} pixels whatever the file "
            f"says (clip.vision.window_size is read by other graphs only); this tower's window_size is "
            f"{vision.window_size}"
        )
    window_pattern(vision)


def write_keys(writer, config) -> None:
    """The family's clip.* keys (module docstring), besides the common ones."""
    vision = config.vision_config
    writer.add_uint32("clip.vision.image_size", 560)  # unread by the dynamic-size graph; the converter's
    writer.add_uint32("clip.vision.patch_size", vision.patch_size)
    writer.add_uint32("clip.vision.embedding_length", vision.hidden_size)
    writer.add_uint32("clip.vision.feed_forward_length", vision.intermediate_size)
    writer.add_uint32("clip.vision.block_count", vision.depth)
    writer.add_uint32("clip.vision.attention.head_count", vision.num_heads)
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", RMS_EPS)
    writer.add_uint32("clip.vision.projection_dim", vision.out_hidden_size)
    writer.add_bool("clip.use_silu", True)
    writer.add_uint32("clip.vision.n_wa_pattern", window_pattern(vision))
    writer.add_uint32("clip.vision.window_size", vision.window_size)
    writer.add_uint32("clip.vision.spatial_merge_size", vision.spatial_merge_size)


def tower(model):
    return model.model.visual


def tensors(model) -> dict[str, torch.Tensor]:
    """The file's tensors in llama.cpp's layout (table above), float32, from a merged
    Qwen2_5_VLForConditionalGeneration."""
    visual = tower(model)
    patch = visual.patch_embed.proj.weight  # (width, channels, frames, patch, patch)
    out = {"v.patch_embd.weight": patch[:, :, 0], "v.patch_embd.weight.1": patch[:, :, 1]}
    for n, block in enumerate(visual.blocks):
        for part in ("weight", "bias"):
            fused = getattr(block.attn.qkv, part)
            for name, rows in zip(("attn_q", "attn_k", "attn_v"), fused.chunk(3, dim=0)):
                out[f"v.blk.{n}.{name}.{part}"] = rows
        for hf_name, gguf_name in LAYER_NAMES.items():
            module = block.get_submodule(hf_name)
            out[f"v.blk.{n}.{gguf_name}.weight"] = module.weight
            if getattr(module, "bias", None) is not None:
                out[f"v.blk.{n}.{gguf_name}.bias"] = module.bias
    out["v.post_ln.weight"] = visual.merger.ln_q.weight
    for index in (0, 2):
        layer = visual.merger.mlp[index]
        out[f"mm.{index}.weight"] = layer.weight
        out[f"mm.{index}.bias"] = layer.bias
    return {name: t.detach().to(torch.float32).cpu().contiguous() for name, t in out.items()}


def parts(model) -> tuple:
    return (tower(model),)


def verification_image_shape(vision) -> tuple[int, int]:
    """(height, width) in pixels of the image that verification encodes: sides multiples of
    a merged patch (llama.cpp's preprocessing then keeps the size), at least llama.cpp's
    minimum of image tokens, and windows of two sizes: two windows of merged patches a row,
    one more row than a window, so that a window is cut short at the bottom."""
    merged = vision.patch_size * vision.spatial_merge_size  # pixels a side of one image token
    per_window = max(1, vision.window_size // merged)  # image tokens a side of one window
    rows = per_window + 1
    columns = max(2 * per_window, math.ceil(LLAMA_CPP_MIN_IMAGE_TOKENS / rows))
    return rows * merged, columns * merged


def pixel_values(
    image: np.ndarray, mean: np.ndarray, std: np.ndarray, vision
) -> tuple[torch.Tensor, torch.Tensor]:
    """(pixel_values, image_grid_thw) of one uint8 (height, width, 3) image whose sides are
    multiples of a merged patch, as Qwen2.5-VL's image processor lays them out without
    resizing: normalised (uint8 / 255 - mean) / std, the frame repeated over the temporal
    patch, each patch's (channel, frame, row, column) values in a row, and the patches in
    2 x 2 merge blocks, the blocks row by row."""
    patch, merge, frames = vision.patch_size, vision.spatial_merge_size, vision.temporal_patch_size
    height, width, channels = image.shape
    grid_h, grid_w = height // patch, width // patch
    if height % (patch * merge) or width % (patch * merge):
        raise ValueError(
            f"an image of {height} x {width} pixels is not made of whole {patch * merge}-pixel blocks"
        )
    normalised = (image.astype(np.float32) / 255.0 - mean) / std
    pixels = torch.from_numpy(normalised.astype(np.float32)).permute(2, 0, 1)
    video = pixels[None].expand(frames, -1, -1, -1)  # (frames, channels, height, width)
    blocks = video.reshape(frames, channels, grid_h // merge, merge, patch, grid_w // merge, merge, patch)
    # -> (block row, block column, row in block, column in block, channel, frame, y, x)
    ordered = blocks.permute(2, 5, 3, 6, 1, 0, 4, 7)
    values = ordered.reshape(grid_h * grid_w, channels * frames * patch * patch).contiguous()
    return values, torch.tensor([[1, grid_h, grid_w]])


def hf_image_features(model, image: np.ndarray, mean: np.ndarray, std: np.ndarray) -> np.ndarray:
    """transformers' get_image_features (tower and merger) of `image`: (image tokens, text
    width), float32, on a float32 copy of a 16-bit tower."""
    import copy

    visual = tower(model)
    if next(visual.parameters()).dtype != torch.float32:
        visual = copy.deepcopy(visual).float()
    values, grid = pixel_values(image, mean, std, model.config.vision_config)
    device = next(visual.parameters()).device
    with torch.no_grad():
        features = visual(values.to(device), grid_thw=grid.to(device)).pooler_output
    return features.float().cpu().numpy()
