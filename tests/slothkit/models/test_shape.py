"""slothkit.models.shape: shapes read off transformers configs, and the parameters per token
they count."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from slothkit.models import shape_by_name
from slothkit.models.shape import ExpertsShape, shape_from_config


def test_a_config_without_a_dense_width_takes_its_experts_width():
    """Qwen3.5-MoE's config has no intermediate_size (every layer is a mixture of
    experts): the shape reads the experts' width in its place, the shared expert's width
    into its experts, and is the named shape of the same model."""
    from transformers import AutoConfig

    config = AutoConfig.for_model("qwen3_5_moe_text")
    assert getattr(config, "intermediate_size", None) is None
    shape = shape_from_config(config)
    named = shape_by_name("qwen3.5-35b-a3b")
    assert shape.intermediate_size == config.moe_intermediate_size == 512
    assert shape.experts() == named.experts() == ExpertsShape(256, 512, 8, 40, 512)
    assert shape.linear_attention() == named.linear_attention()
    assert shape.layer_types() == named.layer_types()


def test_a_config_with_neither_width_is_refused():
    config = SimpleNamespace(
        model_type="llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=512
    )
    with pytest.raises(ValueError, match="the model's config has no intermediate_size; expected a positive"):
        shape_from_config(config)
    experts = SimpleNamespace(**vars(config), num_experts=4, num_experts_per_tok=2)
    with pytest.raises(ValueError, match="has no moe_intermediate_size; expected a positive"):
        shape_from_config(experts)


def test_models_without_a_shared_expert_have_none():
    for name in ("qwen3-30b-a3b", "gpt-oss-20b", "tiny-qwen3-moe"):
        assert shape_by_name(name).experts().shared_width == 0


@pytest.mark.parametrize("name", ["qwen3.5-35b-a3b", "qwen3.5-35b-a3b-8l"])
def test_matmul_parameters_count_the_shared_expert_and_its_gate(name):
    """Every token runs the shared expert and its gate: matmul_parameters counts the
    parameters of those modules in the model transformers builds, in every layer."""
    from transformers import AutoModelForCausalLM

    shape = shape_by_name(name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(shape.config())
    shared = sum(p.numel() for n, p in model.named_parameters() if ".shared_expert" in n)
    without = {k: v for k, v in shape.extra.items() if k != "shared_expert_intermediate_size"}
    unshared = dataclasses.replace(shape, extra=without)
    assert unshared.experts().shared_width == 0
    assert shape.matmul_parameters() - unshared.matmul_parameters() == shared


@pytest.mark.parametrize("name", ["qwen3.5-9b", "tiny-qwen3.5", "llama-3-8b", "gemma-7b"])
def test_matmul_parameters_are_the_linear_weights_of_the_model_transformers_builds(name):
    """Of a dense model, every nn.Linear's weight runs once per token: Qwen3.5's gated
    attention layers' q_proj (query and output gate) and its gated DeltaNet layers' five
    projections each by their own width, not as full attention."""
    from transformers import AutoModelForCausalLM

    shape = shape_by_name(name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(shape.config())
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert shape.matmul_parameters() == linear  # the LM head among them, tied or not
