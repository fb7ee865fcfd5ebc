"""Gated DeltaNet (linear attention) layers in llama.cpp's layout: Qwen3.5's "qwen35" graph.

A DeltaNet layer of transformers' Qwen3.5 (linear_attn) holds, for K key heads and V value
heads (V a multiple of K: each key head serves R = V / K value heads), of widths dk and dv:

    HF parameter              shape                 GGUF tensor          stored as
    in_proj_qkv.weight        (2 K dk + V dv, h)    attn_qkv.weight      V rows tiled (below)
    in_proj_z.weight          (V dv, h)             attn_gate.weight     rows tiled
    in_proj_b.weight          (V, h)                ssm_beta.weight      rows tiled
    in_proj_a.weight          (V, h)                ssm_alpha.weight     rows tiled
    A_log                     (V,)                  ssm_a                A = -exp(A_log), tiled
    dt_bias                   (V,)                  ssm_dt.bias          tiled
    conv1d.weight             (2 K dk + V dv, 1, w) ssm_conv1d.weight    (channels, w), V tiled
    norm.weight               (dv,)                 ssm_norm.weight      w as it is (no + 1)
    out_proj.weight           (h, V dv)             ssm_out.weight       columns tiled

as llama.cpp's converter writes them (Qwen3NextModel and _LinearAttentionVReorderBase in its
conversion/qwen.py). The decay is exp(softplus(a + dt_bias) * A) per step, so the graph is
handed A itself rather than its log. The gated norm multiplies by w (transformers'
Qwen3_5RMSNormGated), unlike the layer's other norms (1 + w), so no offset is added to it.

Tiled order: HF keeps the value heads grouped by their key head, (k0: v0..v{R-1}, k1: ...);
llama.cpp broadcasts the K key heads over the V value heads by repeating them whole
(k0, k1, ..., k0, k1, ...), so the value heads are stored in that order: head (k, r) moves
from position k R + r to r K + k. Nothing moves when K = V.

The file states the layer pattern as one number, full_attention_interval: layer i attends
when (i + 1) % interval == 0, otherwise it is a DeltaNet layer; a model whose layer_types do
not follow such a pattern is refused. Its keys (ssm.*):

    ssm.conv_kernel    the convolution's width w          ssm.group_count     K
    ssm.state_size     dk                                 ssm.time_step_rank  V
    ssm.inner_size     V dv
"""

from __future__ import annotations

import dataclasses

import torch

_TENSORS = {  # linear_attn's parameter -> the GGUF tensor (blk.N.<name>)
    "in_proj_qkv.weight": "attn_qkv.weight",
    "in_proj_z.weight": "attn_gate.weight",
    "in_proj_b.weight": "ssm_beta.weight",
    "in_proj_a.weight": "ssm_alpha.weight",
    "A_log": "ssm_a",
    "dt_bias": "ssm_dt.bias",
    "conv1d.weight": "ssm_conv1d.weight",
    "norm.weight": "ssm_norm.weight",
    "out_proj.weight": "ssm_out.weight",
}
# What a tensor holds in place of HF's parameter: (to the file, back to HF's). The graph
# multiplies softplus(a + dt_bias) by A itself, HF holds log(-A).
_STORED = {"ssm_a": (lambda a_log: -torch.exp(a_log), lambda a: torch.log(-a))}
_PREFIX = "model.layers."
_MODULE = ".linear_attn."


@dataclasses.dataclass(frozen=True)
class DeltaNetShape:
    key_heads: int  # K
    value_heads: int  # V, a multiple of K
    key_dim: int  # dk
    value_dim: int  # dv
    conv_kernel: int  # w
    full_attention_interval: int  # layer i attends when (i + 1) % interval == 0

    @property
    def values_per_key(self) -> int:
        return self.value_heads // self.key_heads


def deltanet_shape(config) -> DeltaNetShape:
    """The DeltaNet layers' shape and the layer pattern of a Qwen3.5 config, refused where
    llama.cpp's graph would place the layers otherwise (module docstring)."""
    shape = DeltaNetShape(
        key_heads=config.linear_num_key_heads,
        value_heads=config.linear_num_value_heads,
        key_dim=config.linear_key_head_dim,
        value_dim=config.linear_value_head_dim,
        conv_kernel=config.linear_conv_kernel_dim,
        full_attention_interval=_interval(config.layer_types),
    )
    if shape.value_heads % shape.key_heads:
        raise ValueError(
            f"a DeltaNet layer shares each key head among value heads; this config has "
            f"{shape.value_heads} value heads for {shape.key_heads} key heads (not a multiple)"
        )
    return shape


def _interval(layer_types) -> int:
    """The n with layer i attending exactly when (i + 1) % n == 0."""
    full = [i for i, kind in enumerate(layer_types) if kind == "full_attention"]
    unknown = sorted(set(layer_types) - {"full_attention", "linear_attention"})
    if not unknown and full:
        interval = full[0] + 1
        if full == list(range(interval - 1, len(layer_types), interval)):
            return interval
    raise NotImplementedError(
        "llama.cpp's qwen35 graph places one full-attention layer after every n - 1 DeltaNet "
        f"layers (full_attention_interval n) and reads no per-layer list; this model's layer_types "
        f"are {list(layer_types)}"
    )


