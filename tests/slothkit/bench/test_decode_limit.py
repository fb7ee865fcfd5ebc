"""The decode bandwidth limit `slothkit bench generate` reports: the bytes a run reads at
the least, against counts made by hand on tiny models (fresh random weights each time)."""

import pytest
import torch

from slothkit.bench.decode_limit import (
    bytes_read,
    datasheet_bandwidth,
    kv_bytes_per_position,
    limit_tokens_per_s,
    weight_bytes,
)
from slothkit.bench.model_setup import build_model


def _bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _tiny(arch: str):
    return build_model(f"tiny-{arch}", torch.float32, "cpu", seed=int(torch.randint(0, 2**31, ())))


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma"])
def test_weight_bytes_count_every_weight_once_and_the_embedding_only_as_the_head(arch):
    model = _tiny(arch)
    embedding = model.get_input_embeddings().weight
    tied = model.get_output_embeddings().weight is embedding
    by_hand = sum(_bytes(p) for name, p in model.named_parameters() if p is not embedding)  # unique names
    expected = by_hand + (_bytes(embedding) if tied else 0)
    assert weight_bytes(model) == expected
    assert weight_bytes(model.to(torch.bfloat16)) * 2 == expected


def test_weight_bytes_count_lora_adapters_and_four_bit_scales():
    from peft import LoraConfig, get_peft_model

    model = _tiny("llama")
    base = weight_bytes(model)
    adapted = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    adapters = sum(_bytes(p) for name, p in adapted.named_parameters() if "lora_" in name)
    assert adapters > 0 and weight_bytes(adapted) == base + adapters

    class State:
        absmax = torch.zeros(32, dtype=torch.float32)
        code = torch.zeros(16, dtype=torch.float32)
        state2 = None

    layer = torch.nn.Linear(64, 64)
    packed = torch.nn.Parameter(torch.zeros(64 * 64 // 2, 1, dtype=torch.uint8), requires_grad=False)
    packed.quant_state = State()
    layer.weight = packed
    wrapper = torch.nn.Module()
    wrapper.embed, wrapper.layer = torch.nn.Embedding(10, 64), layer
    wrapper.get_input_embeddings = lambda: wrapper.embed
    wrapper.get_output_embeddings = lambda: None
    assert weight_bytes(wrapper) == 64 * 64 // 2 + 32 * 4 + 16 * 4 + 64 * 4  # packed, scales, code book, bias


def test_keys_and_values_per_position_follow_grouped_heads_and_windows():
    config = _tiny("qwen3").config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    layers = kv_bytes_per_position(config, torch.bfloat16)
    assert layers == [(2 * config.num_key_value_heads * head_dim * 2, None)] * config.num_hidden_layers

    config.layer_types = ["sliding_attention", "full_attention"] * (config.num_hidden_layers // 2)
    config.sliding_window = 5
    windows = [window for _, window in kv_bytes_per_position(config, torch.float32)]
    assert windows[:2] == [5, None]


def test_bytes_read_and_the_limit_match_a_step_by_step_count():
    weights, batch, prompt, new = int(torch.randint(1000, 5000, ())), 3, 7, 6
    layers = [(40, None), (40, 8)]
    by_step = new * weights  # the prefill and new - 1 decode steps each read every weight
    for step in range(1, new):
        by_step += batch * (40 * (prompt + step) + 40 * min(prompt + step, 8))
    assert bytes_read(weights, layers, batch, prompt, new) == by_step
    # 16 GB read once per token at 4.8 TB/s: 300 tokens/s (the Llama-3-8B batch-1 figure).
    assert limit_tokens_per_s(16e9 * 128, 1, 128, 4800.0) == pytest.approx(300.0)


@pytest.mark.parametrize(
    "name, gb_per_s",
    [
        ("NVIDIA H200", 4800.0),
        ("NVIDIA H100 80GB HBM3", 3350.0),
        ("NVIDIA H100 PCIe", 2000.0),
        ("NVIDIA A100-SXM4-80GB", 2039.0),
        ("NVIDIA A100-SXM4-40GB", 1555.0),
        ("Tesla T4", 320.0),
        ("NVIDIA L4", 300.0),
        ("NVIDIA L40S", 864.0),
        ("Tesla P100-PCIE-16GB", 732.0),
        ("Some Future GPU", None),
    ],
)
def test_datasheet_bandwidth_by_the_name_torch_reports(name, gb_per_s):
    assert datasheet_bandwidth(name) == gb_per_s


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_weight_bytes_count_the_experts_a_step_chooses(batch):
    """Qwen3-MoE, each token choosing 2 of 8 experts: the experts' 3-D weights count at
    1 - (1 - k/E)^batch of their bytes (the expected share a step reads), the rest whole."""
    model = build_model("tiny-qwen3-moe", torch.float32, "cpu", seed=int(torch.randint(0, 2**31, ())))
    config = model.config
    experts, top_k = config.num_experts, config.num_experts_per_tok
    assert top_k < experts
    embedding = model.get_input_embeddings().weight
    expert_bytes = sum(_bytes(p) for name, p in model.named_parameters() if ".experts." in name)
    other = sum(_bytes(p) for name, p in model.named_parameters() if ".experts." not in name)
    other -= _bytes(embedding)
    share = 1 - (1 - top_k / experts) ** batch
    assert expert_bytes > 0
    assert weight_bytes(model, batch) == round(other + share * expert_bytes)
