"""Which GGML type each GGUF tensor gets for a quantisation method, and the encoding itself.

    method   file type       2-D weights                      rule followed
    f32      ALL_F32         F32                              convert_hf_to_gguf.py --outtype f32
    f16      MOSTLY_F16      F16                              ... --outtype f16
    bf16     MOSTLY_BF16     BF16                             ... --outtype bf16
    q8_0     MOSTLY_Q8_0     Q8_0                             ... --outtype q8_0
    q4_0     MOSTLY_Q4_0     Q4_0, output Q6_K                llama-quantize Q4_0
    q4_k_m   MOSTLY_Q4_K_M   Q4_K, some Q6_K (below)          llama-quantize Q4_K_M
    q5_k_m   MOSTLY_Q5_K_M   Q5_K, some Q6_K (below)          llama-quantize Q5_K_M
    q6_k     MOSTLY_Q6_K     Q6_K                             llama-quantize Q6_K

Always F32, whatever the method: vectors (RMSNorm weights, biases, rope_freqs), as llama.cpp
computes norms in F32 and both llama.cpp tools leave them unquantised; a mixture-of-experts
router (ffn_gate_inp; a shared expert's one-row gate, ffn_gate_inp_shexp, which llama-quantize
also leaves as it is given) and a DeltaNet layer's convolution kernel (ssm_conv1d), which both keep
in F32 too.

The llama-quantize mixes (llama_tensor_get_type in src/llama-quant.cpp, dense models):
  - output.weight, or token_embd.weight when the output is tied to it (Gemma), and Gemma 4's
    per-layer input embeddings (per_layer_token_embd.weight): Q6_K (Q8_0 if its rows are not
    a multiple of 256; kept Q8_0 for a Q8_0 base);
  - Gemma 4's per_layer_model_proj.weight: F16 in every quantised method (llama-quantize
    leaves it as it is in the F16 file it is given);
  - _M variants: attn_v.weight and ffn_down.weight (ffn_down_exps.weight and a shared
    expert's ffn_down_shexp.weight too: llama-quantize matches "ffn_down" in the name) get Q6_K in the layers where
    `use_more_bits(i, n) = i < n/8 or i >= 7n/8 or (i - n/8) % 3 == 2`, the base type elsewhere
    (for 32 layers: 0-3, 6, 9, ..., 27 and 28-31); llama-quantize counts i and n over the
    tensors of that name in the file (value_positions), which is the layer and the layer
    count where every layer has one, and not where some have none (Gemma 4's layers that
    share keys and values);
  - attn_qkv.weight (Phi-3's fused q/k/v): Q5_K in Q4_K_M, Q6_K in Q5_K_M, in every layer;
    a DeltaNet layer's attn_qkv (Qwen3.5: its q, k and v inputs) takes attn_v's rule instead
    (each layer holds one of the two, so the layer's index is its count among them), as
    llama-quantize gives it (compared tensor by tensor on a tiny Qwen3.5);
  - every other 2-D weight, token_embd included when untied, and every 3-D expert stack
    (quantised row by row, as a 2-D weight of its rows): the base type.
Fallback for rows that a type's block cannot tile (tensor_type_fallback): Q4_K -> Q5_0,
Q5_K -> Q5_1, Q6_K -> Q8_0 when the row length is not a multiple of 256; then F16 when it is
not even a multiple of 32 (Q4_0, Q5_0, Q5_1, Q8_0 blocks). The converter's own types (q8_0)
fall back to F16 the same way.

Encoding: F32/F16 by cast, BF16/Q8_0/Q4_0/Q5_0/Q5_1 by `gguf.quants.quantize` (numpy, bit-exact
with ggml's reference), Q4_K/Q5_K/Q6_K by slothkit.export.gguf.kquants (torch, on the GPU if given one).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType
from gguf import quants as gguf_quants

from slothkit.export.gguf import kquants

T = GGMLQuantizationType


@dataclasses.dataclass(frozen=True)
class QuantizationMethod:
    name: str  # what users pass: "q4_k_m"
    label: str  # in file names and general.file_type's spelling: "Q4_K_M"
    file_type: LlamaFileType
    base: GGMLQuantizationType  # type of most 2-D weights
    mixed: bool  # follows llama-quantize's per-tensor choices (True) or the converter's (False)


QUANTIZATION_METHODS = {
    m.name: m
    for m in (
        QuantizationMethod("f32", "F32", LlamaFileType.ALL_F32, T.F32, mixed=False),
        QuantizationMethod("f16", "F16", LlamaFileType.MOSTLY_F16, T.F16, mixed=False),
        QuantizationMethod("bf16", "BF16", LlamaFileType.MOSTLY_BF16, T.BF16, mixed=False),
        QuantizationMethod("q8_0", "Q8_0", LlamaFileType.MOSTLY_Q8_0, T.Q8_0, mixed=False),
        QuantizationMethod("q4_0", "Q4_0", LlamaFileType.MOSTLY_Q4_0, T.Q4_0, mixed=True),
        QuantizationMethod("q4_k_m", "Q4_K_M", LlamaFileType.MOSTLY_Q4_K_M, T.Q4_K, mixed=True),
        QuantizationMethod("q5_k_m", "Q5_K_M", LlamaFileType.MOSTLY_Q5_K_M, T.Q5_K, mixed=True),
        QuantizationMethod("q6_k", "Q6_K", LlamaFileType.MOSTLY_Q6_K, T.Q6_K, mixed=True),
    )
}

_FALLBACK = {T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0}


def quantization_method(name: str | QuantizationMethod) -> QuantizationMethod:
    """The method called `name` (any case), refused with the valid names listed; a method
    already parsed comes back as it is."""
    if isinstance(name, QuantizationMethod):
        return name
    key = name.lower() if isinstance(name, str) else name
    if key not in QUANTIZATION_METHODS:
        raise ValueError(
            f"unknown GGUF quantization_method {name!r}; valid: {', '.join(map(repr, QUANTIZATION_METHODS))}"
        )
    return QUANTIZATION_METHODS[key]


def quantization_methods(value) -> tuple[QuantizationMethod, ...]:
    """What a user passes as quantization_method, parsed once where it enters slothkit
    (save_pretrained_gguf, push_to_hub_gguf, `slothkit export --quant`, the notebooks'
    GGUF_QUANTS); everything below takes the QuantizationMethod values.

    Args:
        value: a method name ("q4_k_m", any case), several separated by commas
            ("q4_k_m,q8_0"), a QuantizationMethod, or a list of these. Values already
            parsed come back as they are.

    Returns:
        The methods, in the order given.

    Raises:
        ValueError: an unknown name, no method at all, or one method twice; the message lists
            the valid names.
    """
    items = [value] if value is None or isinstance(value, (str, QuantizationMethod)) else list(value)
    methods = []
    for item in items:
        if isinstance(item, QuantizationMethod):
            methods.append(item)
        elif isinstance(item, str):
            methods += [quantization_method(name.strip()) for name in item.split(",") if name.strip()]
        else:
            methods.append(quantization_method(item))
    if not methods:
        raise ValueError(
            f"quantization_method is empty; give one or more of {', '.join(map(repr, QUANTIZATION_METHODS))}"
        )
    names = [m.name for m in methods]
    if len(set(names)) != len(names):
        raise ValueError(f"quantization_method lists a method twice: {names}")
    return tuple(methods)


def use_more_bits(layer: int, n_layers: int) -> bool:
    """llama.cpp's choice of layers that get the larger type in the _M mixes: the first and
    last eighth, and every third layer in between."""
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


def tensor_type(
    method: QuantizationMethod,
    name: str,
    shape: tuple[int, ...],
    *,
    layer: int | None,
    n_layers: int,
    output_tied_to_embeddings: bool,
    deltanet: bool = False,
) -> GGMLQuantizationType:
    """The GGML type of GGUF tensor `name` (shape in torch order, rows last) under `method`:
    the mix's type (mix_type), or its fallback where the row is not a whole number of its
    blocks (fallback_type)."""
    intended = mix_type(
        method,
        name,
        shape,
        layer=layer,
        n_layers=n_layers,
        output_tied_to_embeddings=output_tied_to_embeddings,
        deltanet=deltanet,
    )
    return intended if intended == T.F32 else fallback_type(intended, shape[-1])


# A fused attn_qkv holds attn_v's rows too: the _M mixes give the whole tensor one step up.
_QKV_STEP = {LlamaFileType.MOSTLY_Q4_K_M: T.Q5_K, LlamaFileType.MOSTLY_Q5_K_M: T.Q6_K}


def mix_type(
    method: QuantizationMethod,
    name: str,
    shape: tuple[int, ...],
    *,
    layer: int | None,
    n_layers: int,
    output_tied_to_embeddings: bool,
    deltanet: bool = False,
) -> GGMLQuantizationType:
    """The type `method`'s mix gives tensor `name`, before any fallback for its row length;
    `deltanet`: the model has DeltaNet layers, whose attn_qkv takes attn_v's rule."""
    if (
        len(shape) < 2
        or not name.endswith(".weight")
        or name.endswith(
            ("_norm.weight", ".ffn_gate_inp.weight", ".ffn_gate_inp_shexp.weight", ".ssm_conv1d.weight")
        )
    ):
        # vectors, norms, a mixture-of-experts router (and a shared expert's one-row gate),
        # a DeltaNet layer's convolution (as
        # llama.cpp's converter and llama-quantize keep them; ggml's ssm_conv reads F32)
        return T.F32
    if name == "per_layer_model_proj.weight":  # Gemma 4's: llama-quantize leaves it unquantised
        return method.base if method.base in (T.F32, T.F16, T.BF16) else T.F16
    if not method.mixed:
        return method.base
    is_output = name in ("output.weight", "per_layer_token_embd.weight") or (
        output_tied_to_embeddings and name == "token_embd.weight"
    )
    if is_output:
        return T.Q6_K if method.base != T.Q8_0 else method.base
    if name.endswith(".attn_qkv.weight") and method.file_type in _QKV_STEP and not deltanet:
        return _QKV_STEP[method.file_type]
    more_bits = (".attn_v.weight", ".ffn_down.weight", ".ffn_down_exps.weight", ".ffn_down_shexp.weight")
    if (
        method.file_type in (LlamaFileType.MOSTLY_Q4_K_M, LlamaFileType.MOSTLY_Q5_K_M)
        and name.endswith(more_bits + ((".attn_qkv.weight",) if deltanet else ()))
        and layer is not None
        and use_more_bits(layer, n_layers)
    ):
        return T.Q6_K
    return method.base


