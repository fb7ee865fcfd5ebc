"""Fast decode of Qwen3.5 (slothkit.inference.decode_deltanet: gated DeltaNet layers through
a recurrent state and the convolution's last inputs; model_step.py: the gated attention
with its partial rotary) against Hugging Face's generate and forward on the same tiny
random model: three DeltaNet layers and one attention layer, weights at ten times the usual
scale and random norm weights so that every part moves the tokens (a step without its
convolution state or its recurrent state gives other logits: checked below).  fp32, with
LoRA on every projection, DeltaNet ones included; Qwen3.5-MoE's blocks (routed experts and a
shared one) too.  On a CPU the loop runs without the CUDA graph; the CUDA test runs it
with the graph at batch 1 and 8, through a cache that grows."""

import pytest
import torch

from slothkit import FastModel
from slothkit.core.model_state import state_of
from slothkit.core.notices import say_once
from slothkit.inference import decode_deltanet, fast_decoder
from slothkit.testing import build_tiny_tokenizer

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SIZES = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=16, linear_conv_kernel_dim=4, vocab_size=512, max_position_embeddings=4096,
    layer_types=["linear_attention"] * 3 + ["full_attention"], pad_token_id=0, initializer_range=0.2,
)  # fmt: skip
TARGETS = [
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
    "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj",
]  # fmt: skip


@pytest.fixture(autouse=True)
def fresh_notices():
    say_once.cache_clear()


@pytest.fixture
def reference_delta_rule(monkeypatch):
    """On a CPU, prefills through the delta rule's per-token reference: its kernel costs
    seconds a prefill under the Triton interpreter; it runs in the logits test (and in
    every test on a GPU)."""
    from slothkit_kernels.delta_rule import gated_delta_rule_reference

    if DEVICE == "cpu":
        monkeypatch.setattr(decode_deltanet, "gated_delta_rule", gated_delta_rule_reference)


# Qwen3.5-MoE: every layer's MLP a block of 8 routed experts (2 chosen) and a shared one.
MOE_SIZES = dict(
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32
)


def _checkpoint(path, model_type: str, **extra):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **SIZES, **extra))
    with torch.no_grad():  # transformers starts Qwen3.5's (1 + w) norms at w = 0
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.normal_(0.0, 0.3)
    model.save_pretrained(path)
    build_tiny_tokenizer("bpe", path)
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return _checkpoint(tmp_path_factory.mktemp("qwen3_5"), "qwen3_5_text")


def _load(path, lora: bool = True):
    model, _ = FastModel.from_pretrained(
        str(path), max_seq_length=512, dtype=torch.float32, load_in_4bit=False, fused=False
    )
    model.to(DEVICE)
    if lora:
        model = FastModel.get_peft_model(
            model, r=4, lora_alpha=8, target_modules=TARGETS, use_gradient_checkpointing=False
        )
        generator = torch.Generator().manual_seed(5)
        with torch.no_grad():  # PEFT starts B at zero: give every adapter an effect
            for name, parameter in sorted(model.named_parameters()):
                if "lora_B" in name:
                    parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)
        adapted = {name.split(".")[-4] for name, _ in model.named_parameters() if "lora_A" in name}
        assert set(TARGETS) <= adapted, f"adapted {sorted(adapted)}"
    return model


def _prompts(batch: int, length: int, pad_rows: int = 0):
    """Random prompts, row r < pad_rows left-padded by 2 r + 1 tokens (past the
    convolution's width from row 2 on).  The padding keeps its random tokens: the pad
    token's embedding row is zero, which would hide a layer that lets padding in."""
    ids = torch.randint(3, 500, (batch, length), generator=torch.Generator().manual_seed(batch + length))
    mask = torch.ones_like(ids)
    for row in range(pad_rows):
        mask[row, : 2 * row + 1] = 0
    return ids.to(DEVICE), mask.to(DEVICE)


def _hf_then_fast(model, **kwargs):
    FastModel.for_inference(model, fast_decode=False)
    expected = model.generate(**kwargs)
    FastModel.for_inference(model, fast_decode=True)
    got = model.generate(**kwargs)
    assert state_of(model).fast_decoder.cache is not None, "the fast loop did not run"
    return expected, got


