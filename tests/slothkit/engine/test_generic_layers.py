"""The generic path's fused layers: a model without a record gets the fused norms,
attention and residual sums where its own modules compute the same, checked at loading,
and keeps its modules, with the reason, where they compute something else."""

import pytest
import torch

from slothkit import FastModel
from slothkit.core.model_state import patched_module
from slothkit.engine.generic_layers import fuse_generic_layers, largest_difference
from slothkit.testing import build_tiny_tokenizer
from slothkit.testing.training_parity import assert_trains_as_hf_peft_does

SIZES = dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=512, max_position_embeddings=4096, pad_token_id=0,
)  # fmt: skip
# FastModel loads onto the GPU where there is one; the others follow it.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _model(model_type: str, dtype=torch.float32, **config):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **{**SIZES, **config})).to(
        DEVICE, dtype
    )


def _gpt_oss_checkpoint(tmp_path, seed: int):
    """A tiny gpt-oss saved with its tokenizer, its sinks and attention biases drawn at
    order one so that they count (they start at zero); returns the folder, the model and
    the generator, to draw more from.  Its experts are few and narrow, as the Triton
    interpreter runs them slowly."""
    path = tmp_path / "gpt_oss"
    model = _model(
        "gpt_oss",
        intermediate_size=32,
        num_local_experts=2,
        num_experts_per_tok=1,
        head_dim=16,
        sliding_window=4,
    )
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("sinks") or ("self_attn" in name and name.endswith("bias")):
                parameter.copy_(torch.randn(parameter.shape, generator=generator))
    model.cpu().save_pretrained(path)
    build_tiny_tokenizer("bpe", path)
    return path, model, generator


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
        # sinks, biased q/k/v/o, RoPE tables of half a head, sliding and full layers
        ("gpt_oss", dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16, sliding_window=8)),
    ],
    ids=["qwen3_moe", "qwen3_moe-128-experts", "mixtral", "granite", "smollm3", "gpt_oss"],
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
    ],
    ids=["smollm3-nope", "ernie4_5", "granite-residual", "glm4", "olmo2"],
)
def test_layers_that_compute_otherwise_keep_their_modules(model_type, config, reason):
    model = _model(model_type, **config)
    assert reason in fuse_generic_layers(model)
    assert not _patched(model)  # every patch undone
    assert model.training  # as it was


def test_fused_generic_layers_train_like_hf_peft(tmp_path):
    """Granite (no record) through FastModel: the layers, MLP included, are slothkit's, and
    8 steps give HF + PEFT's losses and adapters."""
    path = tmp_path / "granite"
    _model("granite", attention_multiplier=0.05, embedding_multiplier=2.0).cpu().save_pretrained(path)
    build_tiny_tokenizer("bpe", path)
    with pytest.warns(UserWarning, match="slothkit's fused norms, attention and residual sums"):
        model, _ = FastModel.from_pretrained(str(path), dtype=torch.float32, load_in_4bit=False, fused=True)
    fast = FastModel.get_peft_model(model, r=8, lora_alpha=16, use_gradient_checkpointing=False)
    assert patched_module(fast.get_base_model().model.layers[0].mlp) is not None
    assert_trains_as_hf_peft_does(fast, path, DEVICE)


