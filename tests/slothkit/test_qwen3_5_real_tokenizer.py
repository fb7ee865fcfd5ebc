"""Qwen3.5 with its real tokenizer (248,077 ids, slothkit.testing's qwen3.5-tokenizer) around
a tiny random model of the real vocabulary's 248,320 rows: a chat in Qwen3.5's format, its
prompt masked, through FastModel gives HF + PEFT's loss and LoRA gradients (the loss over
the whole vocabulary in slothkit's fused cross-entropy)."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from slothkit import FastModel
from slothkit.core.model_state import patched_module
from slothkit.data import get_chat_template
from slothkit.testing.tiny_generic_models import tiny_generic_model_path

VOCAB_ROWS = 248320  # Qwen3.5's embedding rows: 243 more than the tokenizer's ids
CHAT = [
    {"role": "user", "content": "烤一个500克的面包要多久？ And at 230 °C?"},
    {"role": "assistant", "content": "About 35 minutes, until it sounds hollow. 🍞"},
]


@pytest.fixture(scope="module")
def checkpoint(qwen3_5_tokenizer_path, tmp_path_factory):
    config = AutoConfig.from_pretrained(tiny_generic_model_path("qwen3_5_text"))
    config.vocab_size = VOCAB_ROWS
    config.bos_token_id, config.eos_token_id, config.pad_token_id = None, 248046, 248044
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path = tmp_path_factory.mktemp("qwen3.5-real-vocab")
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(qwen3_5_tokenizer_path).save_pretrained(path)
    return path


def _chat_batch(tokenizer):
    """The chat's ids, with labels on the assistant's answer only."""
    prompt = tokenizer.apply_chat_template(CHAT[:1], tokenize=False, add_generation_prompt=True)
    text = tokenizer.apply_chat_template(CHAT, tokenize=False)
    assert text.startswith(prompt) and text.count("<|im_start|>") == 2
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    labels = ids.clone()
    labels[:, : len(tokenizer(prompt)["input_ids"])] = -100
    assert (ids > 200000).any()  # ids past Qwen2.5's vocabulary: the added tokens at 248,044 on
    return ids, labels


def test_a_chat_in_the_real_vocabulary_trains_as_hf_peft(checkpoint):
    from peft import LoraConfig, get_peft_model

    model, tokenizer = FastModel.from_pretrained(
        str(checkpoint), dtype=torch.float32, load_in_4bit=False, fused=True
    )
    assert len(tokenizer) == 248077
    get_chat_template(tokenizer, "qwen3.5")
    fast = FastModel.get_peft_model(model, r=8, lora_alpha=16, use_gradient_checkpointing=False)
    assert patched_module(fast.get_base_model()) is not None  # the head's loss is slothkit's
    targets = sorted(
        {name.split(".lora_A.")[0].split(".")[-1] for name, _ in fast.named_parameters() if "lora_A" in name}
    )
    assert {"q_proj", "in_proj_qkv", "out_proj", "gate_proj"} <= set(targets)
    plain = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, task_type="CAUSAL_LM", target_modules=targets)
    plain = get_peft_model(plain, config).train()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # the same adapters, B non-zero so that A has a gradient
        for (name, ours), (other, theirs) in zip(
            sorted(fast.named_parameters()), sorted(plain.named_parameters())
        ):
            assert name == other
            if "lora_B" in name:
                ours.copy_(torch.randn(ours.shape, generator=generator) * 0.05)
            if "lora_" in name:
                theirs.copy_(ours)
    ids, labels = _chat_batch(tokenizer)
    losses = []
    for model_ in (fast, plain):
        loss = model_(input_ids=ids, labels=labels).loss
        loss.backward()
        losses.append(loss.item())
    assert losses[1] > 10  # about log(248,320): the model is random
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    theirs = dict(plain.named_parameters())
    for name, ours in fast.named_parameters():
        if "lora_" in name:
            torch.testing.assert_close(ours.grad, theirs[name].grad, rtol=1e-4, atol=1e-7, msg=name)