def _assert_greedy_equal(model, batch: int, length: int, new_tokens: int, pad_rows: int = 0):
    ids, mask = _prompts(batch, length, pad_rows)
    settings = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    expected, got = _hf_then_fast(model, input_ids=ids, attention_mask=mask, **settings)
    assert torch.equal(got, expected), f"first difference at {(got != expected).nonzero()[:1].tolist()}"


@pytest.mark.parametrize("lora", [False, True], ids=["base", "lora"])
def test_greedy_tokens_equal_hf_generate(checkpoint, reference_delta_rule, lora):
    """One prompt and a left-padded batch of 3: the fast loop's greedy tokens are Hugging
    Face's generate's."""
    model = _load(checkpoint, lora)
    _assert_greedy_equal(model, 1, 9, new_tokens=12)
    _assert_greedy_equal(model, 3, 9, new_tokens=12, pad_rows=2)
    cache = state_of(model).fast_decoder.cache
    assert len(cache.keys) == 1, "the KV cache keeps the attention layer only"
    assert len(cache.linear_states.recurrent) == 3


def test_moe_variant_greedy_tokens_equal_hf_generate(tmp_path, reference_delta_rule):
    """Qwen3.5-MoE (its blocks through decode_experts.py, the shared expert added): the
    greedy tokens of one prompt and a left-padded batch are Hugging Face's generate's."""
    model = _load(_checkpoint(tmp_path, "qwen3_5_moe_text", **MOE_SIZES))
    _assert_greedy_equal(model, 1, 9, new_tokens=12)
    _assert_greedy_equal(model, 3, 9, new_tokens=12, pad_rows=2)
    step = state_of(model).fast_decoder.step
    assert all(type(layer.mlp).__name__ == "DecodeExperts" for layer in step.decode_layers)


def test_the_cache_grows_with_the_states_handed_over(checkpoint, reference_delta_rule, monkeypatch):
    """A cache that starts with room for 8 new tokens (slots rounded to 16) and doubles as
    the decode reaches its end hands the DeltaNet states to the longer cache as they are:
    the greedy tokens of a left-padded batch still equal Hugging Face's."""
    monkeypatch.setattr(fast_decoder, "SLOT_ROUNDING", 16)
    monkeypatch.setattr(fast_decoder, "FIRST_NEW_TOKENS", 8)
    handed = []
    grow = fast_decoder.FastDecoder._grow

    def recorded(decoder, slots):
        before = decoder.cache.linear_states
        grow(decoder, slots)
        handed.append(decoder.cache.linear_states is before)

    monkeypatch.setattr(fast_decoder.FastDecoder, "_grow", recorded)
    model = _load(checkpoint)
    _assert_greedy_equal(model, 3, 9, new_tokens=28, pad_rows=2)
    assert handed and all(handed), f"grew {len(handed)} times, states handed over: {handed}"


