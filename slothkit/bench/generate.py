"""`slothkit bench generate`: decode tokens/s and memory, implementation by implementation.

Like `bench train`: one subprocess per implementation and batch size
(slothkit.bench.generate_worker), the same random weights, adapters and prompts in each,
greedy with a fixed number of new tokens; the record keeps each row's first tokens, and
the table says in how many rows they equal Hugging Face's, and what share each row's
tokens/s is of what the GPU's memory bandwidth allows (slothkit.bench.decode_limit).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from slothkit.bench.train import environment, write_record
from slothkit.bench.train_worker import RESULT_TAG
from slothkit.core.arguments import positive_float, positive_int
from slothkit.models import IMAGE_TEXT_SHAPES, SHAPES, language_shape_by_name

IMPLEMENTATIONS = ("slothkit", "hf", "unsloth", "slothkit-merged")


def _batches(text: str) -> list[int]:
    try:
        batches = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        batches = []
    if not batches or min(batches) < 1:
        raise ValueError(f"--batch {text}: expected positive integers separated by commas, such as 1,8")
    return batches


def run_worker(impl: str, batch: int, args) -> dict:
    command = [
        sys.executable,
        "-m",
        "slothkit.bench.generate_worker",
        *("--impl", impl, "--model", args.model, "--mode", args.mode, "--dtype", args.dtype),
        *("--batch", str(batch), "--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens)),
        *("--rank", str(args.rank), "--ttft-len", str(args.ttft_len if batch == 1 else 0)),
    ]
    if args.memory_gib:
        command += ["--memory-gib", str(args.memory_gib)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    completed = subprocess.run(command, capture_output=True, text=True, env=env)
    for line in completed.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG) :])
    tail = (completed.stderr or completed.stdout).strip().splitlines()[-3:]
    return {"status": "error", "error": f"worker exited {completed.returncode}: " + " | ".join(tail)}


def summarise(results: dict) -> list[dict]:
    """One row per (batch, implementation): tokens/s, its ratio to HF's, TTFT, memory, and
    how many rows' first tokens equal HF's."""
    rows = []
    for (batch, impl), result in results.items():
        row = {"impl": impl, "batch": batch, "status": result.get("status")}
        if result.get("status") != "ok":
            row["error"] = result.get("error")
            rows.append(row)
            continue
        for key in ("tokens_per_s", "ttft_s", "peak_allocated_gib", "peak_reserved_gib", "generation_gib"):
            row[key] = result.get(key)
        row["kv_cache_gib"] = result.get("kv_cache_gib")
        row["allocator"] = result.get("allocator")
        limit = result.get("limit_tokens_per_s")
        if limit:
            row["limit_tokens_per_s"] = limit
            row["share_of_limit"] = result["tokens_per_s"] / limit
        for key in ("copy_gb_per_s", "datasheet_gb_per_s"):
            if result.get(key):
                row[key] = result[key]
        if result.get("ttft_error"):
            row["ttft_error"] = result["ttft_error"]
        hf = results.get((batch, "hf"), {})
        if hf.get("status") == "ok":
            row["vs_hf"] = result["tokens_per_s"] / hf["tokens_per_s"]
            if result.get("compare_tokens", True):
                pairs = list(zip(result["first_tokens"], hf["first_tokens"]))
                row["rows_equal_hf"] = f"{sum(a == b for a, b in pairs)}/{len(pairs)}"
            if result.get("ttft_s") and hf.get("ttft_s"):
                row["ttft_vs_hf"] = result["ttft_s"] / hf["ttft_s"]
        rows.append(row)
    return rows


def format_table(rows: list[dict]) -> str:
    """A Markdown table of the rows."""
    header = (
        "| impl | batch | tokens/s | vs HF | of bandwidth limit | TTFT s | rows = HF | peak alloc GiB | "
        "reserved GiB | KV cache GiB |"
    )
    lines = [header, "|---" * 10 + "|"]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['impl']} | {r['batch']} | {r['status']}: {str(r.get('error', ''))[:120]} |")
            continue

        def f(key, fmt, r=r):
            value = r.get(key)
            return format(value, fmt) if isinstance(value, (int, float)) else "-"

        lines.append(
            f"| {r['impl']} | {r['batch']} | {f('tokens_per_s', ',.1f')} | {f('vs_hf', '.2f')} | "
            f"{f('share_of_limit', '.0%')} | {f('ttft_s', '.3f')} | {r.get('rows_equal_hf', '-')} | {f('peak_allocated_gib', '.2f')} | "
            f"{f('peak_reserved_gib', '.2f')} | {f('kv_cache_gib', '.3f')} |"
        )
    return "\n".join(lines)


def run_generate_bench(args) -> dict:
    impls = [i.strip() for i in args.impl.split(",") if i.strip()]
    unknown = [i for i in impls if i not in IMPLEMENTATIONS]
    if unknown:
        raise ValueError(f"unknown implementation(s) {unknown}; known: {', '.join(IMPLEMENTATIONS)}")
    language_shape_by_name(args.model)
    batches = _batches(args.batch)
    if args.t4:
        args.dtype, args.memory_gib = "fp16", min(args.memory_gib or 15.0, 15.0)
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU here: the generation benchmark measures the fast decode path on a GPU")
    record = {
        **environment(),
        "kind": "generate",
        **{key: getattr(args, key) for key in ("model", "mode", "dtype", "prompt_len", "new_tokens", "rank")},
        "batches": batches,
        "ttft_len": args.ttft_len,
        "memory_gib": args.memory_gib,
    }
    results = {}
    runs = [(batch, impl) for batch in batches for impl in (impls if batch % 2 else impls[::-1])]
    for done, (batch, impl) in enumerate(runs, 1):
        print(
            f"[{done}/{len(runs)}] {impl} {args.model} {args.mode} batch {batch} ...",
            file=sys.stderr,
            flush=True,
        )
        results[(batch, impl)] = run_worker(impl, batch, args)
        record.update(
            rows=summarise(results),
            raw={f"{impl}@{batch}": result for (batch, impl), result in results.items()},
        )
        write_record(args.output, record, pending=[f"{i} batch {b}" for b, i in runs[done:]])
    print(format_table(record["rows"]))
    return record


def add_arguments(parser) -> None:
    parser.add_argument(
        "--model",
        default="llama-3-8b",
        help=f"a known shape ({', '.join(SHAPES)}) or image-text shape ({', '.join(IMAGE_TEXT_SHAPES)}: "
        "each prompt holds one image besides its --prompt-len text tokens)",
    )
    parser.add_argument("--mode", choices=["lora", "qlora"], default="lora")
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--batch", default="1,8", help="comma-separated batch sizes")
    parser.add_argument("--prompt-len", type=positive_int, default=128)
    parser.add_argument("--new-tokens", type=positive_int, default=256)
    parser.add_argument(
        "--ttft-len", type=int, default=2048, help="prompt length of the time-to-first-token run (batch 1)"
    )
    parser.add_argument("--rank", type=positive_int, default=16)
    parser.add_argument(
        "--impl",
        default="slothkit,hf,unsloth,slothkit-merged",
        help="comma-separated: slothkit, hf, unsloth, slothkit-merged (the adapters merged into the weights)",
    )
    parser.add_argument("--memory-gib", type=positive_float, default=None, help="cap GPU memory per process")
    parser.add_argument("--t4", action="store_true", help="a T4 stand-in: fp16 under a 15 GiB cap")
    parser.add_argument("--output", help="write the JSON record here")
