"""Fast decode of mixture-of-experts models (slothkit.inference.decode_experts) against
Hugging Face's generate on the same model: tiny random Qwen3-MoE, gpt-oss (attention
sinks and biases, sliding and full layers, a router and experts with biases, the clamped
SwiGLU, half-width rotary tables) and Mixtral, with LoRA on their attention and on their
experts' 3-D parameters (random B, so every expert's adapter counts), greedy tokens
identical; 16-bit experts on the module's own forward, and 4-bit ones (NF4, read by
slothkit's fused experts in Hugging Face's generate, by the gathered dequantisation in the
decode step).  On a CPU the loop runs without the CUDA graph; the CUDA test runs it with
the graph at batch 1 and 8."""

import pytest
import torch

import slothkit.inference.decode_experts as decode_experts
from slothkit import FastModel
from slothkit.core.model_state import state_of
from slothkit.core.notices import say_once
from slothkit.testing import build_tiny_tokenizer

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Hidden and expert widths multiples of 64: bitsandbytes' CPU kernel for the 4-bit
# attention needs whole blocks of 64 per row.
SIZES = dict(
    hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=3,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512,
    max_position_embeddings=4096, pad_token_id=0, norm_topk_prob=True,
)  # fmt: skip


@pytest.fixture(autouse=True)
def fresh_notices():
    say_once.cache_clear()


@pytest.fixture
def gathered_steps(monkeypatch):
    """The number of tokens of each call of the gathered experts."""
    tokens = []
    gathered = decode_experts.chosen_experts

    def counting(call, adapters, x, weights, ids):
        tokens.append(x.shape[0])
        return gathered(call, adapters, x, weights, ids)

    monkeypatch.setattr(decode_experts, "chosen_experts", counting)
    return tokens


# What each family's tiny checkpoint changes from SIZES.  gpt-oss slides every second
# layer over 4 positions (shorter than the prompts, so the window matters); its sinks and
# biases are random (transformers starts them at zero, which would not tell a missing one
# from a present one) and its weights ten times the usual scale, so that attention moves
# the greedy tokens: a decode step without the sinks gives other tokens.
FAMILIES = {
    "qwen3_moe": {},
    "gpt_oss": {
        "num_local_experts": 8,
        "sliding_window": 4,
        "num_hidden_layers": 4,
        "initializer_range": 0.2,
    },
    "mixtral": {"num_local_experts": 8, "intermediate_size": 32},
}


def _checkpoint(path, family: str = "qwen3_moe", **extra):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(family, **{**SIZES, **FAMILIES[family], **extra})
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("sinks") or name.endswith("bias"):
                parameter.normal_(0.0, 1.0)
    model.save_pretrained(path)
    build_tiny_tokenizer("bpe", path)
    return path


def _with_lora(model, seed: int):
    model = FastModel.get_peft_model(model, r=8, lora_alpha=16, use_gradient_checkpointing=False)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # PEFT starts B at zero: give every adapter an effect
        for name, parameter in sorted(model.named_parameters()):
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)
    return model


def _load(path, load_in_4bit: bool, dtype=torch.float32):
    # 16-bit: the experts module's own forward (fused=False), so that Hugging Face's
    # generate runs transformers' and PEFT's code; 4-bit experts only slothkit's fused
    # experts read.
    model, _ = FastModel.from_pretrained(
        str(path), max_seq_length=512, dtype=dtype, load_in_4bit=load_in_4bit, fused=load_in_4bit
    )
    return _with_lora(model, seed=5)


def _hf_then_fast(model, **kwargs):
    FastModel.for_inference(model, fast_decode=False)
    expected = model.generate(**kwargs)
    FastModel.for_inference(model, fast_decode=True)
    got = model.generate(**kwargs)
    assert state_of(model).fast_decoder.cache is not None, "the fast loop did not run"
    return expected, got


def _prompts(batch: int, length: int, pad_rows: int = 0):
    ids = torch.randint(3, 500, (batch, length), generator=torch.Generator().manual_seed(batch + length))
    mask = torch.ones_like(ids)
    for row in range(pad_rows):  # left padding of 1 .. pad_rows tokens
        mask[row, : row + 1] = 0
        ids[row, : row + 1] = 0
    return ids.to(DEVICE), mask.to(DEVICE)


