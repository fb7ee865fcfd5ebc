"""The architecture records (slothkit.models) against transformers' and gguf's own classes:
each fact a record states is what the library that owns it says."""

import gguf
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from slothkit.models import (
    ARCHITECTURES,
    EXPERT_RECORDS,
    RECORDS,
    SHAPES,
    architecture_for,
    architecture_named,
    architecture_of_shape,
    export_record_for,
    record_for,
)
from slothkit.testing import TOKENIZER_FLAVOURS
from slothkit.testing.tiny_chat_templates import tiny_chat_template

EVERY_RECORD = pytest.mark.parametrize("arch", RECORDS, ids=lambda a: a.name)
FUSED = pytest.mark.parametrize("arch", ARCHITECTURES, ids=lambda a: a.name)
TINY = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    vocab_size=64,
    pad_token_id=0,  # within the vocabulary (Phi-3's default is 32000)
)


def _activation(config) -> str:
    """The activation transformers' MLP applies: Gemma's config in transformers 4.x reads
    hidden_activation first."""
    return getattr(config, "hidden_activation", None) or config.hidden_act


@EVERY_RECORD
def test_record_agrees_with_transformers_config_class(arch):
    for model_type in arch.model_types:
        config = AutoConfig.for_model(model_type)  # the class defaults
        assert _activation(config) == arch.hidden_act
        assert config.tie_word_embeddings is arch.tied_embeddings
        assert (getattr(config, "sliding_window", None) is not None) is arch.sliding_window
        assert MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type] == arch.causal_lm_class
        assert arch.activation(config) in ("swiglu", "geglu", "geglu_tanh")  # the fused MLP runs it
        assert record_for(config) is arch
        assert (architecture_for(config) is arch) is arch.fused  # FastModel patches fused ones only


@EVERY_RECORD
def test_norm_flavour_and_tied_head_agree_with_transformers_model(arch):
    """A zero norm weight zeroes the output of x * w, and leaves x * (1 + w) normalised."""
    config = AutoConfig.for_model(arch.model_types[0], **TINY)
    model = AutoModelForCausalLM.from_config(config)
    assert type(model).__name__ == arch.causal_lm_class
    assert (model.lm_head.weight is model.model.embed_tokens.weight) is arch.tied_embeddings
    norm = model.model.norm
    with torch.no_grad():
        norm.weight.zero_()
        out = norm(torch.randn(3, TINY["hidden_size"], generator=torch.Generator().manual_seed(0)))
    if arch.norm_adds_one:
        torch.testing.assert_close(out.square().mean(-1), torch.ones(3), rtol=1e-4, atol=1e-4)
    else:
        assert torch.equal(out, torch.zeros_like(out))


@EVERY_RECORD
def test_layer_variant_agrees_with_transformers_layer(arch):
    """qk_norm: the attention holds q_norm and k_norm; sandwich_norms: the layer normalises
    the attention's and the MLP's outputs too (four norms), which the fused layer patches."""
    config = AutoConfig.for_model(arch.model_types[0], **TINY)
    layer = AutoModelForCausalLM.from_config(config).model.layers[0]
    attention = layer.self_attn
    assert (hasattr(attention, "q_norm") and hasattr(attention, "k_norm")) is arch.qk_norm
    four_norms = hasattr(layer, "pre_feedforward_layernorm") and hasattr(layer, "post_feedforward_layernorm")
    assert four_norms is arch.sandwich_norms
    assert hasattr(attention, "qkv_proj") is hasattr(layer.mlp, "gate_up_proj") is arch.fused_projections
    assert arch.keeps_attention_sum is not arch.sandwich_norms


@EVERY_RECORD
def test_gguf_layout_agrees_with_gguf_package(arch):
    """The GGUF architecture exists, and has an output matrix unless the record says the
    head is always the token embeddings."""
    by_name = {name: key for key, name in gguf.MODEL_ARCH_NAMES.items()}
    assert arch.gguf.arch in by_name
    has_output = gguf.MODEL_TENSOR.OUTPUT in gguf.MODEL_TENSORS[by_name[arch.gguf.arch]]
    assert has_output is not arch.gguf.output_always_tied


@FUSED
def test_named_shapes_build_configs_of_the_family(arch):
    assert arch.shapes, f"{arch.name} names no shape"
    assert f"tiny-{arch.name}" in arch.shapes  # the CPU shape of the bench and its tests
    for name, shape in arch.shapes.items():
        assert shape.model_type in arch.model_types, name
        assert architecture_of_shape(name) is arch
        assert SHAPES[name] is shape
        config = shape.config()
        assert architecture_for(config) is arch
        assert _activation(config) == arch.hidden_act, name
        assert (getattr(config, "sliding_window", None) is not None) <= arch.sliding_window, name


def test_shape_names_are_unique_across_records():
    from slothkit.models.generic_shapes import GENERIC_SHAPES

    names = [name for arch in RECORDS for name in arch.shapes] + list(GENERIC_SHAPES)
    assert len(names) == len(set(names)) == len(SHAPES)


