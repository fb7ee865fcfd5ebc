"""A new user's first journey, run by tests/test_packaging.py inside a fresh virtual
environment that holds an installed slothkit and nothing of this checkout.

Each step prints one ``journey <step>: ...`` line and the last line is a JSON summary
that the test reads. Run as ``python packaging_journey.py WORKDIR [--steps a,b,...]``;
the steps are:

  imports   import every module of slothkit, slothkit_kernels and the templates package
  demo      ``slothkit demo --quick`` (the first command the README gives)
  api       a tiny model through FastModel: LoRA, one training step, generate, a merged
            16-bit save reloaded by plain transformers, a GGUF file read back
  notebook  ``slothkit new-notebook`` renders the Llama fine-tune notebook, nbclient
            executes it on a tiny model, and it pushes to a local Hub server
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pkgutil
import subprocess
import sys
from pathlib import Path


def say(step: str, message: str) -> None:
    print(f"journey {step}: {message}", flush=True)


def import_every_module(workdir: Path) -> dict:
    import slothkit
    import slothkit_kernels
    import slothkit_templates

    names = []
    for package in (slothkit, slothkit_kernels):
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            importlib.import_module(info.name)
            names.append(info.name)
    # The templates are string.Template sources ($placeholders), read as text, never imported.
    templates = sorted(p.name for p in Path(slothkit_templates.__file__).parent.glob("*.py"))
    say("imports", f"{len(names)} modules from {Path(slothkit.__file__).parent}")
    return {"modules": names, "slothkit_file": slothkit.__file__, "templates": templates}


def quick_demo(workdir: Path) -> dict:
    result = subprocess.run(
        ["slothkit", "demo", "--quick", "--output-dir", str(workdir / "quick-demo")],
        capture_output=True,
        text=True,
        timeout=900,
    )
    say("demo", f"exit {result.returncode}; {result.stdout.strip().splitlines()[-1:]}")
    return {"returncode": result.returncode, "stdout": result.stdout, "stderr": result.stderr[-4000:]}


def api_journey(workdir: Path) -> dict:
    import torch
    from gguf import GGUFReader
    from transformers import AutoModelForCausalLM

    from slothkit import FastModel
    from slothkit.testing import build_tiny_model

    torch.manual_seed(0)
    checkpoint = build_tiny_model("llama", workdir / "tiny-llama", seed=0)
    model, tokenizer = FastModel.from_pretrained(str(checkpoint), dtype=torch.float32, load_in_4bit=False)
    model = FastModel.get_peft_model(model, r=8, lora_alpha=16, random_state=0)

    batch = tokenizer(["one two three four five six", "a b c d"], return_tensors="pt", padding=True)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(2):
        loss = model(**batch, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    say("api", f"trained: loss {losses[0]:.4f} -> {losses[1]:.4f}")

    FastModel.for_inference(model)
    prompt = tokenizer(["one two"], return_tensors="pt")
    generated = model.generate(**prompt, max_new_tokens=6, do_sample=False)
    with torch.no_grad():
        trained_logits = model(**batch).logits.float()

    merged_dir = workdir / "merged"
    model.save_pretrained_merged(str(merged_dir), tokenizer, save_method="merged_16bit")
    merged = AutoModelForCausalLM.from_pretrained(str(merged_dir))
    merged_dtype = str(merged.dtype)
    with torch.no_grad():
        merged_logits = merged.float()(**batch).logits.float()
    mask = batch["attention_mask"].bool()
    # The merged weights are the trained ones rounded once to 16 bits: the logits agree
    # to a 16-bit rounding of the weights, far below the logits' own spread.
    difference = (merged_logits - trained_logits)[mask].abs().max().item()
    spread = trained_logits[mask].std().item()
    say("api", f"merged {merged_dtype}: max |logit difference| {difference:.2e} (logit std {spread:.2e})")

    gguf_dir = workdir / "gguf"
    model.save_pretrained_gguf(str(gguf_dir), tokenizer, quantization_method="q8_0")
    files = sorted(p.name for p in gguf_dir.glob("*.gguf"))
    reader = GGUFReader(str(gguf_dir / files[0]))
    architecture = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    say("api", f"gguf {files}: architecture {architecture}, {len(reader.tensors)} tensors")
    return {
        "losses": losses,
        "generated_new_tokens": generated.shape[1] - prompt["input_ids"].shape[1],
        "merged_dtype": merged_dtype,
        "merged_logit_difference": difference,
        "logit_spread": spread,
        "gguf_files": files,
        "gguf_architecture": architecture,
        "gguf_tensors": len(reader.tensors),
        "layers": model.config.num_hidden_layers,
    }


def notebook_journey(workdir: Path) -> dict:
    from slothkit.notebook.execute import execute_notebook
    from slothkit.testing import build_tiny_model
    from slothkit.testing.local_hub import LocalHub

    rendered = subprocess.run(
        ["slothkit", "new-notebook", "llama-3-8b", "--output", str(workdir / "my-llama")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if rendered.returncode != 0:
        raise RuntimeError(f"slothkit new-notebook failed: {rendered.stdout}{rendered.stderr}")
    notebook_path = workdir / "my-llama.ipynb"
    checkpoint = build_tiny_model("llama", workdir / "tiny-llama-notebook", seed=0)
    hub = LocalHub().start()
    try:
        environment = {
            **hub.client_env(),
            "HF_HUB_OFFLINE": "0",
            "SLOTHKIT_NO_INSTALL": "1",
            "SLOTHKIT_MODEL_NAME": str(checkpoint),
            "SLOTHKIT_LOAD_IN_4BIT": "0",
            # The notebook's train cell checks that the loss went down: as in notebooks/conftest.py.
            "SLOTHKIT_MAX_STEPS": "16",
            "SLOTHKIT_LEARNING_RATE": "0.002",
            "SLOTHKIT_OUTPUT_DIR": str(workdir / "notebook-outputs"),
            "SLOTHKIT_SAVE_GGUF": "1",
            "SLOTHKIT_GGUF_QUANTS": "q8_0",
            "SLOTHKIT_HUB_REPO": "local-user/my-llama",
            "SLOTHKIT_HUB_TOKEN": hub.token,
        }
        notebook = execute_notebook(notebook_path, environment, timeout=900)
        pushed = sorted(hub.files("local-user/my-llama"))
    finally:
        hub.stop()
    outputs = workdir / "notebook-outputs"
    written = sorted(str(p.relative_to(outputs)) for p in outputs.rglob("*") if p.is_file())
    say(
        "notebook", f"{len(notebook.cells)} cells ran; wrote {len(written)} files; pushed {len(pushed)} files"
    )
    return {"cells": len(notebook.cells), "written": written, "pushed": pushed}


STEPS = {"imports": import_every_module, "demo": quick_demo, "api": api_journey, "notebook": notebook_journey}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("workdir", type=Path)
    parser.add_argument("--steps", default=",".join(STEPS))
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    os.chdir(args.workdir)
    summary = {"python": sys.executable}
    for step in args.steps.split(","):
        summary[step] = STEPS[step](args.workdir)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
