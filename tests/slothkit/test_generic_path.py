"""The generic path: a model slothkit has no record for keeps its modules and gets the fused
linear cross-entropy on its head, where its own loss is the plain one; it loads with an
attention it can run (VaultGemma: eager) and takes the default LoRA targets (Phi-3's fused
projections)."""

import warnings

import pytest
import torch

from slothkit import FastModel
from slothkit.core.model_state import patched_module
from slothkit.engine.generic_head import why_head_stays
from slothkit.testing import build_tiny_tokenizer
from slothkit_kernels.testing import relative_error

STEPS = 8


@pytest.fixture(autouse=True)
def fresh_notices():
    from slothkit.core.notices import say_once
    from slothkit.loading.load_model import _notice_generic_path, _warn_unsupported

    for notice in (say_once, _notice_generic_path, _warn_unsupported):
        notice.cache_clear()


TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _checkpoint(tmp_path, model_type: str, **config):
    """A tiny random checkpoint of `model_type` (any transformers causal LM) with a tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    sizes = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=768, max_position_embeddings=2048, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **{**sizes, **config}))
    path = tmp_path / model_type
    model.save_pretrained(path)
    build_tiny_tokenizer("bpe", path)
    return path


def _train(model, ids, labels, steps=STEPS):
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=2e-3)
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _assert_trains_like(model, plain, ids):
    """STEPS steps of ``model`` give ``plain``'s losses (which fall) and adapters."""
    labels = ids.clone()
    labels[0, :3] = -100
    losses, plain_losses = _train(model, ids, labels), _train(plain, ids, labels)
    assert plain_losses[-1] < plain_losses[0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(plain_losses), rtol=1e-5, atol=0)
    for name, value in plain.state_dict().items():
        if "lora_" in name:
            torch.testing.assert_close(model.state_dict()[name], value, rtol=1e-5, atol=1e-7, msg=name)


def _plain_peft(path, attention="sdpa", targets=TARGETS):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attention)
    torch.manual_seed(3407)
    config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, task_type="CAUSAL_LM", target_modules=targets)
    return get_peft_model(model, config).train()


@pytest.mark.parametrize("source", ["olmo2", "olmo", "vaultgemma"])
def test_generic_model_trains_with_the_fused_head_like_hf_peft(source, tmp_path):
    """OLMo 2 (norms after attention and MLP, q/k norms), OLMo and VaultGemma (Gemma 2's
    layer), none of which has a record: the decoder layers stay Hugging Face's with their
    gated MLPs (and RMSNorms) fused one by one, the head computes the fused loss (VaultGemma's with its final-logit soft-capping at 30), and 8
    steps give HF + PEFT's losses. VaultGemma's class refuses SDPA (its attention logits
    are soft-capped too): it loads with eager attention."""
    path = _checkpoint(tmp_path, source)
    with pytest.warns(UserWarning, match="fused cross-entropy on the head"):
        fast, _ = FastModel.from_pretrained(str(path), dtype=torch.float32, load_in_4bit=False, fused=True)
    fast = FastModel.get_peft_model(fast, r=8, lora_alpha=16, use_gradient_checkpointing=False)
    causal_lm = fast.get_base_model()
    assert patched_module(causal_lm) is not None  # the head's loss is slothkit's
    assert patched_module(causal_lm.model.layers[0]) is None  # the layers are not
    assert patched_module(causal_lm.model.layers[0].mlp) is not None  # their MLPs are
    attention = "eager" if source == "vaultgemma" else "sdpa"
    assert causal_lm.config._attn_implementation == attention
    plain = _plain_peft(path, attention)

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 600, (2, 12), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100
    fast_losses, plain_losses = _train(fast, ids, labels), _train(plain, ids, labels)
    assert plain_losses[-1] < plain_losses[0]
    torch.testing.assert_close(torch.tensor(fast_losses), torch.tensor(plain_losses), rtol=1e-5, atol=0)
    assert fast(input_ids=ids, labels=labels).logits is None  # no (tokens x vocabulary) logits built


