"""Unsloth's get_peft_model flags that choose the adapted layers by kind."""

import pytest

from slothkit.compat.unsloth_options import targets_from_layer_flags

SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.mark.parametrize(
    "flags, target_modules, expected",
    [
        ({}, None, None),
        ({"finetune_vision_layers": False, "finetune_language_layers": True}, None, None),
        ({"finetune_attention_modules": False}, None, ["gate_proj", "up_proj", "down_proj"]),
        ({"finetune_mlp_modules": False}, None, ["q_proj", "k_proj", "v_proj", "o_proj"]),
        (
            {"finetune_mlp_modules": False},
            SEVEN + ["lm_head"],
            ["q_proj", "k_proj", "v_proj", "o_proj", "lm_head"],
        ),
        ({"finetune_attention_modules": False}, ["qkv_proj", "gate_up_proj"], ["gate_up_proj"]),
    ],
)
def test_flags_narrow_the_targets_and_leave_lora_config(flags, target_modules, expected):
    lora_kwargs = {**flags, "init_lora_weights": False}
    assert targets_from_layer_flags(target_modules, lora_kwargs) == expected
    assert lora_kwargs == {"init_lora_weights": False}


@pytest.mark.parametrize(
    "flags, target_modules, message",
    [
        ({"finetune_language_layers": False}, None, "finetune_language_layers=False leaves nothing to adapt"),
        ({"finetune_attention_modules": False, "finetune_mlp_modules": False}, None, "leave none of"),
        ({"finetune_mlp_modules": False}, "all-linear", "name the layers to adapt in target_modules"),
    ],
)
def test_flags_that_leave_nothing_are_refused(flags, target_modules, message):
    with pytest.raises(ValueError, match=message):
        targets_from_layer_flags(target_modules, dict(flags))
