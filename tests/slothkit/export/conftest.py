"""Fixtures for the export tests: tiny LoRA models with non-zero adapters, and a local Hub."""

import os
import warnings

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may reach the real Hub

ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def randomize_lora_b(model, seed: int, scale: float = 0.05) -> None:
    """PEFT initialises B to zero (the adapter starts as a no-op); give it values so that a
    merge that dropped or mis-scaled the adapter shows in the logits."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name or "lora_embedding_B" in name:  # drawn on the CPU: the same on any device
                param.copy_(torch.randn(param.shape, generator=generator) * scale)


@pytest.fixture
def make_lora_model():
    """make_lora_model(arch, load_in_4bit=False, seed=0, **get_peft_model kwargs) ->
    (peft model in eval mode, tokenizer, base checkpoint path)."""
    from slothkit import FastModel
    from slothkit.testing import tiny_model_path

    def make(arch, load_in_4bit=False, seed=0, dtype=torch.float32, peft_directly=False, **peft_kwargs):
        """peft_directly: add the adapters with PEFT's own get_peft_model, which puts LoRA on
        every module target_modules names, embeddings included (FastModel.get_peft_model
        trains embed_tokens and lm_head in full when they are named there, as Unsloth does)."""
        path = tiny_model_path(arch)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, tokenizer = FastModel.from_pretrained(str(path), load_in_4bit=load_in_4bit, dtype=dtype)
            peft_kwargs.setdefault("r", 4)
            peft_kwargs.setdefault("lora_alpha", 8)
            peft_kwargs.setdefault("target_modules", ALL_PROJECTIONS)
            if peft_directly:
                from peft import LoraConfig, get_peft_model

                from slothkit.export import attach_export_methods

                torch.manual_seed(3407)
                model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **peft_kwargs))
                attach_export_methods(model)
            else:
                model = FastModel.get_peft_model(model, use_gradient_checkpointing=False, **peft_kwargs)
        randomize_lora_b(model, seed)
        FastModel.for_inference(model)
        return model, tokenizer, path

    return make


@pytest.fixture
def input_ids():
    generator = torch.Generator().manual_seed(1234)
    return torch.randint(3, 600, (2, 11), generator=generator)  # ids the tiny tokenizers produce


@pytest.fixture
def logits():
    @torch.no_grad()
    def run(model, ids):
        model.eval()
        device = next(model.parameters()).device  # a model on the GPU, or loaded back on the CPU
        return model(input_ids=ids.to(device)).logits.float().cpu()

    return run


@pytest.fixture
def relative_error():
    """max |a - b| / max |b|: one number for 'the same logits up to rounding'."""

    def error(a, b):
        return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()

    return error


@pytest.fixture
def assert_merged_16bit(input_ids, logits, relative_error):
    """assert_merged_16bit(folder, model, tokenizer, expected, **merge_options) -> the merge
    of `model` in float32.

    A merged_16bit save rounds the merged weights once, to 16 bits.  So: the merge kept in
    float32 (merged_plain_model, as the GGUF writer takes it, with the same base_weights
    options) computes `expected` to 1e-4, and the checkpoint in `folder`, loaded with plain
    transformers, holds exactly those weights rounded to bfloat16 (the 16-bit dtype of a
    model held in float32), every tensor, tied ones included."""
    from transformers import AutoModelForCausalLM

    from slothkit.export.save import merged_plain_model

    def check(folder, model, tokenizer, expected, **merge_options):
        merged = merged_plain_model(model, tokenizer, **merge_options)
        assert merged.dtype == torch.float32
        assert relative_error(logits(merged, input_ids), expected) < 1e-4
        saved = AutoModelForCausalLM.from_pretrained(folder)
        assert saved.dtype == torch.bfloat16
        reference = merged.state_dict()
        for name, tensor in saved.state_dict().items():
            assert torch.equal(tensor, reference[name].to(torch.bfloat16)), name
        return merged

    return check
