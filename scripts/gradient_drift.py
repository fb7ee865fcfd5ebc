"""Which 16-bit run is nearer the truth: slothkit's and HF + PEFT's first-step loss and
LoRA gradients against HF + PEFT in fp32 on the same (bf16-rounded) weights and adapters.

Two bf16 runs whose losses part after a few steps can both be right to rounding, or one
can carry a precision loss (a sum kept in bf16, a softmax in bf16).  The fp32 run on the
same weights tells which: each bf16 run's relative gradient error against it, for the
attention adapters and the experts' adapters apart.

    python3 scripts/gradient_drift.py --model gpt-oss-20b --layers 4
    python3 scripts/gradient_drift.py --model qwen3-30b-a3b-12l --layers 4   # a control

Prints a Markdown table; needs a GPU for real shapes (tiny ones run on a CPU).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses

import torch

from slothkit.bench.model_setup import build_model, prepare
from slothkit.models import SHAPES


def _adapters(model) -> dict[str, torch.nn.Parameter]:
    """The trainable parameters by a name that is the same in every run (PEFT's prefix
    and slothkit's wrappers left out)."""
    named = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            key = name[name.index("layers.") :] if "layers." in name else name
            named[key] = param
    return named


def _group(name: str) -> str:
    return "experts" if ".experts." in name or ".mlp." in name else "attention"


def _gradients(model, input_ids) -> tuple[float, dict[str, torch.Tensor]]:
    loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    grads = {name: p.grad.float().clone() for name, p in _adapters(model).items()}
    return loss.item(), grads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-gpt-oss")
    parser.add_argument("--layers", type=int, default=None, help="keep only the first N layers")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    shape_name = args.model
    if args.layers:
        shape_name = f"{args.model}-first-{args.layers}"
        SHAPES[shape_name] = dataclasses.replace(SHAPES[args.model], num_hidden_layers=args.layers)
    device = "cuda" if torch.cuda.is_available() else "cpu"

    base = build_model(shape_name, torch.bfloat16, device, args.seed)
    runs = {"hf fp32": copy.deepcopy(base).float(), "hf bf16": copy.deepcopy(base), "slothkit bf16": base}
    for impl_name in runs:
        torch.manual_seed(args.seed)
        runs[impl_name] = prepare(impl_name.split()[0], runs[impl_name], args.rank, checkpointing="on")

    # Adapters with a non-zero B (at initialisation B = 0 and A gets no gradient), rounded
    # to bf16 and copied into every run, so that all three start from the same numbers.
    generator = torch.Generator(device=device).manual_seed(args.seed + 1)
    reference = _adapters(runs["hf fp32"])
    with torch.no_grad():
        for name, param in sorted(reference.items()):
            if "lora_B" in name:
                param.normal_(0.0, 0.02, generator=generator)
            param.copy_(param.to(torch.bfloat16).float())
        for impl_name in ("hf bf16", "slothkit bf16"):
            adapters = _adapters(runs[impl_name])
            missing = set(reference) ^ set(adapters)
            if missing:
                raise SystemExit(f"{impl_name} adapts other parameters: {sorted(missing)[:6]}")
            for name, param in adapters.items():
                param.copy_(reference[name])

    vocab = runs["hf fp32"].config.vocab_size
    input_ids = torch.randint(0, vocab, (args.batch, args.seq), generator=generator, device=device)
    truth_loss, truth = _gradients(runs.pop("hf fp32"), input_ids)
    print(f"{args.model}, {args.layers or 'all'} layers, {args.batch} x {args.seq}, r = {args.rank}")
    print(f"fp32 loss {truth_loss:.6f}\n")
    print("| run | loss - fp32 | attention grad rel. error | experts grad rel. error | worst tensor |")
    print("|---|---|---|---|---|")
    for impl_name, model in runs.items():
        loss, grads = _gradients(model, input_ids)
        errors, squares = {}, {}
        for name, grad in grads.items():
            group = _group(name)
            diff = (grad - truth[name]).pow(2).sum().item()
            norm = truth[name].pow(2).sum().item()
            errors[group] = errors.get(group, 0.0) + diff
            squares[group] = squares.get(group, 0.0) + norm
        worst = max(
            grads, key=lambda n: ((grads[n] - truth[n]).norm() / truth[n].norm().clamp_min(1e-30)).item()
        )
        worst_error = ((grads[worst] - truth[worst]).norm() / truth[worst].norm().clamp_min(1e-30)).item()
        cells = [
            f"{(errors[g] / squares[g]) ** 0.5:.2e}" if squares.get(g) else "-"
            for g in ("attention", "experts")
        ]
        print(
            f"| {impl_name} | {loss - truth_loss:+.2e} | {cells[0]} | {cells[1]} | {worst}: {worst_error:.2e} |"
        )
        del model


if __name__ == "__main__":
    main()