def test_recurrent_step_is_the_delta_rule_s_next_token():
    """One step from a random state (2 key heads serving 4 value heads, dk 16, dv 24)
    gives the reference recurrence's output and final state for that token, to fp32
    rounding (sums of 16 products: 1e-5 of values of order 1)."""
    from slothkit_kernels.delta_rule import gated_delta_rule_reference
    from slothkit_kernels.delta_rule.reference import prepare_queries_and_keys

    generator = torch.Generator().manual_seed(3)
    query, key = (torch.randn(2, 1, 2, 16, generator=generator) for _ in range(2))
    value = torch.randn(2, 1, 4, 24, generator=generator)
    g = -torch.rand(2, 1, 4, generator=generator)
    beta = torch.rand(2, 1, 4, generator=generator)
    state = torch.randn(2, 4, 16, 24, generator=generator)
    expected, expected_state = gated_delta_rule_reference(
        query, key, value, g, beta, state, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    prepared_query, prepared_key = prepare_queries_and_keys(query, key, use_qk_l2norm_in_kernel=True)
    got = decode_deltanet.recurrent_step(
        state, prepared_query[:, 0], prepared_key[:, 0], value[:, 0], g[:, 0], beta[:, 0]
    )
    torch.testing.assert_close(got, expected[:, 0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, expected_state, atol=1e-5, rtol=1e-5)


def _step_logits(model, ids, mask, prompt: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode's logits (B, T - prompt + 1, V): the prefill's last, then each step's
    over the given tokens, and the model's forward over the whole sequence at the same
    positions."""
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    with torch.no_grad():
        reference = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits.float()
    decoder = fast_decoder.FastDecoder(model.get_base_model(), False, use_graph=False)
    cache = decoder._new_cache(ids.shape[0], 32, ids.device)
    cache.reset(mask[:, :prompt])
    first = torch.zeros(1, dtype=torch.long, device=ids.device)
    causal = bool(mask[:, :prompt].all())
    logits = [
        decoder.step(ids[:, :prompt], positions[:, :prompt], cache, first, visible=prompt, causal=causal)
    ]
    for slot in range(prompt, ids.shape[1]):
        slot = torch.tensor([slot], device=ids.device)
        cache.mark(slot)
        logits.append(decoder.step(ids[:, slot], positions[:, slot], cache, slot))
    return torch.stack(logits, dim=1), reference[:, prompt - 1 :]


def test_step_logits_equal_the_model_forward_and_need_both_states(checkpoint, monkeypatch):
    """A left-padded batch's prefill (the delta rule's kernel, under the Triton
    interpreter on a CPU) and 6 one-token steps give the logits of the model's forward
    over the whole sequence (fp32 rounding); a step that forgets the convolution's inputs,
    or the recurrent state, gives logits far from them."""
    from slothkit_kernels.delta_rule import gated_delta_rule_reference

    model = _load(checkpoint)
    model.eval()
    ids, mask = _prompts(3, 15, pad_rows=3)
    prompt = 9
    got, expected = _step_logits(model, ids, mask, prompt)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    scale = expected.abs().max()

    convolve = decode_deltanet.DecodeDeltaNet._convolve
    calls = decode_deltanet.DecodeDeltaNet.__call__

    def without_conv_state(self, mixed, conv_state):
        if mixed.shape[-1] == 1:
            conv_state.zero_()
        return convolve(self, mixed, conv_state)

    def without_recurrent_state(self, x, states, real):
        if x.shape[1] == 1:
            states.recurrent[self.index].zero_()
        return calls(self, x, states, real)

    for broken in (("_convolve", without_conv_state), ("__call__", without_recurrent_state)):
        with monkeypatch.context() as patch:
            patch.setattr(decode_deltanet, "gated_delta_rule", gated_delta_rule_reference)
            patch.setattr(decode_deltanet.DecodeDeltaNet, *broken)
            wrong, _ = _step_logits(model, ids, mask, prompt)
        assert (wrong[:, 1:] - expected[:, 1:]).abs().max() > 0.05 * scale, f"{broken[0]} changed nothing"


def test_sampling_draws_what_hf_generate_draws(checkpoint, reference_delta_rule):
    """Sampling a left-padded batch from the same seed: the fast loop's tokens are Hugging
    Face's generate's."""
    model = _load(checkpoint)
    ids, mask = _prompts(3, 9, pad_rows=2)
    settings = dict(max_new_tokens=12, do_sample=True, temperature=0.9, top_k=40, pad_token_id=0)
    results = []
    for fast in (False, True):
        FastModel.for_inference(model, fast_decode=fast)
        torch.manual_seed(13)
        results.append(model.generate(input_ids=ids, attention_mask=mask, **settings))
    assert state_of(model).fast_decoder.cache is not None, "the fast loop did not run"
    assert torch.equal(results[1], results[0])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("batch", [1, 8])
def test_captured_decode_is_hf_s_on_a_gpu(checkpoint, tmp_path, monkeypatch, batch, moe):
    """On a GPU, with the step captured as a CUDA graph (the prefill through the delta
    rule kernel), fp32: the greedy tokens at batch 1 and 8 (half of them left-padded) are
    Hugging Face's generate's, also through a cache that grows (each growth captures the
    step again, its warm-up putting the DeltaNet states back); Qwen3.5 and its MoE variant."""
    monkeypatch.setattr(fast_decoder, "SLOT_ROUNDING", 16)
    monkeypatch.setattr(fast_decoder, "FIRST_NEW_TOKENS", 8)
    model = _load(_checkpoint(tmp_path, "qwen3_5_moe_text", **MOE_SIZES) if moe else checkpoint)
    _assert_greedy_equal(model, batch, 9, new_tokens=40, pad_rows=batch // 2)
    assert state_of(model).fast_decoder.captured.graph is not None
