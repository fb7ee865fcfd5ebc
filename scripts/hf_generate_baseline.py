"""Why the bench's HF + PEFT generate rows differ from a plain ``model.generate``: the
same random Llama-3-8B with the same LoRA adapters, decoded by Hugging Face's generate
through each way of getting there, each in a fresh process on the GPU, tokens/s last.

    python scripts/hf_generate_baseline.py [--model llama-3-8b] [--batches 1 8] [--new-tokens 128]
                                           [--rounds 2] [--ways worker plain ...]

HF + PEFT's generate at these sizes is bound by the host (a Python loop of several hundred
launches a token), so anything that loads the host moves it: the saved weights are
flushed to disk (os.sync) before any way is timed, and with several rounds the ways run
in a rotated order each round, so that a drift over the run does not read as a
difference between ways; the table gives each way's median and every figure.

Ways (each differs from the one before it in one thing, so a gap points at its cause):
  worker            ``python -m slothkit.bench.generate_worker --impl hf``, the process
                    `slothkit bench generate` starts, its RESULT line read (its warnings
                    recorded, batch > 1 left-padded as the bench pads)
  bench             the worker's model (generate_worker.prepare: random weights built from
                    the config, min_new_tokens = max_new_tokens) timed here
  bench-no-min      the same without min_new_tokens (and its logits processor)
  plain-min         transformers' from_pretrained of the same weights saved to disk,
                    PEFT's get_peft_model, the bench's adapter values, min_new_tokens
  plain             the same as a user writes it: max_new_tokens only, slothkit never imported
  plain-slothkit    plain after `import slothkit` (does importing slothkit change HF's speed?)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

WAYS = ("worker", "bench", "bench-no-min", "plain-min", "plain", "plain-slothkit")


def _worker(model: str, batch: int, new_tokens: int) -> dict:
    """The bench's own HF process, as `slothkit bench generate` runs it."""
    from slothkit.bench.train_worker import RESULT_TAG

    command = [sys.executable, "-m", "slothkit.bench.generate_worker", "--impl", "hf", "--model", model,
               "--batch", str(batch), "--prompt-len", "128", "--new-tokens", str(new_tokens),
               "--ttft-len", "0"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT_TAG)]
    if not lines:
        return {"way": "worker", "batch": batch, "error": done.stderr[-400:]}
    result = json.loads(lines[-1][len(RESULT_TAG) :])
    if result.get("status") != "ok":
        return {"way": "worker", "batch": batch, "error": result.get("error")}
    return {"way": "worker", "batch": batch, "new_tokens": new_tokens,
            "tokens_per_s": result["tokens_per_s"], "notices": result.get("notices")}  # fmt: skip


def _one(way: str, folder: str, model: str, batch: int, new_tokens: int) -> dict:
    """Runs in the child process: load, warm up once, time one generate."""
    import torch

    if way == "plain-slothkit":
        import slothkit  # noqa: F401

    args = argparse.Namespace(model=model, rank=16, seed=0, mode="lora")
    if way.startswith("bench"):
        from slothkit.bench import generate_worker

        peft_model = generate_worker.prepare("hf", args, torch.bfloat16, "cuda")
    else:
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, device_map="cuda")
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        peft_model = get_peft_model(
            base, LoraConfig(r=16, lora_alpha=16, target_modules=targets, task_type="CAUSAL_LM")
        )
        adapters = torch.load(f"{folder}/adapters.pt")
        with torch.no_grad():
            for name, parameter in peft_model.named_parameters():
                if name in adapters:
                    parameter.copy_(adapters[name])
        peft_model.eval()
    generator = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, peft_model.config.vocab_size, (batch, 128), generator=generator).cuda()
    extra = {"min_new_tokens": new_tokens, "pad_token_id": 0} if way in ("bench", "plain-min") else {}

    def generate():
        return peft_model.generate(
            input_ids=prompts,
            attention_mask=torch.ones_like(prompts),
            max_new_tokens=new_tokens,
            do_sample=False,
            **extra,
        )

    generate()
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = generate()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    made = out.shape[1] - prompts.shape[1]
    return {
        "way": way,
        "batch": batch,
        "new_tokens": made,
        "tokens_per_s": batch * made / seconds,
        "attention": peft_model.config._attn_implementation,
        "training": peft_model.training,
        "generation_config": peft_model.generation_config.to_diff_dict(),
    }


def _save(folder: str, model: str) -> None:
    """The bench's random model and adapter values, saved for the plain ways to load."""
    import torch

    from slothkit.bench import generate_worker

    args = argparse.Namespace(model=model, rank=16, seed=0, mode="lora")
    peft_model = generate_worker.prepare("hf", args, torch.bfloat16, "cuda")
    peft_model.get_base_model().save_pretrained(folder)
    adapters = {n: p.detach().cpu() for n, p in peft_model.named_parameters() if "lora_" in n}
    torch.save(adapters, f"{folder}/adapters.pt")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--json", default=None)
    parser.add_argument("--rounds", type=int, default=1, help="times each way is run, in rotated orders")
    parser.add_argument("--ways", nargs="+", choices=WAYS, default=list(WAYS))
    parser.add_argument(
        "--child", nargs=4, metavar=("WAY", "FOLDER", "BATCH", "NEW_TOKENS"), help=argparse.SUPPRESS
    )
    parser.add_argument("--save", metavar="FOLDER", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.save:
        return _save(args.save, args.model)
    if args.child:
        way, folder, batch, new_tokens = args.child
        print("RESULT " + json.dumps(_one(way, folder, args.model, int(batch), int(new_tokens))))
        return
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        subprocess.run([sys.executable, __file__, "--model", args.model, "--save", folder], check=True)
        os.sync()  # the 16 GB just written would otherwise be flushed while the first ways run
        for batch in args.batches:
            for round_ in range(args.rounds):
                shift = round_ % len(args.ways)
                for way in args.ways[shift:] + args.ways[:shift]:
                    row = _run(way, folder, args.model, batch, args.new_tokens)
                    row["round"] = round_
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    if args.json:
        import datetime

        import torch

        record = {
            "command": "python scripts/hf_generate_baseline.py " + " ".join(sys.argv[1:]),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "rows": rows,
        }
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    print("\n| way | batch | median tokens/s | each round's |\n|---|---|---|---|")
    for batch in args.batches:
        for way in args.ways:
            figures = [
                r["tokens_per_s"]
                for r in rows
                if (r["way"], r["batch"]) == (way, batch) and "tokens_per_s" in r
            ]
            shown = ", ".join(f"{f:.1f}" for f in figures) or "failed"
            median = f"{statistics.median(figures):.1f}" if figures else "-"
            print(f"| {way} | {batch} | {median} | {shown} |")


def _run(way: str, folder: str, model: str, batch: int, new_tokens: int) -> dict:
    """One way timed in a fresh process."""
    if way == "worker":
        return _worker(model, batch, new_tokens)
    child = [sys.executable, __file__, "--model", model, "--child", way, folder, str(batch), str(new_tokens)]
    done = subprocess.run(child, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    return json.loads(lines[-1][7:]) if lines else {"way": way, "batch": batch, "error": done.stderr[-400:]}


if __name__ == "__main__":
    main()
