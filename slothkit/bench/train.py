"""`slothkit bench train`: training throughput and memory, implementation by implementation.

Each implementation runs in its own subprocess (slothkit.bench.train_worker) on
the same shape, weights, data and LoRA settings; repeats alternate between
implementations so that drift of the GPU's clocks hits them alike.  A peer whose
package is missing is reported as skipped, one that fails or runs out of memory
as such, with its error; the others still run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

from slothkit.bench.best import candidate_summary, fastest_that_fits, settings_for
from slothkit.bench.model_setup import CHECKPOINTING, CUDA_GRAPHS, KEEP_SUMS
from slothkit.bench.multi_gpu import PEAK_FIELDS, check_gpus, launcher_command, with_scaling
from slothkit.bench.train_worker import RESULT_TAG
from slothkit.core.arguments import non_negative_int, positive_float, positive_int
from slothkit.core.configuration import environment_defaults
from slothkit.models import IMAGE_TEXT_SHAPES, SHAPES, language_shape_by_name

IMPLEMENTATIONS = ("slothkit", "hf", "liger", "unsloth")


def split_source_tree(impl: str) -> tuple[str, str | None]:
    """ "slothkit@DIR" -> ("slothkit", DIR): slothkit imported from another source tree
    (made by scripts/ab_tree.sh REV), to compare two versions in one run; else (impl, None)."""
    name, _, tree = impl.partition("@")
    return name, (tree or None)


def check_implementations(impls: list[str]) -> None:
    """Refuse unknown names, and a source tree that does not hold an importable slothkit."""
    unknown = [i for i in impls if split_source_tree(i)[0] not in IMPLEMENTATIONS]
    if unknown:
        raise ValueError(
            f"unknown implementation(s) {unknown}; known: {', '.join(IMPLEMENTATIONS)} "
            f"(and slothkit@DIR for a source tree made by scripts/ab_tree.sh)"
        )
    for impl in impls:
        name, tree = split_source_tree(impl)
        if tree is None:
            continue
        if name != "slothkit":
            raise ValueError(f"{impl}: only slothkit can be run from another source tree")
        missing = [d for d in ("slothkit", "slothkit_kernels") if not (Path(tree) / d).is_dir()]
        if missing:
            raise ValueError(
                f"{impl}: {tree} lacks {', '.join(missing)}/; make it with "
                f"`bash scripts/ab_tree.sh REV` (it writes .ab/REV)"
            )


def tree_first_path(tree: str, pythonpath: str) -> str:
    """PYTHONPATH for a worker running slothkit from `tree`: the tree first, and without
    any entry that holds another slothkit source tree (the GPU scripts put the checkout's
    root on the path), so that the worker imports one version of slothkit, its kernels
    and its templates, and a name the tree lacks fails rather than comes from another."""

    def other_tree(entry: str) -> bool:
        return (Path(entry) / "slothkit" / "__init__.py").is_file()

    kept = [entry for entry in pythonpath.split(os.pathsep) if entry and not other_tree(entry)]
    return os.pathsep.join([tree] + kept)


def run_worker(impl: str, args, extra_env=None) -> dict:
    impl, tree = split_source_tree(impl)
    cwd = None
    if tree is not None:
        # The worker, slothkit and its kernels all come from that tree: it goes first on
        # the path, and is the working directory, which `python -m` puts before everything.
        cwd = str(Path(tree).resolve())
        extra_env = {
            **(extra_env or {}),
            "PYTHONPATH": tree_first_path(cwd, os.environ.get("PYTHONPATH", "")),
        }
    # --gpus N: torchrun with a process per GPU; the matmul peak is one GPU's.
    gpus = 1 if impl == "matmul-peak" else getattr(args, "gpus", 1)
    command = [
        *launcher_command(gpus),
        "-m",
        "slothkit.bench.train_worker",
        "--impl",
        impl,
        "--model",
        args.model,
        "--mode",
        args.mode,
        "--dtype",
        args.dtype,
        "--batch",
        str(args.batch),
        "--seq",
        str(args.seq),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--rank",
        str(args.rank),
    ]
    if getattr(args, "memory_gib", None):
        command += ["--memory-gib", str(args.memory_gib)]
    if not getattr(args, "autocast", True):
        command.append("--no-autocast")
    if getattr(args, "slothkit_checkpointing", "offload") != "offload":
        command += ["--slothkit-checkpointing", args.slothkit_checkpointing]
    if getattr(args, "hf_checkpointing", "on") != "on":
        command += ["--hf-checkpointing", args.hf_checkpointing]
    # Passed only when set, so that a source tree older than these flags still runs.
    for flag, key in (("--cuda-graphs", "cuda_graphs"), ("--keep-sums", "keep_sums")):
        if getattr(args, key, "auto") != "auto":
            command += [flag, getattr(args, key)]
    if getattr(args, "moe_gemm", "auto") != "auto":
        command += ["--moe-gemm", args.moe_gemm]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **(extra_env or {})}
    completed = subprocess.run(command, capture_output=True, text=True, env=env, cwd=cwd)
    for line in completed.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG) :])
    tail = (completed.stderr or completed.stdout).strip().splitlines()[-3:]
    return {"status": "error", "error": f"worker exited {completed.returncode}: " + " | ".join(tail)}


def flops_per_token(shape_name: str, seq: int, recomputed: float = 1.0) -> float:
    """LoRA training FLOPs per token: 4 x matmul parameters (forward and the
    input-gradient matmuls; frozen weights need no weight gradients) plus 2 x for the
    re-run forward of the checkpointed layers, and causal attention, 6 * T * layers *
    (heads * head_dim) per token plus 2 * T * ... for the re-run, in the layers that attend
    in full (the chunked delta rule of a hybrid's linear-attention layers is not counted).

    Args:
        shape_name: the model shape (an image-text shape: its language model, which reads
            every token; the vision tower's FLOPs are not counted).
        seq: the sequence length T.
        recomputed: the share of decoder layers re-run in backward (1: every layer
            checkpointed, 0: none).
    """
    shape = language_shape_by_name(shape_name)  # an image-text model's: its language model's alone
    per_pass = seq * shape.full_attention_layers() * shape.num_attention_heads * shape.head_dim()
    attention = (6 + 2 * recomputed) * per_pass
    return (4 + 2 * recomputed) * shape.matmul_parameters() + attention


def environment() -> dict:
    from slothkit.core.environment import accelerator, host, package_versions

    return {
        "accelerator": accelerator(),
        "host": host(),
        "versions": package_versions(),
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "slothkit " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
    }


def summarise(results: dict[str, list[dict]], args, peak_tflops: float | None) -> list[dict]:
    rows = []
    for impl, runs in results.items():
        ok = [r for r in runs if r.get("status") == "ok"]
        if not ok:
            rows.append({"impl": impl, **runs[-1]})
            continue
        row = {"impl": impl, "status": "ok", "runs": len(ok)}
        row["step_s"] = statistics.median(r["step_s"] for r in ok)
        gpus = ok[0].get("gpus", 1)  # under DDP each step trains a batch on every GPU
        row["tokens_per_s"] = gpus * args.batch * args.seq / row["step_s"]
        if peak_tflops:
            per_token = flops_per_token(args.model, args.seq, ok[0].get("recomputed", 1.0))
            row["mfu"] = row["tokens_per_s"] * per_token / (gpus * peak_tflops * 1e12)
        if gpus > 1:
            row["gpus"] = gpus
        for key in (*PEAK_FIELDS, "cuda_graphs"):
            if key in ok[0]:
                row[key] = max(r[key] for r in ok)
        last_run_keys = (
            "final_loss",
            "keep_sums",
            "recompute",
            "recomputed",
            "per_gpu",
            "adapters_in_sync",
            "allocator",
            "peak_host_scope",
            "trainable_parameters",
        )
        for key in last_run_keys:  # the last run's
            if key in ok[-1]:
                row[key] = ok[-1][key]
        row["losses"] = ok[-1]["losses"]
        if "step_times_s" in ok[0]:  # each run's timed steps
            row["step_times_s"] = [r["step_times_s"] for r in ok]
        rows.append(row)
    return with_ratios(rows)


def with_ratios(rows: list[dict]) -> list[dict]:
    """Each row that trained with its tokens/s relative to the HF + PEFT row's."""
    hf = next((r for r in rows if r["impl"] == "hf" and r["status"] == "ok"), None)
    for row in rows:
        row.pop("vs_hf", None)
        if hf and row["status"] == "ok":
            row["vs_hf"] = row["tokens_per_s"] / hf["tokens_per_s"]
    return rows


def summarise_best(results: dict[str, dict[str, list[dict]]], args, peak_tflops: float | None) -> list[dict]:
    """--best: per implementation, the fastest setting that trained (slothkit.bench.best),
    with the setting and every candidate's outcome."""
    rows = []
    for impl, by_setting in results.items():
        candidates = {
            name: summarise({impl: runs}, args, peak_tflops)[0] for name, runs in by_setting.items() if runs
        }
        if not candidates:
            continue
        name, row = fastest_that_fits(candidates)
        candidates_kept = [candidate_summary(n, r) for n, r in candidates.items()]
        rows.append({**row, "setting": name, "candidates": candidates_kept})
    return with_ratios(rows)


def format_table(rows: list[dict]) -> str:
    header = (
        "impl",
        "status",
        "step s",
        "tokens/s",
        "vs HF",
        "MFU",
        "peak GiB",
        "reserved",
        "above weights",
        "host peak GiB",
        "final loss",
    )
    lines = [" | ".join(header), " | ".join("---" for _ in header)]
    for r in rows:

        def f(key, fmt, r=r):
            return fmt.format(r[key]) if r.get(key) is not None else "-"

        status = r["status"] if r["status"] == "ok" else f"{r['status']}: {r.get('error', '')[:80]}"
        lines.append(
            " | ".join(
                [
                    r["impl"]
                    + (f" ({r['setting']})" if r.get("setting") else "")
                    + (f" ({r['gpus']} GPUs: {r['scaling']:.2f}x one)" if "scaling" in r else ""),
                    status,
                    f("step_s", "{:.3f}"),
                    f("tokens_per_s", "{:,.0f}"),
                    f("vs_hf", "{:.2f}x"),
                    f("mfu", "{:.1%}"),
                    f("peak_allocated_gib", "{:.1f}"),
                    f("peak_reserved_gib", "{:.1f}"),
                    f("training_gib", "{:.1f}"),
                    f("peak_host_gib", "{:.1f}"),
                    f("final_loss", "{:.4f}"),
                ]
            )
        )
    return "\n".join("| " + line + " |" for line in lines)


def run_train_bench(args) -> dict:
    apply_environment_defaults(args)
    apply_t4(args)
    impls = [i.strip() for i in args.impl.split(",") if i.strip()]
    check_implementations(impls)
    check_best(args)
    language_shape_by_name(args.model)
    import torch

    if not torch.cuda.is_available() and not args.model.startswith("tiny-"):
        raise SystemExit(
            f"no CUDA GPU here: {args.model} is a real-size shape. On a CPU, run a tiny "
            f"configuration instead: --model tiny-llama (or tiny-mistral, tiny-gemma) "
            f"--dtype fp32 --seq 64"
        )
    check_gpus(args.gpus, args.model, torch.cuda.device_count())
    if args.gpus > 1 and args.best:
        raise ValueError(
            "--best and --gpus N together are not supported: find the setting with --best on one GPU"
        )
    peak = None
    if torch.cuda.is_available():
        peak = run_worker("matmul-peak", args).get("tflops")
    record = {
        **environment(),
        "kind": "train",
        "model": args.model,
        "mode": args.mode,
        "dtype": args.dtype,
        "autocast": args.autocast,
        "slothkit_checkpointing": args.slothkit_checkpointing,
        "slothkit_cuda_graphs": args.cuda_graphs,
        "slothkit_keep_sums": args.keep_sums,
        "slothkit_moe_gemm": args.moe_gemm,
        "hf_checkpointing": args.hf_checkpointing,
        "memory_gib": args.memory_gib,
        "best": args.best,
        "batch": args.batch,
        "seq": args.seq,
        "steps": args.steps,
        "warmup": args.warmup,
        "rank": args.rank,
        "repeats": args.repeats,
        "gpus": args.gpus,
        "matmul_peak_tflops": peak,
    }
    # One run per implementation and setting (a single one unless --best), on one GPU and
    # (--gpus N) on N; repeats alternate the order so that drift of the GPU's clocks hits
    # them alike.
    runs = [
        (repeat, impl, setting, gpus)
        for repeat in range(args.repeats)
        for impl in (impls if repeat % 2 == 0 else impls[::-1])
        for setting in (settings_for(impl) if args.best else (None,))
        for gpus in sorted({1, args.gpus})
    ]
    results: dict[str, dict] = {impl: {} for impl in impls}  # the one-GPU runs
    spread: dict[str, list] = {impl: [] for impl in impls}  # the N-GPU runs
    for done, (_repeat, impl, setting, gpus) in enumerate(runs, 1):
        what = impl if setting is None else f"{impl} ({setting.name})"
        where = f" on {gpus} GPUs" if gpus > 1 else ""
        print(
            f"[{done}/{len(runs)}] {what} {args.model} {args.mode} {args.batch}x{args.seq}{where} ...",
            file=sys.stderr,
            flush=True,
        )
        run_args = argparse.Namespace(**{**vars(args), **(setting.flags if setting else {}), "gpus": gpus})
        result = run_worker(impl, run_args)
        if gpus > 1:
            spread[impl].append(result)
        else:
            results[impl].setdefault(None if setting is None else setting.name, []).append(result)
        # Written after each run: a benchmark cut short keeps what it measured.
        if args.best:
            rows = summarise_best(results, args, peak)
            raw = results
        else:
            ran = {impl: by_setting[None] for impl, by_setting in results.items() if by_setting}
            rows, raw = summarise(ran, args, peak), ran
            if args.gpus > 1:  # the N-GPU rows, each with its one-GPU run beside it
                ran_spread = {impl: by_run for impl, by_run in spread.items() if by_run}
                rows = with_scaling(summarise(ran_spread, args, peak), rows)
                raw = {"1": ran, str(args.gpus): ran_spread}
        record.update(rows=rows, raw=raw)
        pending = [
            (i if s is None else f"{i} ({s.name})")
            + (f" on {g} GPUs" if g > 1 else "")
            + f" (repeat {r + 1})"
            for r, i, s, g in runs[done:]
        ]
        write_record(args.output, record, pending=pending)
    print(format_table(record["rows"]))
    if args.output:
        print(f"record written to {args.output}", file=sys.stderr)
    return record


def check_best(args) -> None:
    """--best compares settings under a memory budget: it needs --memory-gib."""
    if getattr(args, "best", False) and not args.memory_gib:
        raise ValueError(
            "--best runs each implementation in its fastest setting that fits a budget: give the "
            "budget with --memory-gib B (for example --memory-gib 24 --best)"
        )


def write_record(output: str | None, record: dict, pending: list[str]) -> None:
    """Write the record (if an output path was given), with the runs still to come
    listed under "pending" while there are any."""
    if not output:
        return
    record.pop("pending", None)
    if pending:
        record["pending"] = pending
    path = Path(output)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    tmp.replace(path)  # never a half-written record


def add_arguments(parser) -> None:
    parser.add_argument(
        "--model",
        default="llama-3-8b",
        help=f"a known shape ({', '.join(SHAPES)}) or image-text shape ({', '.join(IMAGE_TEXT_SHAPES)}: "
        "each row holds one image at the processor's default resolution)",
    )
    parser.add_argument("--mode", choices=["lora", "qlora"], default="lora")
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    parser.add_argument("--batch", type=positive_int, default=2)
    parser.add_argument("--seq", type=positive_int, default=2048)
    parser.add_argument("--steps", type=positive_int, default=8, help="timed optimizer steps")
    parser.add_argument("--warmup", type=non_negative_int, default=3, help="untimed steps first")
    parser.add_argument("--rank", type=positive_int, default=16)
    parser.add_argument(
        "--repeats", type=positive_int, default=1, help="runs per implementation, alternating"
    )
    parser.add_argument(
        "--impl",
        default="slothkit,hf,liger,unsloth",
        help="comma-separated: slothkit, hf, liger, unsloth; slothkit@DIR runs slothkit "
        "from another source tree (scripts/ab_tree.sh REV makes .ab/REV), to "
        "compare two versions in one run",
    )
    parser.add_argument(
        "--memory-gib",
        type=positive_float,
        default=None,
        help="cap GPU memory per process (torch.cuda.set_per_process_memory_fraction)",
    )
    parser.add_argument(
        "--autocast",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run each step under torch.autocast, as Trainer/TRL with bf16=True or "
        "fp16=True do (default). --no-autocast: plain PEFT then computes its "
        "fp32 adapters in fp32, the slower path of a hand-written loop",
    )
    parser.add_argument(
        "--slothkit-checkpointing",
        choices=list(CHECKPOINTING),
        default="offload",
        help="slothkit's checkpointing: layer inputs offloaded to pinned host memory "
        "(default, what FastModel users get), kept on the GPU (on), or auto: the layers that "
        "fit --memory-gib (else the GPU's free memory) not checkpointed",
    )
    parser.add_argument(
        "--hf-checkpointing",
        choices=["on", "off"],
        default="on",
        help="HF + PEFT's and Liger's gradient checkpointing: on (default, non-reentrant, as "
        "their notebooks set it) or off",
    )
    parser.add_argument(
        "--best",
        action="store_true",
        help="with --memory-gib B: each implementation in its fastest setting that fits B "
        "(HF + PEFT and Liger with and without gradient checkpointing, Unsloth its own, "
        "slothkit use_gradient_checkpointing='auto'), one subprocess per setting; the "
        "record keeps the setting chosen and every candidate",
    )
    parser.add_argument(
        "--cuda-graphs",
        choices=list(CUDA_GRAPHS),
        default="auto",
        help="slothkit's cuda_graphs: replay each decoder layer's forward and backward (on), "
        "its forward only (forward), or neither (off); auto (default): "
        "SLOTHKIT_CUDA_GRAPHS if set, else FastModel's choice for the GPU and mode",
    )
    parser.add_argument(
        "--moe-gemm",
        choices=["auto", "triton", "grouped_mm"],
        default="auto",
        help="the backend of slothkit's mixture-of-experts grouped GEMMs "
        "(slothkit_kernels.moe.grouped_mm.set_backend): auto (default) runs "
        "torch._grouped_mm where that applies (bf16, compute capability 9.0 or newer) and "
        "the Triton kernel elsewhere; triton or grouped_mm choose one",
    )
    parser.add_argument(
        "--keep-sums",
        choices=list(KEEP_SUMS),
        default="auto",
        help="slothkit's keep_sums: keep each layer's residual sum after attention for "
        "its recompute (on) or not (off); auto (default): SLOTHKIT_KEEP_SUMS if set, "
        "else FastModel's choice for the GPU",
    )
    parser.add_argument(
        "--t4", action="store_true", help="a T4 stand-in on a bigger GPU: 15 GiB cap and fp16 instead of bf16"
    )
    parser.add_argument(
        "--gpus",
        type=int,
        default=1,
        help="train on N GPUs of this machine: each implementation runs under torchrun with N "
        "processes (DDP over NCCL, --batch per GPU) and also on one GPU; the record's rows give "
        "tokens/s summed over the GPUs, per-GPU peak memory, and the scaling against one GPU "
        "(slothkit.bench.multi_gpu). Without GPUs, a tiny shape runs N processes on the CPU",
    )
    parser.add_argument("--output", help="write the JSON record here")


def apply_environment_defaults(args) -> None:
    """--cuda-graphs and --keep-sums left at auto take the default a SLOTHKIT_* variable
    sets (slothkit.core.configuration), so that the record and the workers' arguments say
    what ran."""
    defaults = environment_defaults()
    words = {value: word for word, value in CUDA_GRAPHS.items()}
    if args.cuda_graphs == "auto":
        args.cuda_graphs = words[defaults.cuda_graphs]
    words = {value: word for word, value in KEEP_SUMS.items()}
    if args.keep_sums == "auto":
        args.keep_sums = words[defaults.keep_sums]


def apply_t4(args) -> None:
    """--t4: what a free Colab/Kaggle T4 offers: 15 GiB, no bf16, and so slothkit's
    settings below compute capability 8.0: no layer CUDA graphs and no kept sums, unless
    --cuda-graphs / --keep-sums (or their SLOTHKIT_* variables) ask for them."""
    if getattr(args, "t4", False):
        args.dtype = "fp16"
        args.memory_gib = min(args.memory_gib or 15.0, 15.0)
        if args.cuda_graphs == "auto":
            args.cuda_graphs = "off"
        if args.keep_sums == "auto":
            args.keep_sums = "off"
