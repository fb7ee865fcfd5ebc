"""The tiny mixture-of-experts checkpoints the Qwen3-30B-A3B and gpt-oss-20b notebooks run on:
the tiny generic shapes' sizes, a vocabulary that holds the tokenizer, and weights that load
as they were made."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from slothkit.models.generic_shapes import GENERIC_SHAPES
from slothkit.testing.tiny_expert_models import build_tiny_expert_model, tiny_expert_shape_name


@pytest.mark.parametrize(
    "model_type, shape_name", [("qwen3_moe", "tiny-qwen3-moe"), ("gpt_oss", "tiny-gpt-oss")]
)
def test_tiny_expert_checkpoint_is_its_shape_and_loads_as_made(model_type, shape_name, tmp_path):
    assert tiny_expert_shape_name(model_type) == shape_name
    path = build_tiny_expert_model(model_type, tmp_path / model_type, seed=3)
    shape = GENERIC_SHAPES[shape_name]
    config = AutoConfig.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert config.model_type == model_type
    expected = shape.config().to_dict()
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim"):
        assert getattr(config, key) == expected[key], key
    assert shape.experts() is not None
    assert len(tokenizer) <= config.vocab_size < len(tokenizer) + 256 and config.vocab_size % 256 == 0
    assert config.pad_token_id == tokenizer.pad_token_id and config.eos_token_id == tokenizer.eos_token_id

    torch.manual_seed(3)
    made = AutoModelForCausalLM.from_config(config).eval()
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.randint(0, len(tokenizer), (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, made(ids).logits, rtol=0, atol=0)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
    assert "Hi" in text


def test_a_model_type_without_a_tiny_expert_checkpoint_is_named():
    with pytest.raises(
        ValueError,
        match="no tiny mixture-of-experts checkpoint for model_type 'olmo2'; built for: gpt_oss, qwen3_moe",
    ):
        tiny_expert_shape_name("olmo2")