def value_positions(names: list[str], deltanet: bool = False) -> dict[str, tuple[int, int]]:
    """For each attn_v.weight among the file's tensor `names` (and a DeltaNet layer's
    attn_qkv.weight, which takes its rule), (its position among them, their number): the
    i and n llama-quantize's use_more_bits is given (module docstring)."""
    ends = (".attn_v.weight", ".attn_qkv.weight") if deltanet else (".attn_v.weight",)
    values = [name for name in names if name.endswith(ends)]
    return {name: (i, len(values)) for i, name in enumerate(values)}


def fallback_type(qtype: GGMLQuantizationType, row: int) -> GGMLQuantizationType:
    """`qtype` when its blocks tile a row of `row` values, else llama-quantize's fallback
    (module docstring), else F16."""
    if row % GGML_QUANT_SIZES[qtype][0]:
        qtype = _FALLBACK.get(qtype, qtype)
    return _fit_row(qtype, row)


def _fit_row(qtype: GGMLQuantizationType, row: int) -> GGMLQuantizationType:
    """F16 when even the fallback cannot tile the row."""
    return qtype if row % GGML_QUANT_SIZES[qtype][0] == 0 else T.F16


def smallest_bytes_per_weight(method: QuantizationMethod) -> float:
    """The fewest bytes a weight takes in a file of `method`: its base type's (its mix and
    fallbacks only use larger types). Q4_K: 144 bytes per 256 weights."""
    block, size = GGML_QUANT_SIZES[method.base]
    return size / block


def encoded_nbytes(qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> int:
    block, size = GGML_QUANT_SIZES[qtype]
    n = int(np.prod(shape))
    return n // block * size


def encode(
    weight: torch.Tensor, qtype: GGMLQuantizationType, device: torch.device | str | None = None
) -> np.ndarray:
    """A float tensor -> the array GGUFWriter stores for `qtype`: float32/float16 with the
    tensor's shape, or uint8 with the last dimension in bytes."""
    if qtype == T.F32:
        return weight.detach().to("cpu", torch.float32).numpy()
    if qtype == T.F16:
        return weight.detach().to("cpu", torch.float16).numpy()
    name = qtype.name
    if name in kquants.QUANTIZERS:
        source = weight.detach()
        if device is not None:
            source = source.to(device)
        return kquants.QUANTIZERS[name](source).cpu().numpy()
    # BF16 and the 32-blocks: ggml's reference rounding, from float32
    return gguf_quants.quantize(weight.detach().to("cpu", torch.float32).numpy(), qtype)
