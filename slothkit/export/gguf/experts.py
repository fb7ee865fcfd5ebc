"""A mixture-of-experts layer's tensors in llama.cpp's layout, as its converter writes them
(convert_hf_to_gguf.py, Qwen2MoeModel / Qwen3MoeModel / GptOssModel; gguf-py's tensor names).

transformers 5 holds a layer's experts as one module of 3-D parameters (the record's
GGUFExperts names the modules and config fields). Qwen3-MoE stores them (experts, out, in):

    HF parameter                     torch shape         GGUF tensor (torch order)
    mlp.gate.weight        (router)  (E, hidden)         blk.N.ffn_gate_inp.weight  F32
    mlp.experts.gate_up_proj  [:I]   (E, 2I, hidden)     blk.N.ffn_gate_exps.weight (E, I, hidden)
                              [I:]                       blk.N.ffn_up_exps.weight   (E, I, hidden)
    mlp.experts.down_proj            (E, hidden, I)      blk.N.ffn_down_exps.weight (E, hidden, I)

gpt-oss stores them (experts, in, out) (`transposed`), with gate and up alternating along
the output dimension (`interleaved`: gate at even columns, up at odd), and has biases:

    mlp.router.weight, .bias         (E, hidden), (E)    blk.N.ffn_gate_inp.weight, .bias  F32
    mlp.experts.gate_up_proj         (E, hidden, 2I)     transposed to (E, 2I, hidden), then
                              rows [0::2]                blk.N.ffn_gate_exps.weight (E, I, hidden)
                              rows [1::2]                blk.N.ffn_up_exps.weight   (E, I, hidden)
    mlp.experts.gate_up_proj_bias    (E, 2I)  [..., 0::2] blk.N.ffn_gate_exps.bias  (E, I)  F32
                                              [..., 1::2] blk.N.ffn_up_exps.bias    (E, I)  F32
    mlp.experts.down_proj            (E, I, hidden)      blk.N.ffn_down_exps.weight (E, hidden, I)
    mlp.experts.down_proj_bias       (E, hidden)         blk.N.ffn_down_exps.bias   (E, hidden) F32

GGUF lists dimensions the other way round (ne[0] is the row, the fastest), so llama.cpp
reads ffn_gate_exps as {hidden, I, E}: expert e's matrix is the e-th (I, hidden) slab, rows
of `hidden` values as for a dense ffn_gate. Each expert stack is quantised row by row like
a 2-D weight; the router and every bias stay F32 (llama.cpp's converter and llama-quantize
keep them so).

A piece is one GGUF tensor cut from one HF parameter (`cut`): the parameter transposed
first where the record says so, then part `part` of `parts` along dimension `dim` (a
weight's rows, a bias's last dimension), a contiguous chunk or every parts-th entry
(interleaved). `join` puts the pieces back together (the verifier's reader).
"""

from __future__ import annotations

import dataclasses
import re

import torch

from slothkit.models import Architecture


@dataclasses.dataclass(frozen=True)
class Piece:
    name: str  # the GGUF tensor
    layer: int | None
    part: int = 0  # which part of the HF parameter along `dim`
    parts: int = 1  # into how many equal parts it is cut
    dim: int = -2  # the dimension cut: a weight's rows (-2), a bias's entries (-1)
    interleaved: bool = False  # part p is entries p, p + parts, ...; False: a contiguous chunk
    transposed: bool = False  # the HF parameter's last two dimensions are swapped first


def cut(value: torch.Tensor, piece: Piece) -> torch.Tensor:
    """The piece's part of an HF parameter (the whole parameter for a single piece)."""
    return _part(value, piece).contiguous()


def piece_shape(value: torch.Tensor, piece: Piece) -> tuple[int, ...]:
    """The shape of cut(value, piece), without copying anything."""
    return tuple(_part(value, piece).shape)


def _part(value: torch.Tensor, piece: Piece) -> torch.Tensor:
    if piece.transposed:
        value = value.transpose(-1, -2)
    if piece.parts > 1:
        entries = value.movedim(piece.dim, 0)
        if piece.interleaved:
            entries = entries[piece.part :: piece.parts]
        else:
            entries = entries.chunk(piece.parts)[piece.part]
        value = entries.movedim(0, piece.dim)
    return value


