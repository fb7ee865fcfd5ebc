"""Training-step time on the CPU: FastModel against Hugging Face + PEFT on SmolLM2-135M-Instruct.

Where Triton cannot run (a CPU without the interpreter), FastModel keeps the plain Hugging
Face modules by default, and fused=True routes the model through slothkit's fused path with
the kernels' plain-torch references.  This script times one AdamW step of each, float32,
LoRA r=16 on all seven projections, in four settings: a padded chat-like batch (8 x 52 with
an attention mask) and an unpadded one (4 x 128), each with and without gradient
checkpointing.

The three models of one setting live in one process and their steps alternate (A, B, C, A,
B, C, ...), so a load that comes and goes on the machine slows all three alike.  Each step
is timed twice: wall-clock time, and the CPU time of this process (all its threads), which
other processes on a shared machine disturb far less; the figures are medians.  Losses are
printed beside the times: the three must agree.

    python scripts/cpu_speed.py [--repeats 5] [--json results/cpu/NAME.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings

os.environ["TRITON_INTERPRET"] = "0"  # the CPU as users meet it: no Triton interpreter

import torch  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SETTINGS = {  # name: (batch, tokens, padded)
    "padded 8x52": (8, 52, True),
    "unpadded 4x128": (4, 128, False),
}


def _batch(vocab: int, batch: int, tokens: int, padded: bool) -> dict:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, tokens), generator=generator)
    mask = torch.ones(batch, tokens, dtype=torch.long)
    if padded:  # rows end 0, 5, 10, ... tokens early, as a padded chat batch does
        for row in range(batch):
            mask[row, tokens - 5 * row :] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _hf_peft(path: str, checkpointing: bool):
    import peft
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    torch.manual_seed(3407)
    model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=16, target_modules=TARGETS))
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    return model


def _slothkit(path: str, checkpointing: bool, fused: bool | None):
    from slothkit import FastModel

    model, _ = FastModel.from_pretrained(path, dtype=torch.float32, load_in_4bit=False, fused=fused)
    return FastModel.get_peft_model(
        model, r=16, lora_alpha=16, target_modules=TARGETS, use_gradient_checkpointing=checkpointing
    )


class Runner:
    def __init__(self, model):
        self.model = model.train()
        params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=1e-4)
        self.times: list[float] = []
        self.cpu_times: list[float] = []
        self.losses: list[float] = []

    def step(self, batch: dict, timed: bool) -> None:
        start, cpu_start = time.perf_counter(), time.process_time()
        loss = self.model(**batch).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        if timed:
            self.times.append(elapsed)
            self.cpu_times.append(cpu)
            self.losses.append(loss.item())


def measure(path: str, setting: str, checkpointing: bool, repeats: int) -> dict:
    batch_size, tokens, padded = SETTINGS[setting]
    runners = {
        "HF + PEFT": Runner(_hf_peft(path, checkpointing)),
        "slothkit (default)": Runner(_slothkit(path, checkpointing, fused=None)),
        "slothkit fused=True": Runner(_slothkit(path, checkpointing, fused=True)),
    }
    batch = _batch(runners["HF + PEFT"].model.config.vocab_size, batch_size, tokens, padded)
    for runner in runners.values():
        runner.step(batch, timed=False)  # warm-up: allocator, autograd graph, caches
    for _ in range(repeats):
        for runner in runners.values():
            runner.step(batch, timed=True)
    return {
        name: {
            "median_s": statistics.median(r.times),
            "median_cpu_s": statistics.median(r.cpu_times),
            "times_s": r.times,
            "cpu_times_s": r.cpu_times,
            "losses": r.losses,
        }
        for name, r in runners.items()
    }


def _commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per model (default 5)")
    parser.add_argument("--json", help="write the record here")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")  # the notices are known; this script prints a table

    from slothkit.testing import real_model_path

    path = str(real_model_path("smollm2-135m-instruct"))
    rows = []
    for setting in SETTINGS:
        for checkpointing in (False, True):
            result = measure(path, setting, checkpointing, args.repeats)
            hf = result["HF + PEFT"]["median_s"]
            hf_cpu = result["HF + PEFT"]["median_cpu_s"]
            for name, figures in result.items():
                rows.append(
                    {
                        "setting": setting,
                        "checkpointing": checkpointing,
                        "implementation": name,
                        **figures,
                        "ratio_to_hf": figures["median_s"] / hf,
                        "cpu_ratio_to_hf": figures["median_cpu_s"] / hf_cpu,
                    }
                )
                print(
                    f"{setting:15s} ckpt={str(checkpointing):5s} {name:20s} "
                    f"wall {figures['median_s']:6.3f} s ({figures['median_s'] / hf:4.2f}x HF)  "
                    f"cpu {figures['median_cpu_s']:6.3f} s ({figures['median_cpu_s'] / hf_cpu:4.2f}x HF)  "
                    f"final loss {figures['losses'][-1]:.5f}",
                    flush=True,
                )
    record = {
        "what": "one AdamW training step, SmolLM2-135M-Instruct, float32, LoRA r=16 on 7 projections",
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "commit": _commit(),
        "repeats": args.repeats,
        "rows": rows,
    }
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as handle:
            json.dump(record, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
