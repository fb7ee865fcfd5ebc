"""Fast decode of Gemma 4 text models (slothkit.inference.gemma4_step) against Hugging
Face's generate on the same model, fp32, greedy tokens identical: the tiny gemma4_text
checkpoint of slothkit.testing (per-layer input embeddings, the last two layers reusing
the keys and values of the sliding and the full layer before them, double-wide MLPs
there, full layers with wider heads, a sliding window of 8 shorter than the prompts), the
tiny image-text Gemma 4 loaded as its text model, and a 26B-A4B-like layout (experts
beside the MLP, full layers whose values are their keys' projection, with one key/value
head of their own).  LoRA on every projection PEFT adapts, with random B.

The weights are redrawn at ten times transformers' scale, the norms' and layer scalars'
around 1, so that every part moves the greedy tokens: the same comparison fails for a
step without the per-layer inputs, or with the sharing layers reading the wrong
key/value heads (test_the_comparison_sees_each_trait).  On a CPU the loop runs without the CUDA
graph; the CUDA tests run it with the graph at batch 1 and 8."""

import pytest
import torch

import slothkit.inference.gemma4_step as gemma4_step
from slothkit import FastModel
from slothkit.core.model_state import state_of
from slothkit.core.notices import FallbackWarning, say_once
from slothkit.testing import build_tiny_tokenizer, tiny_image_text_path
from slothkit.testing.tiny_generic_models import tiny_generic_model_path

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROMPT, NEW_TOKENS = 12, 12  # both past the tiny checkpoint's sliding window of 8


@pytest.fixture(autouse=True)
def fresh_notices():
    say_once.cache_clear()


