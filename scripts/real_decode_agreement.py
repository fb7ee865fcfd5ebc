"""Greedy tokens of the fast decode path against Hugging Face's generate on a real
checkpoint (SmolLM2-135M-Instruct), in 16-bit, on ten chat prompts.

A random-weight model's logits are nearly flat, so in bf16 its greedy tokens follow
rounding noise (scripts/decode_agreement.py compares logits instead); a trained model's
are not, so its first tokens should agree.  Each prompt runs alone (batch 1) and all ten
run as one left-padded batch; both paths are the same loaded model, with random LoRA
adapters (B nonzero) when --lora is given, switched with for_inference(fast_decode=...).

    python scripts/real_decode_agreement.py --tokens 32 --lora --json out.json
    python scripts/real_decode_agreement.py --device cpu --dtype fp32   # the script itself
"""

from __future__ import annotations

import argparse
import json

import torch

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about a sloth.",
    "Explain photosynthesis in one sentence.",
    "What is 12 plus 30?",
    "Give three tips for staying focused while studying.",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue?",
    "Name a famous painting by Leonardo da Vinci.",
    "How many legs does a spider have?",
    "Summarise the plot of Romeo and Juliet in two sentences.",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--lora", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from slothkit import FastModel
    from slothkit.testing.real_models import real_model_path

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    path = real_model_path(
        "smollm2-135m-instruct", dtype=torch.float32 if dtype == torch.float32 else torch.bfloat16
    )
    model, tokenizer = FastModel.from_pretrained(
        str(path), max_seq_length=512, dtype=dtype, load_in_4bit=False
    )
    model.to(args.device)
    if args.lora:
        model = FastModel.get_peft_model(model, r=16, lora_alpha=16, use_gradient_checkpointing=False)
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, parameter in sorted(model.named_parameters()):
                if "lora_B" in name:
                    values = torch.randn(parameter.shape, generator=generator) * 0.002
                    parameter.copy_(values.to(parameter.device, parameter.dtype))
    tokenizer.padding_side = "left"
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
        )
        for p in PROMPTS
    ]
    settings = dict(max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False)
    settings["pad_token_id"] = tokenizer.pad_token_id

    def generate(fast: bool, batch: list[str]) -> torch.Tensor:
        FastModel.for_inference(model, fast_decode=fast)
        inputs = tokenizer(batch, return_tensors="pt", padding=True, add_special_tokens=False).to(args.device)
        return model.generate(**inputs, **settings)[:, inputs["input_ids"].shape[1] :].cpu()

    rows, hf_alone = [], []
    for index, text in enumerate(texts):
        hf, fast = generate(False, [text])[0], generate(True, [text])[0]
        hf_alone.append(hf)
        differ = (hf != fast).nonzero()
        rows.append(
            {
                "prompt": PROMPTS[index],
                "equal": bool(torch.equal(hf, fast)),
                "first_difference": int(differ[0]) if differ.numel() else None,
                "hf": tokenizer.decode(hf, skip_special_tokens=True),
                "fast": tokenizer.decode(fast, skip_special_tokens=True),
            }
        )
    hf_batch, fast_batch = generate(False, texts), generate(True, texts)
    batch_equal = [bool(torch.equal(a, b)) for a, b in zip(hf_batch, fast_batch)]

    def first_difference(a, b):
        differ = (a != b).nonzero()
        return int(differ[0]) if differ.numel() else None

    # The batch's own rounding (other GEMM shapes, padded attention) moves bf16 greedy
    # tokens too: HF's batched tokens against HF's alone say how much.
    batch_rows = [
        {
            "prompt": prompt,
            "first_difference": first_difference(hf_b, fast_b),
            "hf_batch_vs_alone_first_difference": first_difference(hf_b, alone),
        }
        for prompt, hf_b, fast_b, alone in zip(PROMPTS, hf_batch, fast_batch, hf_alone)
    ]
    result = {
        "model": "smollm2-135m-instruct",
        "dtype": args.dtype,
        "device": torch.cuda.get_device_name() if args.device == "cuda" else args.device,
        "lora": args.lora,
        "tokens": args.tokens,
        "equal_alone": sum(r["equal"] for r in rows),
        "equal_in_batch": sum(batch_equal),
        "hf_batch_equal_hf_alone": sum(r["hf_batch_vs_alone_first_difference"] is None for r in batch_rows),
        "prompts": len(rows),
        "rows": rows,
        "batch_rows": batch_rows,
    }
    print(
        f"{result['equal_alone']}/{len(rows)} prompts alone and {result['equal_in_batch']}/{len(rows)} "
        f"in a left-padded batch: the first {args.tokens} greedy tokens equal Hugging Face's generate "
        f"(HF's own batched tokens equal its tokens alone in {result['hf_batch_equal_hf_alone']}/{len(rows)})"
    )
    for row in rows:
        mark = "=" if row["equal"] else f"differs at {row['first_difference']}"
        print(f"  [{mark}] {row['prompt']} -> {row['fast'][:70]!r}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=1)


if __name__ == "__main__":
    main()
