"""FastVisionModel on the tiny image-text checkpoints: the whole model and its processor,
NF4 with the vision tower 16-bit, LoRA targets by part and block, checkpointing on both
towers giving the numbers of none, and the training/inference switch."""

import os
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from slothkit import FastVisionModel
from slothkit.loading.load_model import LoadOptions
from slothkit.loading.vision_model import load_vision_model
from slothkit.testing import tiny_model_path
from slothkit.testing.tiny_image_text import image_text_processor_loads, tiny_image_text_path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Where each tiny family keeps its layers, and what they are named: the expectations the
# flags are checked against, written out rather than derived from slothkit's reading.
LAYERS = {
    "gemma3": {
        ("vision", "attention"): (
            "model.vision_tower.encoder.layers.",
            ("q_proj", "k_proj", "v_proj", "out_proj"),
        ),
        ("vision", "mlp"): ("model.vision_tower.encoder.layers.", ("fc1", "fc2")),
        ("language", "attention"): ("model.language_model.layers.", ("q_proj", "k_proj", "v_proj", "o_proj")),
        ("language", "mlp"): ("model.language_model.layers.", ("gate_proj", "up_proj", "down_proj")),
    },
    "qwen2_5_vl": {
        ("vision", "attention"): ("model.visual.blocks.", ("qkv", "proj")),
        ("vision", "mlp"): ("model.visual.blocks.", ("gate_proj", "up_proj", "down_proj")),
        ("language", "attention"): ("model.language_model.layers.", ("q_proj", "k_proj", "v_proj", "o_proj")),
        ("language", "mlp"): ("model.language_model.layers.", ("gate_proj", "up_proj", "down_proj")),
    },
}


def _load(family, load_in_4bit=False, fused=False):
    """The model and processor, the language model on HF's layers unless `fused` (its
    fused path: tests/slothkit/test_vision_training.py)."""
    path = str(tiny_image_text_path(family))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if image_text_processor_loads(family) is None:
            return FastVisionModel.from_pretrained(
                path, load_in_4bit=load_in_4bit, dtype=torch.float32, max_seq_length=128, fused=fused
            )
        # Qwen-VL's processor needs torchvision; the model loads without it.
        options = LoadOptions(load_in_4bit=load_in_4bit, dtype=torch.float32, max_seq_length=128, fused=fused)
        return load_vision_model(path, options), None


def _adapted(model) -> set[str]:
    return {
        name.removeprefix("base_model.model.")
        for name, module in model.named_modules()
        if hasattr(module, "lora_A") and len(module.lora_A)
    }


def _expected(family, flags) -> set[str]:
    vision, language, attention, mlp = flags
    names = set()
    for (part, block), (stem, leaves) in LAYERS[family].items():
        if (part == "vision" and vision or part == "language" and language) and (
            block == "attention" and attention or block == "mlp" and mlp
        ):
            names |= _paths(family, stem, block, leaves)
    return names


def _paths(family, stem, block, leaves) -> set[str]:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_image_text_path(family))
    if "language_model" in stem:
        count, block_name = (
            config.text_config.num_hidden_layers,
            "self_attn" if block == "attention" else "mlp",
        )
    elif family == "gemma3":
        count, block_name = (
            config.vision_config.num_hidden_layers,
            "self_attn" if block == "attention" else "mlp",
        )
    else:
        count, block_name = config.vision_config.depth, "attn" if block == "attention" else "mlp"
    return {f"{stem}{i}.{block_name}.{leaf}" for i in range(count) for leaf in leaves}


@pytest.mark.parametrize("family", ["gemma3", "qwen2_5_vl"])
@pytest.mark.parametrize(
    "flags",
    [
        (True, True, True, True),
        (False, True, True, True),
        (True, False, True, False),
        (True, True, False, True),
    ],
)
def test_the_flags_pick_the_layers_of_their_parts_and_blocks(family, flags):
    model, _ = _load(family)
    vision, language, attention, mlp = flags
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = FastVisionModel.get_peft_model(
            model, finetune_vision_layers=vision, finetune_language_layers=language,
            finetune_attention_modules=attention, finetune_mlp_modules=mlp, r=4,
        )  # fmt: skip
    assert _adapted(model) == _expected(family, flags)
    said = [str(w.message) for w in caught if "linear layers of this image-text model" in str(w.message)]
    assert len(said) <= 1  # said once per process
    assert not any("projector" in name or "merger" in name or "lm_head" in name for name in _adapted(model))


def test_flags_that_leave_nothing_are_refused():
    model, _ = _load("gemma3")
    with pytest.raises(ValueError, match="finetune_vision_layers=False and finetune_language_layers=False"):
        FastVisionModel.get_peft_model(model, finetune_vision_layers=False, finetune_language_layers=False)
    with pytest.raises(ValueError, match="finetune_attention_modules=False and finetune_mlp_modules=False"):
        FastVisionModel.get_peft_model(model, finetune_attention_modules=False, finetune_mlp_modules=False)