def test_a_model_that_scales_its_logits_keeps_its_own_loss(tmp_path, monkeypatch):
    """Granite divides its logits by logits_scaling: the fused loss would be another one, so
    the check finds it and the model keeps its loss; with its residual multiplier its layers
    stay its own too, their norms and MLPs fused one by one. Where not even those could be
    fused, fused=True is refused with every reason."""
    from transformers import AutoModelForCausalLM

    from slothkit.loading import load_model

    path = _checkpoint(tmp_path, "granite", logits_scaling=4.0, residual_multiplier=0.5)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert "transforms its logits" in why_head_stays(model)
    assert patched_module(model) is None and model.training is False  # left as it was
    with pytest.warns(
        UserWarning, match="RMSNorms and 2 gated MLPs in slothkit's kernels.*transforms its logits"
    ):
        fast, _ = FastModel.from_pretrained(str(path), dtype=torch.float32, load_in_4bit=False, fused=True)
    assert patched_module(fast) is None and patched_module(fast.model.layers[0]) is None
    assert patched_module(fast.model.layers[0].mlp) is not None
    monkeypatch.setattr(load_model, "fuse_generic_modules", lambda causal_lm: (0, 0, None))
    with pytest.raises(
        ValueError,
        match="cannot fuse its loss: its own loss .* transforms its logits, nor its layers: .* differs by",
    ):
        FastModel.from_pretrained(str(path), dtype=torch.float32, load_in_4bit=False, fused=True)

    unscaled = AutoModelForCausalLM.from_pretrained(
        _checkpoint(tmp_path / "plain", "granite", logits_scaling=1.0), dtype=torch.float32
    )
    assert why_head_stays(unscaled) is None


def test_fused_false_and_a_cpu_keep_the_model_as_it_is(tmp_path):
    path = _checkpoint(tmp_path, "olmo")
    fast, _ = FastModel.from_pretrained(str(path), dtype=torch.float32, load_in_4bit=False, fused=False)
    assert patched_module(fast) is None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cpu, _ = FastModel.from_pretrained(str(path), dtype=torch.float32, load_in_4bit=False)
    assert patched_module(cpu) is None  # fused=None patches the head on a CUDA GPU only
    assert any("plain Hugging Face + PEFT path" in str(w.message) for w in caught)


