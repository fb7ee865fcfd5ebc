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

# Mllama (Llama 3.2 Vision) has two vision encoders (a local one and a gated global one)
# and, among the language model's layers, cross-attention layers (the tiny one's layer 1)
# whose attention is cross_attn: every path written out.
_QKVO = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLLAMA_VISION_LAYERS = [("transformer", 0), ("transformer", 1), ("global_transformer", 0)]
MLLAMA_LAYERS = {
    ("vision", "attention"): {
        f"model.vision_model.{stack}.layers.{i}.self_attn.{leaf}"
        for stack, i in _MLLAMA_VISION_LAYERS
        for leaf in _QKVO
    },
    ("vision", "mlp"): {
        f"model.vision_model.{stack}.layers.{i}.mlp.{leaf}"
        for stack, i in _MLLAMA_VISION_LAYERS
        for leaf in ("fc1", "fc2")
    },
    ("language", "attention"): {
        f"model.language_model.layers.{i}.{block}.{leaf}"
        for i, block in ((0, "self_attn"), (1, "cross_attn"), (2, "self_attn"))
        for leaf in _QKVO
    },
    ("language", "mlp"): {
        f"model.language_model.layers.{i}.mlp.{leaf}"
        for i in range(3)
        for leaf in ("gate_proj", "up_proj", "down_proj")
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
    if family == "mllama":
        for (part, block), paths in MLLAMA_LAYERS.items():
            if (part == "vision" and vision or part == "language" and language) and (
                block == "attention" and attention or block == "mlp" and mlp
            ):
                names |= paths
        return names
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


@pytest.mark.parametrize("family", ["gemma3", "qwen2_5_vl", "mllama"])
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


# Where each family keeps its vision tower and its projector (Gemma 3's projector is a bare
# weight, Qwen-VL's merger sits inside the tower, Mllama's is one linear layer).
SIXTEEN_BIT_PARTS = (
    "model.vision_tower.",
    "model.visual.",
    "model.vision_model.",
    "model.multi_modal_projector",
)


@pytest.mark.parametrize("family", ["gemma3", "qwen2_5_vl", "mllama"])
def test_4bit_keeps_the_vision_tower_and_projector_16bit(family):
    pytest.importorskip("bitsandbytes")
    model, _ = _load(family, load_in_4bit=True)
    kinds: dict[str, set[str]] = {"vision": set(), "lm_head": set(), "language": set()}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            part = (
                "vision"
                if name.startswith(SIXTEEN_BIT_PARTS)
                else "lm_head"
                if name == "lm_head"
                else "language"
            )
            kinds[part].add(type(module).__name__)
    assert kinds == {"vision": {"Linear"}, "lm_head": {"Linear"}, "language": {"Linear4bit"}}
    vision_weights = [p for n, p in model.named_parameters() if n.startswith(SIXTEEN_BIT_PARTS)]
    assert vision_weights and all(p.dtype == torch.float32 for p in vision_weights)


def _chat_batch(processor, seed):
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


@pytest.mark.parametrize(
    ("family", "fused"),
    [("gemma3", False), ("gemma3", True), ("mllama", False)],
    ids=["gemma3-hf-layers", "gemma3-fused-language", "mllama-hf-layers"],
)
@pytest.mark.parametrize("checkpointing", ["offload", True])
def test_checkpointing_both_towers_gives_the_gradients_of_none(family, checkpointing, fused, request):
    if fused:  # the fused layers checkpoint themselves; the kernels' torch references run them
        request.getfixturevalue("reference_kernels")
    batches = []
    for mode in (False, checkpointing):
        model, processor = _load(family, fused=fused)
        model = FastVisionModel.get_peft_model(model, r=4, use_gradient_checkpointing=mode)
        batch = _chat_batch(processor, seed=1)
        # Every token but Mllama's <|image|>, whose id is past its head's rows.
        labels = batch["input_ids"].masked_fill(batch["input_ids"] >= model.lm_head.out_features, -100)
        loss = model(**batch, labels=labels).loss
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        batches.append((loss.detach(), grads))
    (loss, grads), (checkpointed_loss, checkpointed_grads) = batches
    torch.testing.assert_close(checkpointed_loss, loss, rtol=0, atol=1e-6)
    assert grads.keys() == checkpointed_grads.keys()
    tower = "vision_model" if family == "mllama" else "vision_tower"
    assert any(tower in n and "lora_B" in n and g.abs().sum() > 0 for n, g in grads.items())
    for name, grad in grads.items():
        torch.testing.assert_close(checkpointed_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def _vision_tower_saves(mode) -> int:
    """The number of tensors Mllama's adapted vision tower keeps for its backward in one
    training forward, under use_gradient_checkpointing=`mode`."""
    from slothkit.testing.image_text_parity import random_batch

    model, _ = _load("mllama")
    model = FastVisionModel.get_peft_model(model, r=4, use_gradient_checkpointing=mode)
    batch = random_batch("mllama", seed=2)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        model.base_model.model.model.vision_model(
            pixel_values=batch["pixel_values"],
            aspect_ratio_ids=batch["aspect_ratio_ids"],
            aspect_ratio_mask=batch["aspect_ratio_mask"],
        )
    return len(saved)


def test_mllamas_plain_vision_layers_are_checkpointed_too():
    """transformers gives Mllama's vision encoder layers no checkpointing hooks; slothkit
    wraps them, so that each keeps its input and little else (the gradients are checked
    equal above)."""
    layers = 3  # the tiny tower's: two local, one global
    kept, checkpointed = _vision_tower_saves(False), _vision_tower_saves(True)
    assert checkpointed < kept - 10 * layers, (checkpointed, kept)


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
    batch = _chat_batch(processor, seed=3)
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**batch).logits, model(**batch).logits, rtol=0, atol=1e-6)


def test_a_saved_adapter_folder_reloads_with_its_base_and_processor(tmp_path):
    """FastVisionModel.from_pretrained on a folder holding a saved adapter (Unsloth's
    notebooks reload "lora_model" so): the base its adapter_config.json names, the adapter
    on it trainable, the folder's processor; the same logits as the model that was saved."""
    from peft import PeftModel

    model, processor = _load("mllama")
    model = FastVisionModel.get_peft_model(model, r=4)
    with torch.no_grad():  # adapters away from B = 0, so that a lost one shows
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    folder = tmp_path / "lora_model"
    model.save_pretrained(str(folder))
    processor.chat_template = processor.chat_template.replace("user", "patient")  # as trained with
    processor.save_pretrained(str(folder))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reloaded, reloaded_processor = FastVisionModel.from_pretrained(
            str(folder), load_in_4bit=False, dtype=torch.float32, max_seq_length=128
        )
    assert isinstance(reloaded, PeftModel) and reloaded.training
    assert reloaded_processor.chat_template == processor.chat_template
    trainable = {n for n, p in reloaded.named_parameters() if p.requires_grad}
    assert trainable == {n for n, p in model.named_parameters() if p.requires_grad} and trainable
    from slothkit.testing.image_text_parity import random_batch

    batch = random_batch("mllama", seed=5)
    batch.pop("labels")
    model.eval(), reloaded.eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**batch).logits, model(**batch).logits, rtol=0, atol=1e-6)
