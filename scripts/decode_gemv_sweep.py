"""Every decode GEMV candidate against the library path, at one model's projection shapes,
as the decode step's choice times them (slothkit.inference.gemv_choice: CUDA-graph
replays, the weight cycled through copies beyond twice the L2).

For each shape, row count and weight kind it runs the choice itself and prints, from
``gemv_choice.choices()``: the library path's time and bandwidth (cuBLAS's GEMV + addmm_
for 16-bit weights; bitsandbytes' GEMV, or dequantise + matmul beyond one row, + addmm_
for NF4), the best candidate's, which runs, every candidate's time and why any other was
dropped, so that a tile set can be tuned from one run of it.  Weights are random (bf16,
or NF4 with double quantisation, blocks of 64, as QLoRA loads them); the adapter is
LoRA r = 16.  Kind ``nf4`` times the lookups decode runs (nf4_gemv.candidate_lookup);
``nf4-registers``, ``nf4-shuffle`` and ``nf4-table`` one lookup for every candidate (byte
permutes, warp shuffles, a table in memory), for comparison.  Kinds ``16-bit-group`` and
``nf4-group`` time the projections that read one input (q, k, v; gate, up) as one
launch (lora_gemv_group, nf4_lora_gemv_group) against each on its own chosen path, whose
decisions they list too.

    python scripts/decode_gemv_sweep.py --rows 1,8 --output $OUT/decode-gemv.json
"""

from __future__ import annotations

import argparse
import json
import platform

import torch

# (out_features, in_features) of Llama-3-8B's projections: q/o, k/v, gate/up, down.
SHAPES = {"llama-3-8b": [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336)]}
# Its projections that read one input: q, k, v; gate, up.
GROUPS = {"llama-3-8b": [[(4096, 4096), (1024, 4096), (1024, 4096)], [(14336, 4096), (14336, 4096)]]}
RANK = 16


def _nf4_layer(out_features: int, in_features: int):
    import bitsandbytes as bnb

    layer = bnb.nn.Linear4bit(
        in_features, out_features, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4"
    )
    layer.load_state_dict({"weight": torch.randn(out_features, in_features) * in_features**-0.5})
    return layer.to(torch.bfloat16).cuda().eval()  # quantised when moved


def _decide(kind: str, out_features: int, in_features: int, rows: int) -> None:
    from slothkit.engine.lora_projection import base_weight
    from slothkit.inference import gemv_choice
    from slothkit.inference.decode_projections import _nf4_base_output

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16) * scale

    x, xa, lora_b = randn(rows, in_features), randn(rows, RANK), randn(out_features, RANK, scale=0.01)
    if kind == "16-bit":
        weight = randn(out_features, in_features, scale=in_features**-0.5)
        gemv_choice.gemv_candidate(x, weight, None, xa, lora_b, 2.0)
    else:  # "nf4" (what decode runs), or "nf4-<lookup>" (nf4_gemv.LOOKUPS)
        layer = _nf4_layer(out_features, in_features)
        lookup = kind.removeprefix("nf4-") if kind != "nf4" else "auto"
        gemv_choice.nf4_gemv_candidate(
            x,
            base_weight(layer),
            None,
            xa,
            lora_b,
            2.0,
            lambda w: _nf4_base_output(layer, x, w, None),
            lookup,
        )


def _decide_group(kind: str, shapes: list[tuple[int, int]], rows: int) -> None:
    from slothkit.engine.lora_projection import base_weight
    from slothkit.inference import gemv_choice
    from slothkit.inference.decode_projections import _nf4_base_output

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16) * scale

    in_features = shapes[0][1]
    x, xa = randn(rows, in_features), randn(rows, RANK * len(shapes))
    lora_bs = [randn(out_features, RANK, scale=0.01) for out_features, _ in shapes]
    scalings = [2.0] * len(shapes)
    if kind == "16-bit-group":
        weights = [randn(n, k, scale=k**-0.5) for n, k in shapes]
        gemv_choice.group_gemv_candidate(x, weights, None, xa, lora_bs, scalings)
    else:  # "nf4-group" (what decode runs), or "nf4-<lookup>-group"
        layers = [_nf4_layer(n, k) for n, k in shapes]
        bases = [lambda w, layer=layer: _nf4_base_output(layer, x, w, None) for layer in layers]
        weights = [base_weight(layer) for layer in layers]
        lookup = kind.removeprefix("nf4-").removesuffix("-group") if kind != "nf4-group" else "auto"
        gemv_choice.nf4_group_gemv_candidate(x, weights, None, xa, lora_bs, scalings, bases, lookup)


def _weight_bytes(kind: str, out_features, in_features: int) -> int:
    """Of the weight, or of a group's weights (out_features "4096+1024+1024")."""
    elements = sum(int(n) for n in str(out_features).split("+")) * in_features
    return 2 * elements if kind.startswith("16-bit") else elements // 2 + elements // 64


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3-8b", choices=sorted(SHAPES))
    parser.add_argument("--rows", default="1,8", help="row counts (batch sizes) to decide for")
    parser.add_argument(
        "--kinds",
        default="16-bit,nf4",
        help="16-bit, nf4 (what decode runs), nf4-registers, nf4-shuffle, nf4-table (one lookup "
        "everywhere), 16-bit-group, nf4-group, nf4-registers-group, nf4-shuffle-group",
    )
    parser.add_argument("--output", help="JSON file for the choices and the setting")
    args = parser.parse_args()
    torch.manual_seed(0)
    from slothkit.inference import gemv_choice

    with torch.no_grad():
        for kind in args.kinds.split(","):
            for rows in (int(r) for r in args.rows.split(",")):
                if kind.endswith("-group"):
                    for shapes in GROUPS[args.model]:
                        _decide_group(kind, shapes, rows)
                    continue
                for out_features, in_features in SHAPES[args.model]:
                    _decide(kind, out_features, in_features, rows)
    choices = gemv_choice.choices()
    print(
        "| weight | rows | out x in | baseline | us | GB/s | best kernel us | GB/s | runs | every candidate, us |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for c in choices:
        size = _weight_bytes(c["weight"], c["out_features"], c["in_features"])
        base_us, kernel_us = 1e3 * c["baseline_ms"], 1e3 * (c["kernel_ms"] or float("nan"))
        every = ", ".join(f"{i}: {1e3 * ms:.1f}" for i, ms in c["candidates_ms"].items())
        print(
            f"| {c['weight']} | {c['rows']} | {c['out_features']} x {c['in_features']} | {c['baseline']} "
            f"| {base_us:.1f} | {size / base_us / 1e3:.0f} | {kernel_us:.1f} | {size / kernel_us / 1e3:.0f} "
            f"| {c['runs']} | {every} |"
        )
    for c in choices:  # why candidates did not run (the JSON keeps each one's reason)
        if c["dropped"]:
            reasons = "; ".join(sorted(set(c["dropped"].values()))[:3])
            print(
                f"dropped: {c['weight']}, {c['rows']} rows, {c['out_features']} x {c['in_features']}: "
                f"{len(c['dropped'])} candidates ({reasons})"
            )
    if args.output:
        from importlib.metadata import version

        setting = {
            "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "triton": version("triton"),
            "bitsandbytes": version("bitsandbytes"),
            "slothkit": version("slothkit"),
            "python": platform.python_version(),
            "model": args.model,
            "rank": RANK,
        }
        with open(args.output, "w") as file:
            json.dump({"setting": setting, "choices": choices}, file, indent=1)


if __name__ == "__main__":
    main()
