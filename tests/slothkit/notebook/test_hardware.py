"""The hardware cell's settings per GPU (settings_that_fit) against the planner itself, and the
notebooks' claims about where their defaults fit (models.json's gpu_fit) held to the planner."""

import dataclasses

import pytest
import torch

from slothkit.memory.plan import plan
from slothkit.models import shape_by_name
from slothkit.notebook import NotebookConfig
from slothkit.notebook.hardware import LOWEST_RANK, settings_that_fit
from slothkit.notebook.render import model_data

GPUS = ("t4", "l4", "a100", "a100-80")


def _defaults(model: str, load_in_4bit: bool = True) -> NotebookConfig:
    data = model_data()[model]
    return NotebookConfig(
        model_name=model,
        load_in_4bit=load_in_4bit,
        max_seq_length=data["max_seq_length"],
        batch_size=data["t4_batch"],
        grad_accum=data["t4_grad_accum"],
    )


def _planned(config: NotebookConfig, rank: int, gpu: str):
    return plan(
        shape_by_name(config.model_name),
        gpu=gpu,
        seq=config.max_seq_length,
        batch=config.batch_size,
        mode="qlora" if config.load_in_4bit else "lora",
        rank=rank,
        target_batch=config.batch_size * config.grad_accum,
    )


@pytest.mark.parametrize("gpu", GPUS)
@pytest.mark.parametrize("model", sorted(model_data()))
def test_settings_are_the_planners_at_the_highest_rank_that_fits(model, gpu):
    config = _defaults(model)
    ranks = [config.lora_r >> k for k in range(8) if config.lora_r >> k >= LOWEST_RANK]
    fitting = [rank for rank in ranks if _planned(config, rank, gpu).fits]
    if not fitting:
        with pytest.raises(RuntimeError, match=f"{model} does not fit this GPU") as refusal:
            settings_that_fit(config, shape_by_name(model), gpu)
        elsewhere = [name for name in GPUS if _planned(config, ranks[-1], name).fits]
        assert f"It fits: {', '.join(elsewhere)}" in str(refusal.value)
        return
    chosen, result = settings_that_fit(config, shape_by_name(model), gpu)
    reference = _planned(config, fitting[0], gpu)
    assert (chosen.lora_r, chosen.batch_size, chosen.grad_accum, chosen.max_seq_length) == (
        fitting[0],
        reference.batch,
        reference.grad_accum,
        reference.seq,
    )
    assert chosen.lora_alpha / chosen.lora_r == config.lora_alpha / config.lora_r  # the adapters' scale
    assert result.total_gib == reference.total_gib and result.fits
    if fitting[0] != config.lora_r:
        assert result.notes[0].startswith(f"LoRA rank lowered from {config.lora_r} to {fitting[0]}")


def test_where_each_notebook_says_its_defaults_fit():
    """The dense notebooks fit a T4 as set (Qwen3.5 and Gemma 4 say more after that); Qwen3-30B-A3B
    and gpt-oss-20b do not, and say so (refused there, with the GPUs that fit); on an L4
    Qwen3-30B-A3B trains at rank 4. A notebook that writes no GGUF says why."""
    fit = {model: data["gpu_fit"] for model, data in model_data().items()}
    moe = {"qwen3-30b-a3b", "gpt-oss-20b"}
    for model in set(fit) - moe:
        assert fit[model].startswith("The defaults fit a free Colab or Kaggle T4 (15 GB)."), model
        chosen, _ = settings_that_fit(_defaults(model), shape_by_name(model), "t4")
        assert chosen.lora_r == 16, model
    for model, data in model_data().items():
        assert data["save_gguf"] or "SAVE_GGUF is off" in fit[model], model
    for model in moe:
        assert "more than a free T4's 15 GB, where the hardware cell stops and says so" in fit[model]
        with pytest.raises(RuntimeError, match="It fits: l4, a100, a100-80"):
            settings_that_fit(_defaults(model), shape_by_name(model), "t4")
    ranks = {
        (model, gpu): settings_that_fit(_defaults(model), shape_by_name(model), gpu)[0].lora_r
        for model in moe
        for gpu in ("l4", "a100")
    }
    assert ranks == {
        ("qwen3-30b-a3b", "l4"): 4,
        ("qwen3-30b-a3b", "a100"): 16,
        ("gpt-oss-20b", "l4"): 16,
        ("gpt-oss-20b", "a100"): 16,
    }
    assert "with the LoRA rank lowered to fit (4, from 16" in fit["qwen3-30b-a3b"]
    # 16 bits: an 80 GB A100 fits Qwen3-30B-A3B, a 40 GB one refuses it
    sixteen = _defaults("qwen3-30b-a3b", load_in_4bit=False)
    assert settings_that_fit(sixteen, shape_by_name("qwen3-30b-a3b"), "a100-80")[0].lora_r == 16
    with pytest.raises(RuntimeError, match="the weights alone do not fit"):
        settings_that_fit(sixteen, shape_by_name("qwen3-30b-a3b"), "a100")


@pytest.mark.skipif(torch.cuda.is_available(), reason="gpu='auto' plans for this machine's GPU")
def test_without_a_gpu_nothing_changes():
    config = dataclasses.replace(_defaults("llama-3-8b"), lora_r=32, lora_alpha=64)
    chosen, result = settings_that_fit(config, shape_by_name("llama-3-8b"), "auto")
    assert result.fits is None and chosen == config


@pytest.mark.parametrize("family", ["gemma3", "qwen2_5_vl", "mllama"])
def test_an_image_text_checkpoint_is_planned_from_its_language_model(family):
    """The hardware cell plans an image-text checkpoint (the vision notebooks') from its text
    config, whose sizes the top-level config does not hold."""
    from transformers import AutoConfig

    from slothkit.notebook.hardware import language_shape
    from slothkit.testing.tiny_image_text import tiny_image_text_path

    path = tiny_image_text_path(family)
    text = AutoConfig.from_pretrained(path).get_text_config()
    shape = language_shape(str(path))
    assert (shape.hidden_size, shape.intermediate_size, shape.num_hidden_layers, shape.vocab_size) == (
        text.hidden_size,
        text.intermediate_size,
        text.num_hidden_layers,
        text.vocab_size,
    )
    assert shape.model_type == text.model_type != AutoConfig.from_pretrained(path).model_type