def test_a_text_checkpoint_is_refused_naming_fastmodel():
    with pytest.raises(ValueError, match="without a vision tower.*FastModel"):
        FastVisionModel.from_pretrained(str(tiny_model_path("gemma3")), load_in_4bit=False)


def test_returns_the_whole_model_and_its_processor():
    model, processor = _load("gemma3")
    assert type(model).__name__ == "Gemma3ForConditionalGeneration"
    assert type(processor).__name__ == "Gemma3Processor"
    assert processor.tokenizer.padding_side == "right" and processor.tokenizer.pad_token is not None
    assert model.max_seq_length == 128


@pytest.mark.parametrize("family", ["gemma3", "qwen2_5_vl"])
def test_4bit_keeps_the_vision_tower_and_projector_16bit(family):
    pytest.importorskip("bitsandbytes")
    model, _ = _load(family, load_in_4bit=True)
    kinds: dict[str, set[str]] = {"vision": set(), "lm_head": set(), "language": set()}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            part = (
                "vision"
                if "vision_tower" in name or "visual" in name
                else "lm_head"
                if name == "lm_head"
                else "language"
            )
            kinds[part].add(type(module).__name__)
    assert kinds == {"vision": {"Linear"}, "lm_head": {"Linear"}, "language": {"Linear4bit"}}
    vision_weights = [p for n, p in model.named_parameters() if "vision_tower" in n or "visual" in n]
    assert vision_weights and all(p.dtype == torch.float32 for p in vision_weights)


def _gemma3_batch(processor, seed):
    from PIL import Image

    rng = np.random.RandomState(seed)
    image = Image.fromarray(rng.randint(0, 255, (40, 30, 3), dtype=np.uint8))
    messages = [
        {
            "role": "user",
            "content": [{"type": "image"}, {"type": "text", "text": "What is in this picture?"}],
        },
        {"role": "assistant", "content": [{"type": "text", "text": "Colours at random."}]},
    ]
    text = processor.apply_chat_template(messages, tokenize=False)
    return processor(text=[text], images=[[image]], return_tensors="pt", add_special_tokens=False)


@pytest.mark.parametrize("fused", [False, True], ids=["hf-layers", "fused-language"])
@pytest.mark.parametrize("checkpointing", ["offload", True])
def test_checkpointing_both_towers_gives_the_gradients_of_none(checkpointing, fused, request):
    if fused:  # the fused layers checkpoint themselves; the kernels' torch references run them
        request.getfixturevalue("reference_kernels")
    batches = []
    for mode in (False, checkpointing):
        model, processor = _load("gemma3", fused=fused)
        model = FastVisionModel.get_peft_model(model, r=4, use_gradient_checkpointing=mode)
        batch = _gemma3_batch(processor, seed=1)
        loss = model(**batch, labels=batch["input_ids"]).loss
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        batches.append((loss.detach(), grads))
    (loss, grads), (checkpointed_loss, checkpointed_grads) = batches
    torch.testing.assert_close(checkpointed_loss, loss, rtol=0, atol=1e-6)
    assert grads.keys() == checkpointed_grads.keys()
    assert any("vision_tower" in n and "lora_B" in n and g.abs().sum() > 0 for n, g in grads.items())
    for name, grad in grads.items():
        torch.testing.assert_close(checkpointed_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_for_inference_and_for_training_switch_the_processors_padding_and_cache():
    model, processor = _load("gemma3")
    model = FastVisionModel.get_peft_model(model, r=4)
    FastVisionModel.for_inference(model)
    assert processor.tokenizer.padding_side == "left"
    assert not model.training and model.config.get_text_config().use_cache
    FastVisionModel.for_training(model)
    assert processor.tokenizer.padding_side == "right"
    assert model.training and not model.config.get_text_config().use_cache


def test_without_torchvision_a_qwen_vl_processor_is_refused_naming_it():
    if image_text_processor_loads("qwen2_5_vl") is None:
        pytest.skip("transformers builds Qwen-VL processors here (torchvision is installed)")
    with pytest.raises(ImportError, match="pip install torchvision"):
        FastVisionModel.from_pretrained(str(tiny_image_text_path("qwen2_5_vl")), load_in_4bit=False)


def test_the_adapter_reloads_in_plain_peft_with_the_same_logits(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    model, processor = _load("gemma3")
    model = FastVisionModel.get_peft_model(model, r=4)
    with torch.no_grad():  # adapters away from B = 0, so that a lost one shows
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    model.save_pretrained(str(tmp_path / "adapter"))
    base = AutoModelForImageTextToText.from_pretrained(tiny_image_text_path("gemma3"), dtype=torch.float32)
    reloaded = PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    batch = _gemma3_batch(processor, seed=3)
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**batch).logits, model(**batch).logits, rtol=0, atol=1e-6)