# transformers' Qwen3_5RotaryEmbedding shares the rotated pairs among three position axes
# (time, height, width), interleaved: pair j follows height when j % 3 == 1 and j < 3 s_h,
# width when j % 3 == 2 and j < 3 s_w, time otherwise, for mrope_section (s_t, s_h, s_w),
# by default this. llama.cpp's qwen35 graph requires the split as rope.dimension_sections
# (four entries), within the rotated pairs. A text prompt gives every axis the same position,
# so the split changes nothing there; the file states how many of the rotated pairs follow
# each axis, which is the model's split where it fits (Qwen3.5-9B: 32 pairs, 11 + 11 + 10).
_HF_DEFAULT_ROPE_SECTIONS = (11, 11, 10)


def rope_sections(rope: dict, rope_dims: int) -> tuple[int, ...]:
    """rope.dimension_sections: how many of the rope_dims / 2 rotated pairs follow each axis."""
    sections = tuple(int(n) for n in rope.get("mrope_section") or _HF_DEFAULT_ROPE_SECTIONS)
    counts = [0, 0, 0, 0]
    for pair in range(rope_dims // 2):
        axis = pair % 3
        counts[axis if axis and pair < 3 * sections[axis] else 0] += 1
    return tuple(counts)


def gguf_tensor_name(hf_name: str) -> tuple[str, int] | None:
    """The GGUF name and layer of a DeltaNet parameter, or None for any other weight."""
    if not hf_name.startswith(_PREFIX) or _MODULE not in hf_name:
        return None
    layer, _, parameter = hf_name[len(_PREFIX) :].partition(_MODULE)
    name = _TENSORS.get(parameter)
    if name is None or not layer.isdigit():
        return None
    return f"blk.{layer}.{name}", int(layer)


def holds(name: str) -> bool:
    """Whether GGUF tensor `name` is a DeltaNet layer's."""
    return name.partition(".")[2].partition(".")[2] in _TENSORS.values()


def stored_shape(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape GGUF tensor `name` has in the file, of a parameter of shape `shape`: the
    convolution's one input channel dropped, the others as they are."""
    if name.endswith(".ssm_conv1d.weight"):
        return (shape[0], shape[-1])
    return shape


def to_gguf(value: torch.Tensor, name: str, shape: DeltaNetShape) -> torch.Tensor:
    """A DeltaNet parameter as GGUF tensor `name` holds it (module docstring)."""
    kind = name.partition(".")[2].partition(".")[2]
    if kind in _STORED:
        value = _STORED[kind][0](value.float())
    value = value.reshape(stored_shape(name, tuple(value.shape)))
    return _reorder(value, kind, shape, _tiled)


def from_gguf(value: torch.Tensor, name: str, shape: DeltaNetShape, hf_shape) -> torch.Tensor:
    """Inverse of to_gguf: GGUF tensor `name` back in HF's layout (of shape `hf_shape`)."""
    kind = name.partition(".")[2].partition(".")[2]
    value = _reorder(value, kind, shape, _grouped)
    if kind in _STORED:
        value = _STORED[kind][1](value)
    return value.reshape(hf_shape)


def _reorder(value: torch.Tensor, kind: str, shape: DeltaNetShape, order) -> torch.Tensor:
    """The value heads of tensor `kind` put in `order` (_tiled or _grouped) along their axis."""
    if shape.values_per_key == 1 or kind == "ssm_norm.weight":
        return value
    if kind in ("attn_qkv.weight", "ssm_conv1d.weight"):
        qk = 2 * shape.key_heads * shape.key_dim  # the q and k rows stay where they are
        return torch.cat([value[:qk], order(value[qk:], 0, shape, shape.value_dim)])
    if kind == "ssm_out.weight":
        return order(value, 1, shape, shape.value_dim)
    width = shape.value_dim if kind == "attn_gate.weight" else 1
    return order(value, 0, shape, width)


def _tiled(value: torch.Tensor, axis: int, shape: DeltaNetShape, width: int) -> torch.Tensor:
    """Value heads along `axis` (each `width` long) from grouped (k, r) to tiled (r, k) order."""
    return _swap(value, axis, (shape.key_heads, shape.values_per_key), width)


def _grouped(value: torch.Tensor, axis: int, shape: DeltaNetShape, width: int) -> torch.Tensor:
    """Inverse of _tiled."""
    return _swap(value, axis, (shape.values_per_key, shape.key_heads), width)


def _swap(value: torch.Tensor, axis: int, heads: tuple[int, int], width: int) -> torch.Tensor:
    """Split `axis` into (heads[0], heads[1], width) and swap the two head axes."""
    split = (*value.shape[:axis], *heads, width, *value.shape[axis + 1 :])
    return value.reshape(split).transpose(axis, axis + 1).reshape(value.shape)
