"""The embedded default job: LoRA-train a tiny offline model for a few steps.

It needs no download and no GPU, so it proves an install end to end: a tiny
random checkpoint and tokenizer are built locally (slothkit.testing), loaded
with FastModel (the fused path on a GPU; on a CPU the Hugging Face modules, which
are faster there), LoRA adapters go on all seven projections, and the adapter is
saved at the end.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch

# A few lines of text the demo model learns to continue.
DEMO_TEXTS = [
    "The sloth moves slowly through the canopy, eating leaves and sleeping in the sun.",
    "Fine-tuning adapts a pretrained language model to a new task with a little data.",
    "LoRA trains two small matrices per layer while the large base weights stay frozen.",
    "A fused kernel reads its inputs once and writes its outputs once.",
]

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def run_demo(
    output_dir: str | Path = "slothkit-demo-output",
    steps: int = 8,
    arch: str = "llama",
    learning_rate: float = 5e-3,
    seed: int = 3407,
) -> dict:
    from slothkit import FastModel
    from slothkit.testing import build_tiny_model

    torch.manual_seed(seed)
    output_dir = Path(output_dir)
    device = "cuda" if torch.cuda.is_available() else "cpu"

    # Absolute: the adapter records where its base is, for an export run from anywhere.
    checkpoint = build_tiny_model(arch, output_dir.absolute() / "tiny-base", seed=seed)
    model, tokenizer = FastModel.from_pretrained(str(checkpoint), dtype=torch.float32, load_in_4bit=False)
    model = FastModel.get_peft_model(
        model,
        r=16,
        lora_alpha=16,
        target_modules=LORA_TARGETS,
        use_gradient_checkpointing=False,
        random_state=seed,
    )
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    print(f"tiny {arch} on {device}: {total:,} parameters, {trainable:,} trainable (LoRA r=16)")

    batch = tokenizer(DEMO_TEXTS, return_tensors="pt", padding=True).to(device)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=learning_rate)

    losses = []
    start = time.perf_counter()
    for step in range(1, steps + 1):
        loss = model(**batch, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        print(f"step {step:3d}  loss {losses[-1]:.4f}")
    elapsed = time.perf_counter() - start

    if not all(math.isfinite(v) for v in losses):
        raise RuntimeError(f"the demo's loss is not finite: {losses}")
    adapter_dir = output_dir / "lora-adapter"
    model.save_pretrained_merged(adapter_dir, tokenizer, save_method="lora", overwrite=True)
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} in {elapsed:.1f} s; adapter saved to {adapter_dir}")
    return {"losses": losses, "adapter_dir": str(adapter_dir), "seconds": elapsed}
