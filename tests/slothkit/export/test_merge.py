"""Merging LoRA into the base weights: the merged checkpoint computes what the LoRA model computes.

Every comparison is in fp32 on the tiny offline models, with lora_B set to random values
(PEFT's zero init would make any merge look right). "Same logits" means a relative error
(max |diff| / max |logit|) below 1e-4; each test also checks that the adapter moves the
logits far more than that, so dropping or mis-scaling it fails.  A merged_16bit checkpoint
holds the fp32 merge rounded once to 16 bits (assert_merged_16bit in conftest.py checks
both: the merge's logits in fp32, and the stored tensors bit for bit).
"""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from slothkit.export import merged_state_dict, save_pretrained_merged
from slothkit.export.merge import choose_merge_source
from slothkit.models import architecture_named
from slothkit.testing import FUSED_FAMILIES

ARCHS = FUSED_FAMILIES
SAME = 1e-4


def _plain_base(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("arch", ARCHS)
def test_merged_16bit_gives_the_lora_models_logits(
    arch, make_lora_model, input_ids, logits, relative_error, assert_merged_16bit, tmp_path
):
    model, tokenizer, path = make_lora_model(arch)
    expected = logits(model, input_ids)
    assert relative_error(logits(_plain_base(path), input_ids), expected) > 100 * SAME  # the adapter matters

    result = save_pretrained_merged(model, tmp_path / "merged", tokenizer, save_method="merged_16bit")
    assert result.merge_source == "16bit"

    config = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["use_cache"] is True  # training switched it off; inference wants it on
    assert config["dtype"] == "bfloat16"  # a model held in float32: bfloat16
    assert_merged_16bit(tmp_path / "merged", model, tokenizer, expected)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")  # plain transformers
    if architecture_named(arch).tied_embeddings:  # nothing touched the embeddings: still tied, stored once
        assert config["tie_word_embeddings"] is True and not result.ties_broken
        assert merged.lm_head.weight.data_ptr() == merged.model.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize("arch", ARCHS)
def test_merge_from_4bit_uses_the_dequantized_weights(
    arch, make_lora_model, input_ids, logits, assert_merged_16bit, tmp_path
):
    # Merged into the dequantised NF4 weights, the checkpoint holds exactly the W the 4-bit
    # LoRA model computes with, so it reproduces that model to fp32 rounding.
    model, tokenizer, _ = make_lora_model(arch, load_in_4bit=True, seed=1)
    expected = logits(model, input_ids)

    result = save_pretrained_merged(model, tmp_path / "m", tokenizer, base_weights=None)
    assert result.merge_source == "dequantized_4bit"
    assert "dequantised 4-bit" in result.merged_into
    assert "dequantised 4-bit" in (tmp_path / "m" / "README.md").read_text()
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert "quantization_config" not in config
    assert_merged_16bit(tmp_path / "m", model, tokenizer, expected, base_weights=None)


@pytest.mark.parametrize("arch", ["llama", "gemma"])
def test_merge_from_4bit_into_the_original_checkpoint(
    arch, make_lora_model, input_ids, logits, relative_error, assert_merged_16bit, tmp_path
):
    # The adapter's base_model_name_or_path is the local fp32 checkpoint, so "auto" merges into
    # it: the result is the fp32 base with the adapter on top, with no NF4 error in W.
    model, tokenizer, path = make_lora_model(arch, load_in_4bit=True, seed=2)
    assert choose_merge_source(model, "auto").kind == "original_checkpoint"
    assert choose_merge_source(model, str(path)).checkpoint == path

    result = save_pretrained_merged(model, tmp_path / "m", tokenizer)  # base_weights="auto"
    assert result.merge_source == "original_checkpoint"
    assert str(path) in result.merged_into and str(path) in (tmp_path / "m" / "README.md").read_text()

    save_pretrained_merged(model, tmp_path / "adapter", tokenizer, save_method="lora")
    from peft import PeftModel

    reference = PeftModel.from_pretrained(_plain_base(path), tmp_path / "adapter").eval()
    merged = assert_merged_16bit(tmp_path / "m", model, tokenizer, logits(reference, input_ids))
    merged_logits = logits(merged, input_ids)

    # Against the 4-bit LoRA model the only difference is NF4's error in the base weights:
    # documented tolerance = twice the gap between the fp32 and the NF4 *base* models.
    from slothkit import FastModel

    base_4bit, _ = FastModel.from_pretrained(str(path), load_in_4bit=True, dtype=torch.float32)
    quantization_gap = relative_error(logits(base_4bit, input_ids), logits(_plain_base(path), input_ids))
    assert relative_error(merged_logits, logits(model, input_ids)) < 2 * quantization_gap


def test_rslora_scaling_and_embedding_lora(make_lora_model, input_ids, logits, assert_merged_16bit, tmp_path):
    # rsLoRA scales by alpha / sqrt(r) (= 4 here, not alpha / r = 2); LoRA on the embedding
    # stores A as (r, vocab) and B as (dim, r), so its delta is transposed.
    targets = ["q_proj", "v_proj", "down_proj", "embed_tokens"]
    model, tokenizer, _ = make_lora_model(
        "llama", use_rslora=True, target_modules=targets, seed=3, peft_directly=True
    )
    q_proj = model.base_model.model.model.layers[0].self_attn.q_proj
    assert q_proj.scaling["default"] == pytest.approx(8 / 4**0.5)

    state, report = merged_state_dict(model)
    assert "model.embed_tokens" in report.merged_layers and len(report.merged_layers) == 1 + 3 * 2
    assert not any("lora" in name or "base_layer" in name for name in state)

    save_pretrained_merged(model, tmp_path / "m", tokenizer)
    assert_merged_16bit(tmp_path / "m", model, tokenizer, logits(model, input_ids))


def test_gemma_trained_lm_head_unties_the_embeddings(
    make_lora_model, input_ids, logits, assert_merged_16bit, tmp_path
):
    # Gemma ties lm_head to the embeddings. A trained lm_head (modules_to_save) differs from
    # them, so the merged checkpoint must store both and say tie_word_embeddings=False.
    model, tokenizer, _ = make_lora_model("gemma", modules_to_save=["lm_head"], seed=4)
    head = model.base_model.model.lm_head.modules_to_save["default"]
    with torch.no_grad():
        noise = torch.randn(head.weight.shape, generator=torch.Generator().manual_seed(5)) * 0.02
        head.weight.add_(noise.to(head.weight.device))
    expected = logits(model, input_ids)

    result = save_pretrained_merged(model, tmp_path / "m", tokenizer)
    assert result.ties_broken
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    assert "untied" in (tmp_path / "m" / "README.md").read_text()
    merged = assert_merged_16bit(tmp_path / "m", model, tokenizer, expected)
    assert torch.equal(merged.lm_head.weight, head.weight.cpu())


def test_merge_sums_in_fp32_and_rounds_once(make_lora_model):
    # bf16 base: W' must be round_bf16(W + s * B @ A) with the sum in fp32. Rounding the delta
    # to bf16 first (as a bf16 merge would) gives a different tensor.
    model, _, _ = make_lora_model("mistral", dtype=torch.bfloat16, seed=6)
    layer = model.base_model.model.model.layers[1].mlp.down_proj
    state, _ = merged_state_dict(model)
    merged = state["model.layers.1.mlp.down_proj.weight"]
    assert merged.dtype == torch.bfloat16

    weight = layer.base_layer.weight.float()
    delta = (
        layer.lora_B["default"].weight.float()
        @ layer.lora_A["default"].weight.float()
        * layer.scaling["default"]
    )
    assert torch.equal(merged, (weight + delta).to(torch.bfloat16))
    rounded_twice = (layer.base_layer.weight + delta.to(torch.bfloat16)).to(torch.bfloat16)
    assert not torch.equal(merged, rounded_twice)


def test_base_weights_must_be_an_unquantized_checkpoint(make_lora_model, tmp_path):
    model, _, _ = make_lora_model("llama", load_in_4bit=True)
    with pytest.raises(FileNotFoundError, match="not a directory"):
        choose_merge_source(model, tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="not an unquantised safetensors checkpoint"):
        choose_merge_source(model, tmp_path / "empty")
    assert choose_merge_source(model, None).kind == "dequantized_4bit"


@pytest.mark.parametrize(
    "model_type, sizes",
    [
        ("qwen3_moe", dict(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, head_dim=16)),
        ("gpt_oss", dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16, sliding_window=8)),
    ],
)
def test_moe_experts_merge_each_experts_update_into_its_parameter(
    model_type, sizes, input_ids, logits, relative_error, assert_merged_16bit, tmp_path
):
    """LoRA on the experts' 3-D parameters (PEFT's target_parameters, two wrappers nested
    on one experts module) merges into those parameters, each expert its own update, in
    both layouts ((experts, out, in) in Qwen3-MoE, (experts, in, out) in gpt-oss)."""
    from transformers import AutoConfig

    from slothkit import FastModel
    from slothkit.testing import build_tiny_tokenizer

    from .conftest import randomize_lora_b

    config = AutoConfig.for_model(
        model_type, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=768, pad_token_id=0, **sizes,
    )  # fmt: skip
    torch.manual_seed(0)
    path = tmp_path / model_type
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    build_tiny_tokenizer("bpe", path)
    model, tokenizer = FastModel.from_pretrained(str(path), dtype=torch.float32, load_in_4bit=False)
    model = FastModel.get_peft_model(model, r=4, lora_alpha=8, use_gradient_checkpointing=False)
    assert model.peft_config["default"].target_parameters  # the experts are adapted
    randomize_lora_b(model, 0)
    expected = logits(model, input_ids)
    assert relative_error(logits(_plain_base(path), input_ids), expected) > 100 * SAME

    _, report = merged_state_dict(model)
    experts = [name for name in report.merged_layers if ".experts." in name]
    assert sorted(experts) == sorted(
        f"model.layers.{i}.mlp.experts.{p}" for i in range(2) for p in ("gate_up_proj", "down_proj")
    )
    save_pretrained_merged(model, tmp_path / "merged", tokenizer, save_method="merged_16bit")
    assert_merged_16bit(tmp_path / "merged", model, tokenizer, expected)
