"""Where each Hugging Face weight goes in a GGUF file, and how it is transformed on the way.

The writer applies these rules (to_gguf) and the reader undoes them (hf_weights_from_gguf,
which slothkit.export.gguf.verify runs the HF model on); both import them from here, so
that the rules live in one place and neither module imports the other's.

What differs between architectures is the record's GGUF layout (slothkit.models,
Architecture.gguf) and its norm flavour, matching llama.cpp's convert_hf_to_gguf.py
(LlamaModel, GemmaModel, Gemma3Model):

    HF model_type   GGUF arch   Q/K rows           RMSNorm weights    output
    llama           llama       permuted (below)   w                  output.weight unless tied
    mistral         llama       permuted           w                  output.weight unless tied
    gemma           gemma       as stored          1 + w (in F32)     none: tied to token_embd
    gemma3_text     gemma3      as stored          1 + w (in F32)     output.weight unless tied
    phi3            phi3        as stored (fused)  w                  output.weight unless tied
    gemma2          gemma2      as stored          1 + w (in F32)     none: tied to token_embd
    gpt_oss         gpt-oss     as stored          w                  output.weight

The per-layer norms are named by the record (GGUFLayout.norms): Llama's two are attn_norm and
ffn_norm; Gemma 3's six are attn_norm, attn_q_norm, attn_k_norm, post_attention_norm,
ffn_norm (HF's pre_feedforward_layernorm) and post_ffw_norm. Every one of Gemma 3's holds
1 + w, q/k norms included: llama.cpp's converter adds 1 to every "norm.weight" of Gemma3Model.
Gemma 2's four are Gemma 3's without the q/k norms. gpt-oss's post_attention_layernorm (the
MLP's input norm, as Llama's) is llama.cpp's post_attention_norm, and its attention sinks
(self_attn.sinks, one logit per head) are blk.N.attn_sinks.weight.

Q/K permutation: HF's rotary embedding rotates the two halves of each head (rotate_half:
pairs (i, i + d/2)); llama.cpp's llama arch rotates adjacent pairs (2i, 2i + 1). The rows of
q_proj and k_proj are reordered within each head so that both compute the same attention:
    rows (head, half, i) -> (head, i, half),  i.e. reshape(n_head, 2, d/2, -1).swapaxes(1, 2).
Gemma's arch in llama.cpp uses the "neox" (half-split) rotation, so its rows stay as they are.

Norm offset: llama.cpp's graphs compute every RMSNorm as x * w, while an architecture whose
norm adds one (Gemma) computes x * (1 + w); so 1 is added (in float32, then stored as F32:
adding 1 in bf16 would round w away).
"""

from __future__ import annotations

import os
import re

import numpy as np
import torch

from slothkit.export.gguf import deltanet, gemma4
from slothkit.export.gguf.experts import Piece, expert_pieces, join, piece_shape
from slothkit.models import EXPERT_RECORDS, EXPORT_ONLY_RECORDS, RECORDS, Architecture, export_record_for

_TOP_LEVEL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_PROJECTIONS = {  # every architecture's; the norms come from the record
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    # Phi-3's fused layers, written as they are: llama.cpp's phi3 graph splits attn_qkv's rows
    # into q, k, v and ffn_up's into gate (the first half, under SiLU) and up.
    "self_attn.qkv_proj": "attn_qkv",
    "mlp.gate_up_proj": "ffn_up",
    # A shared expert beside the routed ones (Qwen3.5's MoE sizes), and its gate (one row).
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)")
# gpt-oss's attention sinks: a parameter of the attention module, one logit per head.
_SINKS = re.compile(r"model\.layers\.(\d+)\.self_attn\.sinks")


def architecture_of(model) -> Architecture:
    """The architecture record of `model`, refused with the supported ones named."""
    config = getattr(model, "config", None)
    arch = export_record_for(config)
    if arch is None:
        supported = ", ".join(repr(t) for a in RECORDS for t in a.model_types)
        supported += "".join(f", {t!r}" for a in EXPORT_ONLY_RECORDS for t in a.model_types)
        experts = ", ".join(repr(t) for a in EXPERT_RECORDS for t in a.model_types)
        raise ValueError(
            f"GGUF export supports the architectures {supported} and the mixture-of-experts {experts}; "
            f"this model's config.model_type is {getattr(config, 'model_type', None)!r}"
        )
    return arch


def norm_offset(arch: Architecture) -> float:
    """What is added to RMSNorm weights in the file (see the module docstring)."""
    return 1.0 if arch.norm_adds_one else 0.0


def head_counts(config) -> tuple[int, int]:
    """(query heads, key/value heads) of a transformers config."""
    n_heads = config.num_attention_heads
    return n_heads, getattr(config, "num_key_value_heads", None) or n_heads


def gguf_tensor_name(hf_name: str, arch: Architecture) -> tuple[str, int | None] | None:
    """The GGUF name of a Hugging Face weight and its layer (None outside the layers), or None
    when the weight has no place in the file.

    Args:
        hf_name: the weight's name in the model's state_dict.
        arch: the model's architecture record; its GGUF layout names the per-layer norms.
    """
    if hf_name in _TOP_LEVEL:
        return _TOP_LEVEL[hf_name], None
    sinks = _SINKS.fullmatch(hf_name)
    if sinks is not None:
        layer = int(sinks.group(1))
        return f"blk.{layer}.attn_sinks.weight", layer
    match = _LAYER_NAME.fullmatch(hf_name)
    if match is None:
        return None
    module = match.group(2)
    name = _PROJECTIONS.get(module) or dict(arch.gguf.norms).get(module)
    if name is None:
        return None
    layer = int(match.group(1))
    return f"blk.{layer}.{name}.{match.group(3)}", layer