def _assert_greedy_equal(model, batch: int, length: int, new_tokens: int, pad_rows: int = 0):
    ids, mask = _prompts(batch, length, pad_rows)
    settings = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    expected, got = _hf_then_fast(model, input_ids=ids, attention_mask=mask, **settings)
    assert torch.equal(got, expected), f"first difference at {(got != expected).nonzero()[:1].tolist()}"


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("gemv", ["gathered", "kernel"])
def test_router_and_chosen_experts_are_the_blocks_own(tmp_path, monkeypatch, gemv, family):
    """One MoE block, 5 tokens: the chosen experts with their adapters give the block's
    output (transformers' router and experts, PEFT's wrappers) within fp32 rounding, and
    each expert's adapter changes it; with the CPU's gather and batched matmul, and with
    the GPU's kernel (slothkit_kernels.moe.expert_gemv, under the Triton interpreter)."""
    from slothkit_kernels.moe import expert_gemv
    from slothkit_kernels.utils import interpreter_enabled

    if gemv == "kernel":
        if DEVICE == "cpu" and not interpreter_enabled():
            pytest.skip("the kernel runs on a GPU or under the Triton interpreter")
        monkeypatch.setattr(decode_experts, "expert_gemv_reference", expert_gemv)
    model = _load(_checkpoint(tmp_path / "moe", family), load_in_4bit=False)
    block = model.base_model.model.model.layers[1].mlp
    x = torch.randn(1, 5, SIZES["hidden_size"], generator=torch.Generator().manual_seed(2)).to(DEVICE)
    decode = decode_experts.DecodeExperts(block, torch.float32)
    assert decode.call.gate_up_lora is not None and decode.call.down_lora is not None
    with torch.no_grad():
        expected = block(x)
        expected = expected[0] if isinstance(expected, tuple) else expected  # gpt-oss adds its scores
        got = decode(x)
        with model.disable_adapter():
            without = decode_experts.DecodeExperts(block, torch.float32)(x)
    scale = expected.abs().max().item()
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5 * scale)
    assert (without - expected).abs().max() > 1e-2 * scale


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize(("batch", "length", "pad_rows"), [(1, 6, 0), (3, 12, 2)])
def test_greedy_generation_is_hf_peft_s(tmp_path, gathered_steps, batch, length, pad_rows, family):
    """LoRA on attention and experts: the fast loop's greedy tokens are Hugging Face's
    generate's, for one prompt (its prefill of 6 tokens gathered too) and a left-padded
    batch of 3 (its prefill of 36 tokens through the block's own forward)."""
    model = _load(_checkpoint(tmp_path / "moe", family), load_in_4bit=False)
    _assert_greedy_equal(model, batch, length, new_tokens=12, pad_rows=pad_rows)
    layers = FAMILIES[family].get("num_hidden_layers", SIZES["num_hidden_layers"])
    prefill = [batch * length] * layers if batch * length <= decode_experts.GATHER_ROWS else []
    _assert_gathered(gathered_steps, prefill, batch, layers, decode_steps=11)


@pytest.mark.parametrize(("batch", "length", "pad_rows"), [(1, 6, 0), (3, 7, 2)])
def test_gpt_oss_prefill_through_the_tiled_kernel_with_sinks(tmp_path, monkeypatch, batch, length, pad_rows):
    """gpt-oss's prefill as a GPU runs it, through slothkit's tiled attention with the
    sinks (under the Triton interpreter on a CPU), unpadded and left-padded: greedy tokens
    are Hugging Face's generate's, and every layer's prefill took the kernel."""
    from slothkit.inference import model_step
    from slothkit_kernels import attention
    from slothkit_kernels.utils import interpreter_enabled

    if DEVICE == "cpu" and not interpreter_enabled():
        pytest.skip("the kernel runs on a GPU or under the Triton interpreter")
    sinks_seen = []

    def counted(q, k, v, scaling, mask, softcap, window, sinks=None):
        if q.shape[2] > 1:
            sinks_seen.append(sinks is not None)
        return attention(q, k, v, scaling, mask, softcap, window, sinks)

    monkeypatch.setattr(model_step, "_tiled_prefill_attention", lambda q: True)
    monkeypatch.setattr(model_step, "attention", counted)
    model = _load(_checkpoint(tmp_path / "oss", "gpt_oss"), load_in_4bit=False)
    _assert_greedy_equal(model, batch, length, new_tokens=6, pad_rows=pad_rows)
    assert sinks_seen == [True] * FAMILIES["gpt_oss"]["num_hidden_layers"]