def test_generic_shapes_are_of_families_without_a_record():
    """The bench's generic-path shapes: transformers builds them, slothkit knows nothing of
    them (FastModel keeps their modules)."""
    from slothkit.models.generic_shapes import GENERIC_SHAPES

    for name, shape in GENERIC_SHAPES.items():
        config = shape.config()
        assert record_for(config) is None, name
        with torch.device("meta"):  # no memory: a 7B model in fp32 would take 28 GB
            AutoModelForCausalLM.from_config(config)  # a causal LM transformers knows


@EVERY_RECORD
def test_tiny_traits_are_consistent(arch):
    tiny = arch.tiny
    assert tiny.tokenizer in TOKENIZER_FLAVOURS
    assert tiny.end_of_turn is None or tiny.end_of_turn in tiny.chat_specials
    assert all(token in tiny_chat_template(tiny.chat_format) for token in tiny.chat_specials)
    assert (tiny.sliding_window is not None) <= arch.sliding_window


def test_lookups_name_what_is_known():
    assert architecture_named("gemma").model_types == ("gemma",)
    with pytest.raises(
        ValueError,
        match="unknown architecture 'gpt2'; known: llama, mistral, gemma, qwen2, qwen3, gemma3, gemma2, phi3, ministral$",
    ):
        architecture_named("gpt2")
    assert architecture_of_shape("mistral-7b") is architecture_named("mistral")
    with pytest.raises(
        ValueError, match="no architecture names the shape 'llama-9'; named shapes: llama-3-8b"
    ):
        architecture_of_shape("llama-9")
    assert architecture_for(AutoConfig.for_model("olmo2")) is None
    assert record_for(AutoConfig.for_model("olmo2")) is None
    gemma3 = AutoConfig.for_model("gemma3_text")
    assert architecture_for(gemma3) is record_for(gemma3) is architecture_named("gemma3")
    assert architecture_named("gemma3") in ARCHITECTURES


@EVERY_RECORD
def test_every_record_names_shapes_of_its_family(arch):
    """The bench builds them (the fused path or, for a record without one, the generic
    path) and the planner predicts from them."""
    assert f"tiny-{arch.name}" in arch.shapes  # the CPU shape of the bench and its tests
    for name, shape in arch.shapes.items():
        config = shape.config()
        assert record_for(config) is arch and architecture_of_shape(name) is arch, name
        assert architecture_for(config) is (arch if arch.fused else None), name


def test_configs_the_fused_layers_do_not_compute_stay_on_the_generic_path(recwarn):
    """Phi-4-mini rotates 3/4 of each head (partial_rotary_factor 0.75) and resid_pdrop
    drops out the residual terms: neither is what the fused layers compute, so such configs
    find no fused record (the generic path), said once; the record itself is unchanged."""
    phi3 = architecture_named("phi3")
    partial = AutoConfig.for_model("phi3", hidden_size=96, num_attention_heads=4, partial_rotary_factor=0.75)
    assert partial.rope_parameters["partial_rotary_factor"] == 0.75  # where transformers keeps it
    assert record_for(partial) is phi3
    assert architecture_for(partial) is None
    assert architecture_for(partial) is None
    notices = [str(w.message) for w in recwarn if "generic path" in str(w.message)]
    assert notices == [
        "slothkit: this phi3 model trains on the generic path, not the fused one: "
        "partial_rotary_factor=0.75 rotates part of each head, the fused RoPE whole heads"
    ]
    assert architecture_for(AutoConfig.for_model("phi3", resid_pdrop=0.1)) is None
    assert architecture_for(AutoConfig.for_model("phi3", partial_rotary_factor=1.0)) is phi3


@pytest.mark.parametrize("arch", EXPERT_RECORDS, ids=lambda a: a.name)
def test_expert_records_agree_with_transformers_and_gguf(arch):
    """A mixture-of-experts record (export only): transformers' class and config fields, an
    experts module and router where it says, and a GGUF graph with expert stacks."""
    by_name = {name: key for key, name in gguf.MODEL_ARCH_NAMES.items()}
    assert gguf.MODEL_TENSOR.FFN_GATE_EXP in gguf.MODEL_TENSORS[by_name[arch.gguf.arch]]
    experts = arch.gguf.experts
    for model_type in arch.model_types:
        config = AutoConfig.for_model(model_type, **TINY, num_experts=4, num_local_experts=4)
        assert MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type] == arch.causal_lm_class
        assert record_for(config) is None and architecture_for(config) is None  # trains generic
        assert export_record_for(config) is arch and not arch.fused
        for key in (experts.count_key, experts.used_count_key, experts.width_key, experts.renormalised_key):
            assert key is None or hasattr(config, key), key
        with torch.device("meta"):
            layer = AutoModelForCausalLM.from_config(config).model.layers[0]
        module = layer.get_submodule(experts.experts)
        assert module.gate_up_proj.ndim == module.down_proj.ndim == 3
        assert layer.get_submodule(experts.router).weight.shape == (4, TINY["hidden_size"])