def gguf_pieces(hf_name: str, arch: Architecture) -> list[Piece] | None:
    """The GGUF tensors HF weight `hf_name` goes to: one for a dense weight
    (gguf_tensor_name), the expert stacks cut from a mixture-of-experts parameter
    (slothkit.export.gguf.experts); None when it has no place in the file."""
    pieces = expert_pieces(hf_name, arch)
    if pieces is not None:
        return pieces
    if arch.gguf.deltanet and (mapped := deltanet.gguf_tensor_name(hf_name)) is not None:
        return [Piece(*mapped)]
    if arch.gguf.gemma4 and (mapped := gemma4.gguf_tensor_name(hf_name)) is not None:
        return [Piece(*mapped)]
    mapped = gguf_tensor_name(hf_name, arch)
    if mapped is None:
        return None
    return [Piece(mapped[0], mapped[1])]


def gguf_shape(value: torch.Tensor, piece: Piece, arch: Architecture) -> tuple[int, ...]:
    """The shape (torch's order) GGUF tensor `piece` has in the file, cut from HF weight `value`."""
    shape = piece_shape(value, piece)
    if arch.gguf.deltanet and deltanet.holds(piece.name):
        return deltanet.stored_shape(piece.name, shape)
    return shape


def _rotary_heads(name: str, arch: Architecture, config) -> int | None:
    """The head count whose rows are permuted in GGUF tensor `name`, or None: not permuted."""
    if not arch.gguf.permute_qk:
        return None
    n_heads, n_kv_heads = head_counts(config)
    if ".attn_q." in name:
        return n_heads
    if ".attn_k." in name:
        return n_kv_heads
    return None


def _is_norm(name: str) -> bool:
    return name.endswith("_norm.weight")


def to_gguf(value: torch.Tensor, name: str, arch: Architecture, config) -> torch.Tensor:
    """An HF weight as GGUF tensor `name` holds it: Q/K rows permuted, norm offset added, a
    DeltaNet layer's as slothkit.export.gguf.deltanet says."""
    if arch.gguf.deltanet and deltanet.holds(name):
        return deltanet.to_gguf(value, name, deltanet.deltanet_shape(config))
    heads = _rotary_heads(name, arch, config)
    if heads is not None:
        value = permute_rotary_rows(value, heads)
    if _is_norm(name) and norm_offset(arch):
        value = value.float() + norm_offset(arch)
    return value


def from_gguf(value: torch.Tensor, name: str, arch: Architecture, config, hf_shape=None) -> torch.Tensor:
    """Inverse of to_gguf: GGUF tensor `name` back in HF's layout (of shape `hf_shape`, where
    the file stores another: a DeltaNet convolution's)."""
    if arch.gguf.deltanet and deltanet.holds(name):
        return deltanet.from_gguf(value, name, deltanet.deltanet_shape(config), hf_shape or value.shape)
    heads = _rotary_heads(name, arch, config)
    if heads is not None:
        value = unpermute_rotary_rows(value, heads)
    if _is_norm(name) and norm_offset(arch):
        value = value - norm_offset(arch)
    return value


def permute_rotary_rows(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder each head's rows from half-split (i, i + d/2) to interleaved (2i, 2i + 1) pairs."""
    rows = weight.shape[0]
    return (
        weight.reshape(n_heads, 2, rows // n_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def unpermute_rotary_rows(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of the Q/K row permutation: GGUF's interleaved pairs back to HF's half-split."""
    rows = weight.shape[0]
    return (
        weight.reshape(n_heads, rows // n_heads // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def hf_weights_from_gguf(path: str | os.PathLike, model) -> dict[str, torch.Tensor]:
    """Read a GGUF file back into `model`'s parameter names.

    Every tensor is dequantised (gguf.quants.dequantize), un-permuted and has the norm offset
    removed, in the model's dtype and on its device: the weights llama.cpp computes with, in
    HF's layout (slothkit.export.gguf.verify runs the HF model on them). Tied weights appear
    once, as in the file.

    Args:
        path: the GGUF file.
        model: the transformers model the file was written from; its architecture record
            says which rules to undo.
    """
    from gguf import GGUFReader
    from gguf.quants import dequantize

    arch = architecture_of(model)
    stored = {t.name: t for t in GGUFReader(path).tensors}
    weights = {}
    for hf_name, param in model.state_dict().items():
        pieces = gguf_pieces(hf_name, arch)
        if pieces is None or any(piece.name not in stored for piece in pieces):
            continue
        values = []
        for piece in pieces:
            tensor = stored[piece.name]
            value = torch.from_numpy(np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32))
            value = value.reshape(gguf_shape(param, piece, arch))
            values.append(from_gguf(value, piece.name, arch, model.config, piece_shape(param, piece)))
        value = join(values, pieces)
        weights[hf_name] = value.to(device=param.device, dtype=param.dtype)
    return weights