def _assert_gathered(
    steps: list[int], prefill: list[int], batch: int, layers: int, decode_steps: int
) -> None:
    """On a CPU every step runs eagerly, so every call of the gathered experts is seen: the
    prefill's, then each decode step's.  On a GPU the decode step is captured as a CUDA
    graph before the prefill (two warm-up runs and the capture, each calling every layer's
    experts) and then replayed unseen, so the calls are those three, then the prefill's."""
    if DEVICE == "cpu":
        assert steps == prefill + [batch] * layers * decode_steps
    else:
        assert steps == [batch] * layers * 3 + prefill


def test_expert_adapters_trained_in_place_between_calls_are_seen(tmp_path):
    """The experts' B changed in place after a fast generate (as an optimizer step does):
    the next call of the same decoder reads the new values, giving Hugging Face's tokens."""
    model = _load(_checkpoint(tmp_path / "moe"), load_in_4bit=False)
    ids, mask = _prompts(1, 5)
    settings = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    FastModel.for_inference(model, fast_decode=True)
    before = model.generate(**settings)
    decoder = state_of(model).fast_decoder
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "experts" in name and "lora_B" in name:
                parameter.mul_(-4.0)
    got = model.generate(**settings)
    assert state_of(model).fast_decoder is decoder
    FastModel.for_inference(model, fast_decode=False)
    expected = model.generate(**settings)
    assert torch.equal(got, expected) and not torch.equal(got, before)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_4bit_experts_decode_as_hf_generate_over_the_fused_experts(tmp_path, gathered_steps, family):
    """NF4 experts (quantised by slothkit at loading) and NF4 attention: the decode step
    dequantises the chosen experts only, and its greedy tokens are those of Hugging Face's
    generate over slothkit's fused experts."""
    pytest.importorskip("bitsandbytes")
    from slothkit.core.inspection import nf4_experts_of
    from slothkit.engine.experts import experts_base, experts_modules

    model = _load(_checkpoint(tmp_path / "moe", family), load_in_4bit=True)
    assert all(nf4_experts_of(experts_base(m)[0].gate_up_proj) for m in experts_modules(model))
    _assert_greedy_equal(model, 1, 4, new_tokens=5)
    layers = FAMILIES[family].get("num_hidden_layers", SIZES["num_hidden_layers"])
    _assert_gathered(gathered_steps, [4] * layers, batch=1, layers=layers, decode_steps=4)


def test_nf4_select_dequantises_the_chosen_experts_as_the_whole_record(tmp_path):
    """NF4Experts.select: the chosen experts (repeats and any order) dequantise to the rows
    of the whole record's dequantisation."""
    from slothkit_kernels.moe import dequantize_nf4_experts, quantize_nf4_experts

    weight = torch.randn(6, 64, 32, generator=torch.Generator().manual_seed(4))
    record = quantize_nf4_experts(weight)
    ids = torch.tensor([4, 0, 4, 5, 2])
    torch.testing.assert_close(
        dequantize_nf4_experts(record.select(ids)), record.dequantize()[ids], rtol=0, atol=0
    )


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("load_in_4bit", [False, True])
@pytest.mark.parametrize("batch", [1, 8])
def test_captured_decode_is_hf_peft_s_on_a_gpu(tmp_path, batch, load_in_4bit, family):
    """On a GPU, with the step captured as a CUDA graph (the experts through expert_gemv,
    gpt-oss's prefill through the tiled attention with its sinks), fp32: the fast loop's
    greedy tokens at batch 1 and 8 are Hugging Face's generate's, with 16-bit and with NF4
    experts."""
    if load_in_4bit:
        pytest.importorskip("bitsandbytes")
    model = _load(_checkpoint(tmp_path / "moe", family), load_in_4bit=load_in_4bit)
    _assert_greedy_equal(model, batch, 5, new_tokens=24, pad_rows=batch // 2)
    assert state_of(model).fast_decoder.captured.graph is not None
