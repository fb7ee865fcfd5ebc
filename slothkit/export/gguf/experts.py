"""A mixture-of-experts layer's tensors in llama.cpp's layout, as its converter writes them
(convert_hf_to_gguf.py, Qwen2MoeModel / Qwen3MoeModel; gguf-py's tensor names).

transformers 5 holds a layer's experts as one module of 3-D parameters (the record's
GGUFExperts names the modules and config fields):

    HF parameter                     torch shape         GGUF tensor (torch order)
    mlp.gate.weight        (router)  (E, hidden)         blk.N.ffn_gate_inp.weight  F32
    mlp.experts.gate_up_proj  [:I]   (E, 2I, hidden)     blk.N.ffn_gate_exps.weight (E, I, hidden)
                              [I:]                       blk.N.ffn_up_exps.weight   (E, I, hidden)
    mlp.experts.down_proj            (E, hidden, I)      blk.N.ffn_down_exps.weight (E, hidden, I)

GGUF lists dimensions the other way round (ne[0] is the row, the fastest), so llama.cpp
reads ffn_gate_exps as {hidden, I, E}: expert e's matrix is the e-th (I, hidden) slab, rows
of `hidden` values as for a dense ffn_gate. Each expert stack is quantised row by row like
a 2-D weight; the router stays F32 (llama.cpp's converter and llama-quantize keep it so).

A piece is one GGUF tensor cut from one HF parameter: part `part` of `parts` equal chunks
of its rows (the second-to-last dimension). The reader puts the pieces back together in
order (torch.cat over that dimension).
"""

from __future__ import annotations

import dataclasses
import re

from slothkit.models import Architecture


@dataclasses.dataclass(frozen=True)
class Piece:
    name: str  # the GGUF tensor
    layer: int
    part: int  # which chunk of the HF parameter's rows
    parts: int  # into how many equal chunks its rows are cut


_PARAMETER = re.compile(r"model\.layers\.(\d+)\.(.+)\.([^.]+)")


def expert_pieces(hf_name: str, arch: Architecture) -> list[Piece] | None:
    """The GGUF tensors cut from HF parameter `hf_name` of a mixture-of-experts layer, or
    None when it is no part of one (or the record has no experts)."""
    experts = arch.gguf.experts
    match = _PARAMETER.fullmatch(hf_name)
    if experts is None or match is None:
        return None
    layer, module, parameter = int(match.group(1)), match.group(2), match.group(3)
    if module == experts.router and parameter == "weight":
        return [Piece(f"blk.{layer}.ffn_gate_inp.weight", layer, 0, 1)]
    if module != experts.experts:
        return None
    if parameter == "gate_up_proj":
        return [
            Piece(f"blk.{layer}.ffn_gate_exps.weight", layer, 0, 2),
            Piece(f"blk.{layer}.ffn_up_exps.weight", layer, 1, 2),
        ]
    if parameter == "down_proj":
        return [Piece(f"blk.{layer}.ffn_down_exps.weight", layer, 0, 1)]
    return None


def check_experts(config, arch: Architecture, state: dict) -> None:
    """Refuse a model whose experts llama.cpp's graph would compute otherwise than HF: a
    layer without experts, weights not renormalised where the graph renormalises them, or
    expert parameters in another order than (experts, out, in)."""
    experts = arch.gguf.experts
    if experts is None:
        return
    name = arch.gguf.arch
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
    for hf_name, tensor in state.items():
        parameter = hf_name.rsplit(".", 1)[-1]
        if f".{experts.experts}." in hf_name and parameter in expected:
            if tuple(tensor.shape) != expected[parameter]:
                raise NotImplementedError(
                    f"{hf_name} has shape {tuple(tensor.shape)}; GGUF export of {name!r} reads experts "
                    f"as (experts, out, in): {expected[parameter]}"
                )