def join(values: list[torch.Tensor], pieces: list[Piece]) -> torch.Tensor:
    """Inverse of cut: the HF parameter from its pieces' values, in the pieces' order."""
    piece = pieces[0]
    value = values[0]
    if len(values) > 1:
        entries = [value.movedim(piece.dim, 0) for value in values]
        if piece.interleaved:  # (n, parts, ...) -> n * parts entries, the parts alternating
            joined = torch.stack(entries, dim=1).flatten(0, 1)
        else:
            joined = torch.cat(entries)
        value = joined.movedim(0, piece.dim)
    return value.transpose(-1, -2) if piece.transposed else value


_PARAMETER = re.compile(r"model\.layers\.(\d+)\.(.+)\.([^.]+)")


def expert_pieces(hf_name: str, arch: Architecture) -> list[Piece] | None:
    """The GGUF tensors cut from HF parameter `hf_name` of a mixture-of-experts layer, or
    None when it is no part of one (or the record has no experts)."""
    experts = arch.gguf.experts
    match = _PARAMETER.fullmatch(hf_name)
    if experts is None or match is None:
        return None
    layer, module, parameter = int(match.group(1)), match.group(2), match.group(3)
    if module == experts.router and parameter in ("weight", "bias"):
        return [Piece(f"blk.{layer}.ffn_gate_inp.{parameter}", layer)]
    if module != experts.experts:
        return None
    is_bias = parameter.endswith("_bias")
    stem, kind = (parameter.removesuffix("_bias"), "bias") if is_bias else (parameter, "weight")
    # A bias is one vector per expert: nothing to transpose, its entries are the outputs.
    transposed = experts.transposed and not is_bias
    dim = -1 if is_bias else -2
    if stem == "gate_up_proj":
        return [
            Piece(f"blk.{layer}.ffn_{half}_exps.{kind}", layer, part, 2, dim, experts.interleaved, transposed)
            for part, half in enumerate(("gate", "up"))
        ]
    if stem == "down_proj":
        return [Piece(f"blk.{layer}.ffn_down_exps.{kind}", layer, dim=dim, transposed=transposed)]
    return None


def check_experts(config, arch: Architecture, state: dict) -> None:
    """Refuse a model whose experts llama.cpp's graph would compute otherwise than HF: a
    layer without experts, weights not renormalised where the graph renormalises them, an
    activation constant other than the graph's, or expert parameters in another order than
    the record's ((experts, out, in), or (experts, in, out) where transposed)."""
    experts = arch.gguf.experts
    if experts is None:
        return
    name = arch.gguf.arch
    for key, fixed in experts.graph_constants:
        value = getattr(config, key, None)
        if value is None or abs(float(value) - fixed) > 1e-6 * abs(fixed):
            raise NotImplementedError(
                f"llama.cpp's {name!r} graph computes the experts with {key}={fixed} and reads no "
                f"setting for it; this model has {key}={value}, which it cannot run; it accepts {key}={fixed}"
            )
    dense = list(getattr(config, "mlp_only_layers", None) or [])
    step = getattr(config, "decoder_sparse_step", 1)
    if dense or step != 1:
        raise NotImplementedError(
            f"llama.cpp's {name!r} graph puts experts in every layer; this model has dense MLP layers "
            f"(mlp_only_layers={dense}, decoder_sparse_step={step}); it accepts mlp_only_layers=[] and "
            "decoder_sparse_step=1"
        )
    if experts.renormalised_key and not getattr(config, experts.renormalised_key, False):
        raise NotImplementedError(
            f"llama.cpp's {name!r} graph renormalises the chosen experts' weights to sum to 1; this "
            f"model has {experts.renormalised_key}=False, which it cannot run; it accepts "
            f"{experts.renormalised_key}=True"
        )
    count = getattr(config, experts.count_key)
    width = getattr(config, experts.width_key)
    hidden = config.hidden_size
    expected = {"gate_up_proj": (count, 2 * width, hidden), "down_proj": (count, hidden, width)}
    if experts.transposed:
        expected = {key: (count, shape[2], shape[1]) for key, shape in expected.items()}
    order = "(experts, in, out)" if experts.transposed else "(experts, out, in)"
    for hf_name, tensor in state.items():
        parameter = hf_name.rsplit(".", 1)[-1]
        if f".{experts.experts}." in hf_name and parameter in expected:
            if tuple(tensor.shape) != expected[parameter]:
                raise NotImplementedError(
                    f"{hf_name} has shape {tuple(tensor.shape)}; GGUF export of {name!r} reads experts "
                    f"as {order}: {expected[parameter]}"
                )
