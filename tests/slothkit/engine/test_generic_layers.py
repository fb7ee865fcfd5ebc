"""The generic path's fused layers: a model without a record gets the fused norms,
attention and residual sums where its own modules compute the same, checked at loading,
and keeps its modules, with the reason, where they compute something else."""

import pytest
import torch

from slothkit import FastModel
from slothkit.core.model_state import patched_module
from slothkit.engine.generic_layers import fuse_generic_layers
from slothkit.testing import build_tiny_tokenizer

SIZES = dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=512, max_position_embeddings=4096, pad_token_id=0,
)  # fmt: skip
# FastModel loads onto the GPU where there is one; the others follow it.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _model(model_type: str, dtype=torch.float32, **config):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **{**SIZES, **config})).to(
        DEVICE, dtype
    )


def _patched(model) -> list:
    return [m for m in model.model.modules() if patched_module(m) is not None]


@pytest.mark.parametrize(
    "model_type, config",
    [
        ("qwen3_moe", dict(moe_intermediate_size=24, num_experts=6, num_experts_per_tok=2, head_dim=16)),
        # Qwen3-30B-A3B's routing, 128 experts and top 8: in bf16 many near-tied router scores,
        # which a rounding of the fused layers flips unless the check routes as the model did.
        ("qwen3_moe", dict(moe_intermediate_size=24, num_experts=128, num_experts_per_tok=8, head_dim=16)),
        ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
        ("granite", dict(attention_multiplier=0.05)),  # its attention scale: the module's own
        ("smollm3", dict(num_hidden_layers=3)),  # its fourth layer would be without RoPE
    ],
    ids=["qwen3_moe", "qwen3_moe-128-experts", "mixtral", "granite", "smollm3"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_llama_built_layers_take_the_fused_pieces(model_type, config, dtype):
    model = _model(model_type, dtype, **config)
    assert fuse_generic_layers(model) is None
    for layer in model.model.layers:
        assert patched_module(layer) is not None and patched_module(layer.self_attn) is not None
        assert patched_module(layer.input_layernorm) is not None
        # a gated MLP is fused here; a mixture-of-experts block is left to engine.experts
        assert (patched_module(layer.mlp) is not None) == hasattr(layer.mlp, "gate_proj")
    assert fuse_generic_layers(model) is None  # idempotent


@pytest.mark.parametrize(
    "model_type, config, reason",
    [
        ("smollm3", dict(num_hidden_layers=4), "its attention computes something else"),  # NoPE layer
        ("ernie4_5", dict(), "its attention computes something else"),  # pairs of adjacent dims
        ("granite", dict(residual_multiplier=0.22), "its layers compute something else"),
        ("glm4", dict(), "partial_rotary_factor=0.5"),
        ("olmo2", dict(), "normalise the MLP's input or output"),
        ("gpt_oss", dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16), "could not be checked"),
    ],
    ids=["smollm3-nope", "ernie4_5", "granite-residual", "glm4", "olmo2", "gpt_oss"],
)
def test_layers_that_compute_otherwise_keep_their_modules(model_type, config, reason):
    model = _model(model_type, **config)
    assert reason in fuse_generic_layers(model)
    assert not _patched(model)  # every patch undone
    assert model.training  # as it was


def test_fused_generic_layers_train_like_hf_peft(tmp_path):
    """Granite (no record) through FastModel: the layers, MLP included, are slothkit's, and
    8 steps give HF + PEFT's losses and adapters."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    path = tmp_path / "granite"
    _model("granite", attention_multiplier=0.05, embedding_multiplier=2.0).cpu().save_pretrained(path)
    build_tiny_tokenizer("bpe", path)
    with pytest.warns(UserWarning, match="slothkit's fused norms, attention and residual sums"):
        model, _ = FastModel.from_pretrained(str(path), dtype=torch.float32, load_in_4bit=False, fused=True)
    fast = FastModel.get_peft_model(model, r=8, lora_alpha=16, use_gradient_checkpointing=False)
    assert patched_module(fast.get_base_model().model.layers[0].mlp) is not None
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    torch.manual_seed(3407)
    plain = (
        get_peft_model(plain, LoraConfig(r=8, lora_alpha=16, task_type="CAUSAL_LM", target_modules=TARGETS))
        .train()
        .to(DEVICE)
    )
    generator = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for (name, p), (_, q) in zip(sorted(fast.named_parameters()), sorted(plain.named_parameters())):
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.05)
                q.copy_(p)

    ids = torch.randint(3, 500, (2, 13), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    losses = {}
    for label, model in (("fast", fast), ("plain", plain)):
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-3)
        losses[label] = []
        for _ in range(8):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses[label].append(loss.item())
    assert losses["plain"][-1] < losses["plain"][0]
    torch.testing.assert_close(torch.tensor(losses["fast"]), torch.tensor(losses["plain"]), rtol=1e-5, atol=0)
    plain_state = plain.state_dict()
    for name, value in fast.state_dict().items():
        if "lora_" in name:
            torch.testing.assert_close(value, plain_state[name], rtol=0, atol=5e-5, msg=name)