def test_phi3_default_targets_adapt_its_fused_projections(tmp_path):
    """Phi-3 computes q, k, v as qkv_proj and gate, up as gate_up_proj: the default (and
    a notebook's seven names) adapt those, said once; a partial group is refused by name."""
    path = _checkpoint(tmp_path, "phi3")
    model, _ = FastModel.from_pretrained(str(path), dtype=torch.float32, load_in_4bit=False, fused=False)
    with pytest.warns(UserWarning, match="computes q_proj, k_proj, v_proj as one layer, qkv_proj"):
        peft_model = FastModel.get_peft_model(model, r=8, lora_alpha=16, target_modules=TARGETS)
    adapted = {name.split(".")[-2] for name, _ in peft_model.named_modules() if name.endswith("lora_A")}
    assert adapted == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    ids = torch.randint(3, 600, (2, 12), generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(peft_model(input_ids=ids, labels=ids).loss)

    # The default (target_modules=None) is the same four layers, and trains as HF + PEFT
    # given those names does; the notice was given once, above.
    model, _ = FastModel.from_pretrained(str(path), dtype=torch.float32, load_in_4bit=False, fused=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        default = FastModel.get_peft_model(model, r=8, lora_alpha=16, use_gradient_checkpointing=False)
    assert not [w for w in caught if "as one layer" in str(w.message)]
    assert default.peft_config["default"].target_modules == {
        "qkv_proj",
        "o_proj",
        "gate_up_proj",
        "down_proj",
    }
    plain = _plain_peft(path, targets=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"])
    _assert_trains_like(default, plain, ids)

    model, _ = FastModel.from_pretrained(str(path), dtype=torch.float32, load_in_4bit=False)
    with pytest.raises(
        ValueError, match=r"\['q_proj'\] match no layer .* named \['down_proj', 'gate_up_proj'"
    ):
        FastModel.get_peft_model(model, r=8, lora_alpha=16, target_modules=["q_proj", "o_proj"])


EXPERTS = {
    "qwen3_moe": dict(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, head_dim=16),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16, sliding_window=8),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
}


@pytest.mark.parametrize("source", sorted(EXPERTS))
def test_moe_experts_take_the_mlp_names_through_target_parameters(source, tmp_path):
    """Qwen3-MoE, gpt-oss and Mixtral hold every expert's MLP as 3-D parameters of their experts
    module, not linear layers: the default seven names (a notebook's) adapt those
    parameters through PEFT's target_parameters, said once, and 8 steps give the losses
    and adapters of HF + PEFT given the same targets; dropout, which LoRA on a parameter
    cannot apply, is refused by slothkit rather than deep in PEFT."""
    path = _checkpoint(tmp_path, source, **EXPERTS[source])
    model, _ = FastModel.from_pretrained(str(path), dtype=torch.float32, load_in_4bit=False)
    with pytest.warns(UserWarning, match="experts hold their MLP projections as 3-D parameters"):
        fast = FastModel.get_peft_model(model, r=8, lora_alpha=16, use_gradient_checkpointing=False)
    config = fast.peft_config["default"]
    assert config.target_modules == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert sorted(config.target_parameters) == ["experts.down_proj", "experts.gate_up_proj"]
    adapted = {n for n, _ in fast.named_parameters() if "lora_A" in n and "experts" in n}
    assert len(adapted) == 2 * 2  # two parameters in each of the two layers

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    torch.manual_seed(3407)
    plain = get_peft_model(
        plain,
        LoraConfig(
            r=8, lora_alpha=16, task_type="CAUSAL_LM", target_modules=TARGETS[:4],
            target_parameters=["experts.gate_up_proj", "experts.down_proj"],
        ),
    ).train()  # fmt: skip
    for name, value in plain.state_dict().items():
        if "lora_B" in name:  # PEFT starts B at zero: random, so that the experts' updates count
            value.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
            fast.state_dict()[name].copy_(value)
    _assert_trains_like(
        fast, plain, torch.randint(3, 600, (2, 12), generator=torch.Generator().manual_seed(0))
    )

    model, _ = FastModel.from_pretrained(str(path), dtype=torch.float32, load_in_4bit=False)
    with pytest.raises(ValueError, match="lora_dropout=0.05: LoRA on the experts' 3-D parameters"):
        FastModel.get_peft_model(model, r=8, lora_alpha=16, lora_dropout=0.05)


def test_moe_targets_name_what_is_wrong(tmp_path):
    """On a mixture-of-experts model, gate_proj without up_proj is refused by naming the
    experts' fused parameter and the missing name (not by listing the attention layers as
    if the MLP could not be adapted); a misspelt target_parameters name is refused rather
    than left to PEFT's warning and a run without those adapters."""
    path = _checkpoint(tmp_path, "qwen3_moe", **EXPERTS["qwen3_moe"])
    model, _ = FastModel.from_pretrained(str(path), dtype=torch.float32, load_in_4bit=False)
    with pytest.raises(
        ValueError,
        match=r"hold gate_proj and up_proj as one 3-D parameter each, experts.gate_up_proj.*add \['up_proj'\]",
    ):
        FastModel.get_peft_model(model, r=8, target_modules=["q_proj", "gate_proj"])
    with pytest.raises(ValueError, match=r"\['experts.gate_up_prj'\] match no parameter.*experts.down_proj"):
        FastModel.get_peft_model(
            model, r=8, target_modules=["q_proj"], target_parameters=["experts.gate_up_prj"]
        )
    fast = FastModel.get_peft_model(model, r=8, target_modules=["q_proj", "gate_proj", "up_proj"])
    assert set(fast.peft_config["default"].target_parameters) == {"experts.gate_up_proj"}


@pytest.mark.parametrize("source", ["qwen3_moe", "gpt_oss"])
def test_moe_experts_parameter_name_adapts_it(source, tmp_path):
    """The experts' parameter named as a target (Unsloth's MoE notebooks add "gate_up_proj"
    to the seven MLP and attention names) adapts that parameter, as the MLP names it stands
    for do: alone it adds experts.gate_up_proj, and with the seven names the same two
    parameters as the seven alone, the same adapters with the same initial values."""
    path = _checkpoint(tmp_path, source, **EXPERTS[source])
    model, _ = FastModel.from_pretrained(str(path), dtype=torch.float32, load_in_4bit=False)
    alone = FastModel.get_peft_model(model, r=8, target_modules=["q_proj", "gate_up_proj"])
    config = alone.peft_config["default"]
    assert config.target_modules == {"q_proj"} and set(config.target_parameters) == {"experts.gate_up_proj"}

    def adapters(target_modules):
        model, _ = FastModel.from_pretrained(str(path), dtype=torch.float32, load_in_4bit=False)
        peft_model = FastModel.get_peft_model(model, r=8, target_modules=target_modules, random_state=5)
        return {n: p.detach().clone() for n, p in peft_model.named_parameters() if "lora_" in n}

    with_name, without = adapters(TARGETS + ["gate_up_proj"]), adapters(TARGETS)
    assert with_name.keys() == without.keys() and any("experts" in n for n in with_name)
    assert all(torch.equal(with_name[n], without[n]) for n in with_name)


def test_qwen3_5_adapts_its_linear_attention_layers_like_hf_peft(tmp_path):
    """Qwen3.5's gated DeltaNet layers (three in four) have no q/k/v/o_proj: the default
    targets adapt their input and output projections too, said once, and 8 steps give the
    losses and adapters of HF + PEFT given those targets. The per-head scalars'
    projections (in_proj_a, in_proj_b) are left."""
    from slothkit.models.generic_shapes import GENERIC_SHAPES

    extra = {k: v for k, v in GENERIC_SHAPES["tiny-qwen3.5"].extra.items() if k != "vocab_size"}
    path = _checkpoint(tmp_path, "qwen3_5_text", num_hidden_layers=4, **extra)
    model, _ = FastModel.from_pretrained(str(path), dtype=torch.float32, load_in_4bit=False)
    with pytest.warns(UserWarning, match="gated DeltaNet.*in_proj_qkv, in_proj_z, out_proj"):
        fast = FastModel.get_peft_model(model, r=8, lora_alpha=16, use_gradient_checkpointing=False)
    targets = TARGETS + ["in_proj_qkv", "in_proj_z", "out_proj"]
    assert fast.peft_config["default"].target_modules == set(targets)
    adapted = {n.split(".lora_A")[0].split("layers.")[1] for n, _ in fast.named_parameters() if "lora_A" in n}
    assert {"0.linear_attn.in_proj_qkv", "2.linear_attn.out_proj", "3.self_attn.q_proj"} <= adapted
    assert not any("in_proj_a" in name or "in_proj_b" in name for name in adapted)

    plain = _plain_peft(path, targets=targets)
    ids = torch.randint(3, 600, (2, 12), generator=torch.Generator().manual_seed(0))
    _assert_trains_like(fast, plain, ids)

    # Without all of q/k/v/o the user chose the layers: nothing is added.
    model, _ = FastModel.from_pretrained(str(path), dtype=torch.float32, load_in_4bit=False)
    fast = FastModel.get_peft_model(model, r=8, target_modules=["q_proj", "v_proj", "gate_proj"])
    assert fast.peft_config["default"].target_modules == {"q_proj", "v_proj", "gate_proj"}


def test_a_decoder_whose_layers_are_not_at_model_layers_trains(tmp_path):
    """GPT-2 keeps its blocks at transformer.h: LoRA on its c_attn raised an AttributeError
    (no `.model`); it trains like HF + PEFT."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    path = tmp_path / "gpt2"
    config = GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=512, n_positions=256)
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0  # the same numbers on both sides
    GPT2LMHeadModel(config).save_pretrained(path)
    build_tiny_tokenizer("bpe", path)
    fast, _ = FastModel.from_pretrained(
        str(path), dtype=torch.float32, load_in_4bit=False, max_seq_length=256
    )
    fast = FastModel.get_peft_model(fast, r=4, lora_alpha=8, target_modules=["c_attn"])
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    torch.manual_seed(3407)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True)
    plain = get_peft_model(plain, lora).train()
    ids = torch.randint(3, 500, (2, 12), generator=torch.Generator().manual_seed(0))
    _assert_trains_like(fast, plain, ids)


def test_attention_falls_back_by_the_class_and_keeps_what_the_user_asked():
    """None (FastModel's default) gives SDPA where the model's class runs it and eager
    attention, said once, where it does not (Gemma 2, VaultGemma: soft-capped scores); an
    implementation the user names is taken as it is."""
    from transformers import AutoConfig

    from slothkit.core.notices import FallbackWarning
    from slothkit.loading.load_model import attention_for

    llama, gemma2 = AutoConfig.for_model("llama"), AutoConfig.for_model("gemma2")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert attention_for(llama) == "sdpa"
        assert attention_for(gemma2) == attention_for(gemma2) == "eager"
        assert attention_for(gemma2, sequence_classifier=True) == "eager"
        assert attention_for(AutoConfig.for_model("vaultgemma")) == "eager"
    notices = [str(w.message) for w in caught if w.category is FallbackWarning]
    assert len(notices) == 3  # once per class: Gemma2ForCausalLM, ...ForSequenceClassification, VaultGemma
    assert notices[0].startswith("slothkit: Gemma2ForCausalLM cannot run SDPA attention")
    for asked in ("sdpa", "eager", "flash_attention_2"):
        assert attention_for(gemma2, asked) == asked
        assert attention_for(llama, asked) == asked


def test_soft_capped_attention_never_runs_sdpa(monkeypatch):
    """transformers 5.17 marks Gemma 2 as SDPA-capable, and its SDPA drops the score cap
    without a word: FastModel's default is eager attention for any soft-capped model, and
    the fused attention of a module that soft-caps runs its eager function even under
    SDPA, said once."""
    from transformers import AutoConfig
    from transformers.models.gemma2 import modeling_gemma2

    from slothkit.core.notices import FallbackWarning
    from slothkit.engine.decoder import _attention_function
    from slothkit.loading.load_model import attention_for

    monkeypatch.setattr(modeling_gemma2.Gemma2PreTrainedModel, "_supports_sdpa", True)  # as in 5.17
    gemma2 = AutoConfig.for_model("gemma2")
    assert attention_for(gemma2) == "eager"
    gemma2.attn_logit_softcapping = None  # no cap: SDPA is right again
    assert attention_for(gemma2) == "sdpa"

    config = AutoConfig.for_model(
        "gemma2", hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16
    )
    config._attn_implementation = "sdpa"
    attention = modeling_gemma2.Gemma2Attention(config, layer_idx=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _attention_function(attention) is modeling_gemma2.eager_attention_forward
        assert _attention_function(attention) is modeling_gemma2.eager_attention_forward
    notices = [str(w.message) for w in caught if w.category is FallbackWarning]
    assert len(notices) == 1 and "soft-caps its attention scores" in notices[0]
    attention.attn_logit_softcapping = None
    assert _attention_function(attention) is not modeling_gemma2.eager_attention_forward


def test_qwen3_5_gated_deltanet_layers_train_through_the_delta_rule_kernel_like_hf_peft(
    tmp_path, monkeypatch
):
    """With the fused path on (here the Triton interpreter), Qwen3.5's gated DeltaNet layers
    compute the delta rule with slothkit's kernel, checked at loading and said once. Over a
    sequence of two chunks every LoRA gradient (B set to random values, so that A has one)
    is HF + PEFT's to fp32 rounding, and so are the losses of 3 AdamW steps (the adapters
    themselves are not compared: Adam's first steps divide gradients near zero by their
    own size, which turns rounding into differences of order lr). With a cache the layer's
    own forward runs."""
    from slothkit.core.notices import SlothkitNotice
    from slothkit.engine import gated_deltanet
    from slothkit.engine.gated_deltanet import deltanet_layers
    from slothkit.models.generic_shapes import GENERIC_SHAPES

    kernel_calls = []
    kernel = gated_deltanet.gated_delta_rule
    monkeypatch.setattr(
        gated_deltanet, "gated_delta_rule", lambda *a, **k: kernel_calls.append(1) or kernel(*a, **k)
    )
    extra = {k: v for k, v in GENERIC_SHAPES["tiny-qwen3.5"].extra.items() if k != "vocab_size"}
    path = _checkpoint(tmp_path, "qwen3_5_text", num_hidden_layers=4, **extra)
    with pytest.warns(SlothkitNotice, match="3 gated DeltaNet layers.*chunked Triton kernel"):
        model, _ = FastModel.from_pretrained(str(path), dtype=torch.float32, load_in_4bit=False, fused=True)
    layers = deltanet_layers(model)
    assert len(layers) == 3 and all(patched_module(layer) is not None for layer in layers)
    targets = TARGETS + ["in_proj_qkv", "in_proj_z", "out_proj"]
    fast = FastModel.get_peft_model(
        model, r=8, lora_alpha=16, target_modules=targets, use_gradient_checkpointing=False
    )
    plain = _plain_peft(path, targets=targets)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for (name, ours), theirs in zip(fast.named_parameters(), plain.parameters()):
            if "lora_B" in name:
                ours.copy_(torch.randn(ours.shape, generator=generator) * 0.05)
                theirs.copy_(ours)
    ids = torch.randint(3, 600, (1, 66), generator=torch.Generator().manual_seed(0))
    kernel_calls.clear()
    for model_ in (fast, plain):
        model_(input_ids=ids, labels=ids).loss.backward()
    assert len(kernel_calls) == 3  # one per gated DeltaNet layer, after PEFT's wrap and train()
    theirs = dict(plain.named_parameters())
    for name, ours in fast.named_parameters():
        if "lora_" in name:
            assert relative_error(ours.grad, theirs[name].grad) < 1e-5, name
    for model_ in (fast, plain):
        model_.zero_grad(set_to_none=True)
    losses, plain_losses = _train(fast, ids, ids, steps=3), _train(plain, ids, ids, steps=3)
    assert plain_losses[-1] < plain_losses[0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(plain_losses), rtol=1e-5, atol=0)

    record = patched_module(layers[0])
    cached_calls = []

    def own_forward(*args, **kwargs):
        cached_calls.append(kwargs.get("cache", kwargs.get("cache_params")) is not None)
        return kernel_free(*args, **kwargs)

    kernel_free, record.original_forward = record.original_forward, own_forward
    with torch.no_grad():
        fast.generate(input_ids=ids[:, :5], max_new_tokens=2, do_sample=False)
    assert cached_calls and all(cached_calls)
