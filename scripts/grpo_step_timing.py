"""One GRPO step on a GPU, its sampling and the rest of it timed apart, for one
implementation per process.

The model is the named shape with random weights (slothkit.bench.model_setup.build_model),
LoRA r=16 on the seven projections, trained by TRL's GRPOTrainer on prompts of the tiny
test tokenizer's text (its ids are valid for any vocabulary; sampled ids it lacks decode
to nothing, which the length reward below does not mind).  Each step samples
``--generations`` completions of one prompt of about ``--prompt-len`` tokens up to
``--completion-len`` new tokens, then computes log-probabilities, the reference pass and
the update.  The sampling time is every ``generate`` call of the step, synchronised; the
rest is the step's time less it.  Steps after the first (graph capture, autotuning) are
reported; their median.

    python scripts/grpo_step_timing.py --impl slothkit --model llama-3-8b --mode qlora
    python scripts/grpo_step_timing.py --impl hf ...      # plain transformers + PEFT + TRL
    python scripts/grpo_step_timing.py --impl unsloth ... # Unsloth's loading, LoRA and patched TRL
    python scripts/grpo_step_timing.py --impl slothkit --mode lora --device cpu --completion-len 8

Prints one JSON line prefixed with RESULT.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch

DEVICE = "cuda"


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _length_reward(completions, **kwargs):
    """Shorter completions score higher: a reward that differs between samples."""
    return [-len(c) / 100.0 for c in completions]


def _timed_generate(model, seconds: list):
    generate = model.generate

    def timed(*args, **kwargs):
        _sync()
        start = time.perf_counter()
        out = generate(*args, **kwargs)
        _sync()
        seconds.append(time.perf_counter() - start)
        return out

    model.generate = timed


def _prompts(tokenizer, length: int, count: int):
    import datasets

    words = "the sloth climbs slowly up the tall green tree and looks at the river below".split()
    rows = []
    for index in range(count):
        text = " ".join(words[(index + i) % len(words)] for i in range(length))
        ids = tokenizer(text)["input_ids"][:length]
        rows.append({"prompt": tokenizer.decode(ids, skip_special_tokens=True)})
    return datasets.Dataset.from_list(rows)


def build(impl: str, args, dtype):
    from transformers import AutoTokenizer

    from slothkit.bench.model_setup import LORA_TARGETS, build_model
    from slothkit.testing import tiny_model_path

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_path("llama")))
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    if impl == "unsloth":
        # As Unsloth's GRPO notebooks run it without vLLM: its own 4-bit loading from a
        # checkpoint on disk, its LoRA with offloaded checkpointing, and TRL's GRPOTrainer
        # as Unsloth patches it on import (sampling through Unsloth's generate).
        from slothkit.bench.model_setup import load_with_unsloth

        setting = argparse.Namespace(
            seq=args.prompt_len + args.completion_len + 64, mode=args.mode, rank=16, seed=0
        )
        model, _ = load_with_unsloth(build_model(args.model, dtype, DEVICE, 0), setting, dtype)
        return model, tokenizer
    model = build_model(args.model, dtype, DEVICE, 0, quantize_nf4=args.mode == "qlora")
    if impl == "slothkit":
        from slothkit import FastModel
        from slothkit.engine.decoder import patch_decoder
        from slothkit.inference.generation import accept_encoding_in_generate
        from slothkit.models import architecture_for

        patch_decoder(model, architecture_for(model.config))
        accept_encoding_in_generate(model)
        model = FastModel.get_peft_model(model, r=16, lora_alpha=16)
        model.train()
        return model, tokenizer
    from peft import LoraConfig, get_peft_model

    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    model = get_peft_model(
        model, LoraConfig(r=16, lora_alpha=16, target_modules=LORA_TARGETS, task_type="CAUSAL_LM")
    )
    model.train()
    return model, tokenizer


def run(args) -> dict:
    if args.impl == "unsloth":
        os.environ.setdefault("UNSLOTH_DISABLE_STATISTICS", "1")
        import unsloth  # noqa: F401  (before transformers and trl, which it patches)
    from transformers import TrainerCallback

    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    model, tokenizer = build(args.impl, args, dtype)
    dataset = _prompts(tokenizer, args.prompt_len, 4 * args.steps)
    settings = dict(
        max_steps=args.steps,
        per_device_train_batch_size=args.generations,
        gradient_accumulation_steps=1,
        num_generations=args.generations,
        max_completion_length=args.completion_len,
        learning_rate=1e-5,
        beta=0.04,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        output_dir=tempfile.mkdtemp(prefix="grpo-timing-"),
        bf16=DEVICE == "cuda",
        seed=0,
    )
    if args.impl == "slothkit":
        from slothkit.trl import GRPOTrainer
        from slothkit.trl.defaults import grpo_config

        config = grpo_config(model, **settings)
        trainer = GRPOTrainer(
            model=model,
            processing_class=tokenizer,
            reward_funcs=[_length_reward],
            train_dataset=dataset,
            args=config,
        )
    else:
        import trl

        # Unsloth checkpoints through its own get_peft_model setting, not the Trainer's.
        config = trl.GRPOConfig(gradient_checkpointing=args.impl == "hf", **settings)
        trainer = trl.GRPOTrainer(
            model=model,
            reward_funcs=[_length_reward],
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
        )
    sampling: list[float] = []
    _timed_generate(model, sampling)
    steps: list[tuple[float, float]] = []

    class StepClock(TrainerCallback):
        def on_step_begin(self, *unused, **kwargs):
            _sync()
            self.start, self.sampled = time.perf_counter(), len(sampling)

        def on_step_end(self, *unused, **kwargs):
            _sync()
            steps.append((time.perf_counter() - self.start, sum(sampling[self.sampled :])))

    trainer.add_callback(StepClock())
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    measured = steps[1:] or steps
    step = statistics.median(s for s, _ in measured)
    sample = statistics.median(g for _, g in measured)
    lengths = [entry.get("completions/mean_length") for entry in trainer.state.log_history]
    return {
        "impl": args.impl,
        "status": "ok",
        "model": args.model,
        "mode": args.mode,
        "generations": args.generations,
        "prompt_len": args.prompt_len,
        "completion_len": args.completion_len,
        "steps_timed": len(measured),
        "generate_calls": len(sampling),
        "step_s": step,
        "sampling_s": sample,
        "rest_s": step - sample,
        "completion_mean_length": [x for x in lengths if x is not None],
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if DEVICE == "cuda" else None,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if DEVICE == "cuda" else None,
        "all_steps": steps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impl", choices=["slothkit", "hf", "unsloth"], required=True)
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--mode", choices=["lora", "qlora"], default="qlora")
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--completion-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument(
        "--device", default="cuda", help="cpu: a two-layer shrunken shape, to check the script itself"
    )
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cpu":
        import dataclasses

        from slothkit import models

        small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
        small.update(num_key_value_heads=2, vocab_size=1024)
        models.SHAPES["cpu-check"] = dataclasses.replace(models.shape_by_name(args.model), **small)
        args.model = "cpu-check"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        result = run(args)
    except Exception as error:  # the other implementation still runs
        import traceback

        result = {"impl": args.impl, "status": "error", "error": f"{type(error).__name__}: {error}"}
        traceback.print_exc()
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
