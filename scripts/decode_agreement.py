"""How closely the fast decode path's logits follow the model's, in 16-bit, on a GPU.

Greedy tokens of a random-weight model are no test in bf16: its logits are nearly flat,
so rounding noise picks among near-ties and Hugging Face's own generate differs from run
to run.  This compares logits instead, teacher-forced on the same tokens: the model's
forward in fp32 is the reference; the model's own bf16 forward (Hugging Face + PEFT) sets
the noise floor; the fast path (prefill, then one captured decode step per token) should
sit at that floor.

    python scripts/decode_agreement.py --model llama-3-8b --mode lora --prompt 128 --steps 32
"""

from __future__ import annotations

import argparse
import json

import torch

from slothkit.bench.generate_worker import _randomise_adapters
from slothkit.bench.model_setup import LORA_TARGETS, build_model


def _errors(logits: torch.Tensor, reference: torch.Tensor) -> dict:
    diff = (logits.float() - reference).abs()
    return {
        "max_abs": diff.max().item(),
        "mean_abs": diff.mean().item(),
        "top1_equal": (logits.argmax(-1) == reference.argmax(-1)).float().mean().item(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--mode", choices=["lora", "qlora"], default="lora")
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--device", default="cuda", help="cpu: a quick check of the script on a tiny shape")
    args = parser.parse_args()
    from peft import LoraConfig, get_peft_model

    from slothkit import FastModel
    from slothkit.inference.fast_decoder import FastDecoder
    from slothkit.models import architecture_for

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    model = build_model(args.model, dtype, args.device, 0, quantize_nf4=args.mode == "qlora")
    model = get_peft_model(
        model, LoraConfig(r=16, lora_alpha=16, target_modules=LORA_TARGETS, task_type="CAUSAL_LM")
    )
    _randomise_adapters(model, 2)
    FastModel.for_inference(model, fast_decode=False)
    total = args.prompt + args.steps
    ids = torch.randint(
        3, model.config.vocab_size, (1, total), generator=torch.Generator().manual_seed(1)
    ).to(args.device)
    with torch.no_grad():
        hf = model(input_ids=ids).logits[0].float()
    causal_lm = model.get_base_model()
    # The fp32 reference: the same weights (a 4-bit model's dequantised ones) in fp32.
    with torch.no_grad():
        lora_states = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    reference_model = build_model(args.model, torch.float32, args.device, 0, quantize_nf4=False)
    if args.mode == "qlora":
        import bitsandbytes.functional as bnbf

        with torch.no_grad():
            for name, module in causal_lm.named_modules():
                weight = getattr(module, "weight", None)
                if getattr(weight, "quant_state", None) is not None:
                    target = reference_model.get_submodule(name.replace(".base_layer", ""))
                    target.weight.copy_(bnbf.dequantize_4bit(weight.data, weight.quant_state).float())
    reference_model = get_peft_model(
        reference_model, LoraConfig(r=16, lora_alpha=16, target_modules=LORA_TARGETS, task_type="CAUSAL_LM")
    )
    with torch.no_grad():
        for name, parameter in reference_model.named_parameters():
            if name in lora_states:
                parameter.copy_(lora_states[name].float())
        reference = reference_model(input_ids=ids).logits[0].float()
    del reference_model
    if args.device == "cuda":
        torch.cuda.empty_cache()

    decoder = FastDecoder(
        causal_lm, architecture_for(causal_lm.config).embedding_scale, use_graph=args.device == "cuda"
    )
    steps = []
    prompt = ids[:, : args.prompt]
    decoder._prepare(1, 256 * ((total + 255) // 256), ids.device)
    decoder.cache.reset(torch.ones_like(prompt))
    first = torch.zeros(1, dtype=torch.long, device=ids.device)
    positions = torch.arange(total, device=ids.device)[None]
    with torch.no_grad():
        prefill = decoder.step(
            prompt, positions[:, : args.prompt], decoder.cache, first, last_only=False, causal=True
        )
        for offset in range(args.prompt, total - 1):
            steps.append(decoder.captured(ids[:, offset], positions[:, offset], offset).clone())
    fast = torch.cat([prefill[0], torch.cat(steps)], dim=0)
    rows = reference[: total - 1]
    report = {
        "model": args.model,
        "mode": args.mode,
        "dtype": args.dtype,
        "positions": total - 1,
        "logit_std": rows.std().item(),
        "hf_vs_fp32": _errors(hf[: total - 1], rows),
        "fast_vs_fp32": _errors(fast, rows),
        "fast_vs_hf": _errors(fast, hf[: total - 1]),
        "graph_captured": decoder.captured.graph is not None,
        "kv_cache_mib": decoder.nbytes / 2**20,
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