def _redraw(model, seed: int) -> None:
    """Matrices N(0, 0.1^2), vectors (norm weights, router scales) and layer scalars
    around 1, from ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, parameter in sorted(model.named_parameters()):
            if parameter.dim() >= 2:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
            else:
                parameter.copy_(1.0 + 0.3 * torch.randn(parameter.shape, generator=generator))
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):
                buffer.copy_(0.5 + torch.rand(buffer.shape, generator=generator))


def _load(path, seed: int = 3):
    model, _ = FastModel.from_pretrained(
        str(path), max_seq_length=256, dtype=torch.float32, load_in_4bit=False
    )
    _redraw(model, seed)
    model = FastModel.get_peft_model(model, r=8, lora_alpha=16, use_gradient_checkpointing=False)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # PEFT starts B at zero: give every adapter an effect
        for name, parameter in sorted(model.named_parameters()):
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)
    return model.to(DEVICE)


def _prompts(batch: int, pad_rows: int = 0):
    ids = torch.randint(3, 500, (batch, PROMPT), generator=torch.Generator().manual_seed(batch))
    mask = torch.ones_like(ids)
    for row in range(pad_rows):  # left padding of 1 .. pad_rows tokens
        mask[row, : row + 1] = 0
        ids[row, : row + 1] = 0
    return ids.to(DEVICE), mask.to(DEVICE)


def _hf_then_fast(model, batch: int, pad_rows: int):
    ids, mask = _prompts(batch, pad_rows)
    settings = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    FastModel.for_inference(model, fast_decode=False)
    expected = model.generate(input_ids=ids, attention_mask=mask, **settings)
    FastModel.for_inference(model, fast_decode=True)
    got = model.generate(input_ids=ids, attention_mask=mask, **settings)
    assert state_of(model).fast_decoder.cache is not None, "the fast loop did not run"
    return expected, got


def _assert_greedy_equal(model, batch: int, pad_rows: int = 0) -> None:
    expected, got = _hf_then_fast(model, batch, pad_rows)
    assert torch.equal(got, expected), f"first difference at {(got != expected).nonzero()[:1].tolist()}"


@pytest.fixture(scope="module")
def tiny_path():
    return tiny_generic_model_path("gemma4_text")


@pytest.mark.parametrize(("batch", "pad_rows"), [(1, 0), (3, 2)])
def test_greedy_generation_is_hf_peft_s(tiny_path, batch, pad_rows):
    """One prompt and a left-padded batch of 3: the fast loop's greedy tokens are Hugging
    Face's generate's, and the cache holds the two layers that compute keys and values
    only (a sliding ring of 8 slots with heads of 16, a full layer with heads of 32)."""
    model = _load(tiny_path)
    _assert_greedy_equal(model, batch, pad_rows)
    cache = state_of(model).fast_decoder.cache
    shapes = [tuple(keys.shape) for keys in cache.keys]
    assert shapes == [(batch, 2, 8, 16), (batch, 2, cache.slots, 32)]


def _without_per_layer_inputs(monkeypatch):
    per_layer_inputs = gemma4_step.Gemma4Step._per_layer_inputs
    monkeypatch.setattr(
        gemma4_step.Gemma4Step,
        "_per_layer_inputs",
        lambda step, input_ids, hidden: torch.zeros_like(per_layer_inputs(step, input_ids, hidden)),
    )


def _sharing_layers_read_other_heads(monkeypatch):
    """The layers that reuse keys and values read their storing layer's key/value heads in
    the other order (query head h reading another key/value head than h // G's)."""
    attend = gemma4_step._StepAttention.__call__

    def swapped(self, q, keys, values, projections, ring):
        if projections.cache_layer is None:
            keys, values = keys.flip(1), values.flip(1)
        return attend(self, q, keys, values, projections, ring)

    monkeypatch.setattr(gemma4_step._StepAttention, "__call__", swapped)


@pytest.mark.parametrize("broken", [_without_per_layer_inputs, _sharing_layers_read_other_heads])
def test_the_comparison_sees_each_trait(tiny_path, monkeypatch, broken):
    """A step without the per-layer inputs, or whose sharing layers read their storing
    layer's key/value heads in the wrong order, gives other tokens than Hugging Face's generate:
    the comparison above can fail."""
    model = _load(tiny_path)
    broken(monkeypatch)
    expected, got = _hf_then_fast(model, 3, 2)
    assert not torch.equal(got, expected)


def test_image_text_gemma4_decodes_as_its_text_model(monkeypatch):
    """The tiny image-text Gemma 4, which FastModel loads as its text model: the fast
    loop's greedy tokens are Hugging Face's generate's for a left-padded batch."""
    model = _load(tiny_image_text_path("gemma4"), seed=7)
    assert model.config.model_type == "gemma4_text"
    _assert_greedy_equal(model, 3, 2)


def _experts_checkpoint(path, activation: str):
    """A tiny 26B-A4B-like Gemma 4: 8 experts of width 32, 2 per token, beside each MLP;
    full layers whose values are their keys' projection (attention_k_eq_v) with one
    key/value head of 32 (the sliding layers: two of 16); no per-layer inputs, no sharing."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "gemma4_text", hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
        attention_k_eq_v=True, vocab_size=512, max_position_embeddings=2048, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"] * 2, hidden_size_per_layer_input=0,
        enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=32,
        hidden_activation=activation, pad_token_id=0, final_logit_softcapping=30.0,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    build_tiny_tokenizer("bpe", path)
    return path


@pytest.mark.parametrize("activation", ["gelu_pytorch_tanh", "silu", "gelu"])
def test_experts_beside_the_mlp_decode_as_hf_peft_s(tmp_path, monkeypatch, activation):
    """The 26B-A4B-like layout with LoRA on attention, MLP and experts: greedy tokens are
    Hugging Face's generate's for a left-padded batch.  Experts of Gemma 4's GELU-tanh
    (and of SiLU) are read by decode_experts' chosen experts in every one-row-per-token
    step; experts of exact GELU, which the fused experts do not compute, run their
    module's own forward, said once."""
    rows = []
    chosen = gemma4_step.chosen_experts

    def counted(call, adapters, x, weights, ids):
        rows.append(x.shape[0])
        return chosen(call, adapters, x, weights, ids)

    monkeypatch.setattr(gemma4_step, "chosen_experts", counted)
    model = _load(_experts_checkpoint(tmp_path / "moe", activation))
    if activation == "gelu":
        with pytest.warns(FallbackWarning, match="decode step runs .* own experts forward.*GELUActivation"):
            _assert_greedy_equal(model, 3, 2)
    else:
        _assert_greedy_equal(model, 3, 2)
    cache = state_of(model).fast_decoder.cache
    assert [tuple(keys.shape[1:]) for keys in cache.keys][:2] == [(2, 8, 16), (1, cache.slots, 32)]
    if activation == "gelu":
        assert rows == []
    elif DEVICE == "cpu":
        assert rows == [3] * 4 * (NEW_TOKENS - 1)


def test_bidirectional_text_attention_keeps_hf_generate(tiny_path):
    """use_bidirectional_attention="all" (every token attends both ways) is not a causal
    decoder: for_inference leaves generate to Hugging Face, saying why."""
    model = _load(tiny_path)
    model.config.use_bidirectional_attention = "all"
    with pytest.warns(FallbackWarning, match="bidirectionally"):
        FastModel.for_inference(model, fast_decode=True)
    assert state_of(model).fast_decoder is None


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("experts", [None, "silu", "gelu_pytorch_tanh"])
def test_captured_decode_is_hf_peft_s_on_a_gpu(tiny_path, tmp_path, batch, experts):
    """On a GPU, the step captured as a CUDA graph (RoPE and the cache write in one launch
    for the layers that keep keys and values; the SiLU and the GELU-tanh experts through
    expert_gemv): greedy tokens at batch 1 and 8 (half of the
    rows left-padded) are Hugging Face's generate's, fp32."""
    path = tiny_path if experts is None else _experts_checkpoint(tmp_path / "moe", experts)
    model = _load(path)
    _assert_greedy_equal(model, batch, batch // 2)
    assert state_of(model).fast_decoder.captured.graph is not None