def test_gpt_oss_attention_runs_fused_and_trains_like_hf_peft(tmp_path, monkeypatch):
    """gpt-oss (no record) through FastModel: its attention, with its sinks, biased q/k/v/o
    and alternating sliding (4 positions) and full layers, is slothkit's tiled attention,
    and 4 steps on a left-padded batch give HF + PEFT's losses, first gradients and
    adapters. The sinks and biases are drawn at order one so that they count; the experts
    are few and narrow, as the Triton interpreter runs them slowly."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from slothkit.engine import decoder

    path, model, generator = _gpt_oss_checkpoint(tmp_path, seed=5)
    assert model.config.layer_types == ["sliding_attention", "full_attention"]

    tiled_calls = []
    tiled_attention = decoder.tiled_attention

    def counted(*args, **kwargs):
        tiled_calls.append(args[7] is not None)  # the sinks reach the kernel
        return tiled_attention(*args, **kwargs)

    monkeypatch.setattr(decoder, "tiled_attention", counted)
    attention = ["q_proj", "k_proj", "v_proj", "o_proj"]
    model, _ = FastModel.from_pretrained(str(path), dtype=torch.float32, load_in_4bit=False, fused=True)
    fast = FastModel.get_peft_model(
        model, r=8, lora_alpha=16, target_modules=attention, use_gradient_checkpointing=False
    )
    layers = fast.get_base_model().model.layers
    assert all(patched_module(layer.self_attn) is not None for layer in layers)
    assert not any(layer.self_attn.sinks.requires_grad for layer in layers)  # frozen under LoRA
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    torch.manual_seed(3407)
    plain = (
        get_peft_model(plain, LoraConfig(r=8, lora_alpha=16, task_type="CAUSAL_LM", target_modules=attention))
        .train()
        .to(DEVICE)
    )
    with torch.no_grad():
        for (name, p), (_, q) in zip(sorted(fast.named_parameters()), sorted(plain.named_parameters())):
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.05)
                q.copy_(p)

    ids = torch.randint(3, 500, (2, 10), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding, which the loss skips
    labels = ids.masked_fill(mask == 0, -100)
    losses, first_gradients = {}, {}
    for label, model in (("fast", fast), ("plain", plain)):
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-3)
        losses[label] = []
        for step in range(4):
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            if step == 0:
                first_gradients[label] = {
                    n: p.grad.clone() for n, p in model.named_parameters() if "lora_" in n
                }
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses[label].append(loss.item())
    assert tiled_calls and all(tiled_calls)
    assert losses["plain"][-1] < losses["plain"][0]
    torch.testing.assert_close(torch.tensor(losses["fast"]), torch.tensor(losses["plain"]), rtol=1e-5, atol=0)
    for name, gradient in first_gradients["plain"].items():
        torch.testing.assert_close(first_gradients["fast"][name], gradient, rtol=1e-5, atol=1e-7, msg=name)
    plain_state = plain.state_dict()
    for name, value in fast.state_dict().items():
        if "lora_" in name:
            # Adam divides each step by the gradient's running size, so an entry whose
            # gradient is near zero moves by its rounding's share of the learning rate.
            torch.testing.assert_close(value, plain_state[name], rtol=1e-5, atol=1e-5, msg=name)


def test_fused_gpt_oss_generates_like_hf(tmp_path, monkeypatch):
    """Hugging Face's generate over the fused gpt-oss (it has no record, so slothkit's fast
    decode loop does not take it): the prompt runs the tiled attention with the sinks, each
    new token gpt-oss's own eager attention over the cache, and 6 greedy tokens past a
    prompt longer than the sliding window equal those of the unpatched model."""
    from transformers import AutoModelForCausalLM

    from slothkit.engine import decoder

    path, model, _ = _gpt_oss_checkpoint(tmp_path, seed=6)
    tiled_calls = []
    tiled_attention = decoder.tiled_attention

    def counted(*args, **kwargs):
        tiled_calls.append(args[7] is not None)
        return tiled_attention(*args, **kwargs)

    monkeypatch.setattr(decoder, "tiled_attention", counted)
    fast, _ = FastModel.from_pretrained(str(path), dtype=torch.float32, load_in_4bit=False, fused=True)
    assert all(patched_module(layer.self_attn) is not None for layer in fast.model.layers)
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(DEVICE).eval()
    prompt = torch.randint(3, 500, (1, 9), generator=torch.Generator().manual_seed(7)).to(DEVICE)
    settings = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    tiled_calls.clear()  # the loading check's calls
    with torch.no_grad():
        ours = fast.eval().generate(input_ids=prompt, **settings)
        theirs = plain.generate(input_ids=prompt, **settings)
    assert tiled_calls == [True, True]  # the prompt, in each of the two layers
    assert ours.tolist() == theirs.tolist()


def test_a_nan_anywhere_makes_the_largest_difference_nan():
    """A NaN output fails a check wherever it falls among the outputs compared (Python's
    max keeps a NaN only in first place)."""
    own = [torch.randn(4, 8) for _ in range(3)]
    close = [o + 1e-3 * torch.randn(4, 8) for o in own]
    assert 0 < largest_difference(close, own) < 1e-2
    for place in range(3):
        fused = [o.clone() for o in close]
        fused[place][1, 2] = float("nan")
        assert largest_difference(fused, own) != largest_difference(fused, own)  # NaN
    assert largest_difference(close[:2], own) == float("inf")
