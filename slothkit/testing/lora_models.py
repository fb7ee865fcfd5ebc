"""Models the export tests compare against: a saved checkpoint loaded as plain transformers
reads it, and FastModel's LoRA model of it with every adapter's B drawn at random (PEFT
starts B at zero, where a writer or merge that dropped the adapters would still pass).
Imported by tests only."""

from __future__ import annotations

import torch


def load_plain(path):
    """(the checkpoint at ``path`` in float32, in eval mode; its tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(path)


def lora_with_random_b(path, seed: int = 5, scale: float = 0.05):
    """(FastModel's r=8, alpha=16 LoRA model of the checkpoint at ``path``, in eval mode;
    its tokenizer; the names of the B matrices drawn), each B from N(0, scale^2), drawn in
    sorted name order."""
    from slothkit import FastModel

    model, tokenizer = FastModel.from_pretrained(str(path), dtype=torch.float32, load_in_4bit=False)
    model = FastModel.get_peft_model(model, r=8, lora_alpha=16, use_gradient_checkpointing=False)
    generator = torch.Generator().manual_seed(seed)
    drawn = []
    with torch.no_grad():
        for name, parameter in sorted(model.named_parameters()):
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * scale)
                drawn.append(name)
    return model.eval(), tokenizer, drawn
