"""The tiny generic-path checkpoints the Qwen3-30B-A3B, gpt-oss-20b, Qwen3.5-9B and Gemma 4
notebooks run on: the tiny generic shapes' sizes, a vocabulary that holds the tokenizer, the
chat format the notebook installs, and weights that load as they were made."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from slothkit.data import FORMATS
from slothkit.data.chat_formats import format_of_template
from slothkit.models.generic_shapes import GENERIC_SHAPES
from slothkit.testing.tiny_generic_models import (
    TINY_TOKENIZERS,
    build_tiny_generic_model,
    tiny_generic_shape_name,
)


@pytest.mark.parametrize(
    "model_type, shape_name",
    [
        ("qwen3_moe", "tiny-qwen3-moe"),
        ("gpt_oss", "tiny-gpt-oss"),
        ("qwen3_5_text", "tiny-qwen3.5"),
        ("gemma4_text", "tiny-gemma4"),
    ],
)
def test_tiny_generic_checkpoint_is_its_shape_and_loads_as_made(model_type, shape_name, tmp_path):
    assert tiny_generic_shape_name(model_type) == shape_name
    path = build_tiny_generic_model(model_type, tmp_path / model_type, seed=3)
    shape = GENERIC_SHAPES[shape_name]
    config = AutoConfig.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert config.model_type == model_type
    expected = shape.config().to_dict()
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim"):
        assert config.to_dict()[key] == expected[key], key  # per-layer fields (Gemma 4) read from the dict
    assert (shape.experts() is not None) == (model_type in ("qwen3_moe", "gpt_oss"))
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
    chat_format = TINY_TOKENIZERS[model_type].chat_format
    if chat_format is not None:  # the notebook's format, its markers whole tokens
        assert format_of_template(tokenizer.chat_template).name == chat_format
        for marker in FORMATS[chat_format].special_tokens:
            assert len(tokenizer(marker, add_special_tokens=False)["input_ids"]) == 1, marker


def test_a_model_type_without_a_tiny_generic_checkpoint_is_named():
    with pytest.raises(
        ValueError,
        match="no tiny generic-path checkpoint for model_type 'olmo2'; built for: gemma4_text, gpt_oss, qwen3_5_text, qwen3_moe",
    ):
        tiny_generic_shape_name("olmo2")
