"""The fast decode loop (slothkit.inference) against Hugging Face's generate on the same
model: greedy tokens identical for 64 new tokens, per-step logits equal, on the tiny fp32
models of every fused architecture (Gemma 3's: sandwich layers, sliding and global layers
with their own rope bases, a window of 16 that 64 tokens pass, so its layers' ring caches
wrap), with and without LoRA adapters, for one prompt and a left-padded batch of three.  On a CPU the loop runs without the CUDA graph
(``for_inference(model, fast_decode=True)``); on a GPU with it."""

import pytest
import torch
from transformers import TextIteratorStreamer, TextStreamer

from slothkit import FastModel
from slothkit.core.model_state import state_of
from slothkit.core.notices import say_once
from slothkit.inference import disable_fast_decode, enable_fast_decode
from slothkit.models import architecture_named
from slothkit.testing import FUSED_FAMILIES, tiny_model_path

ARCHES = FUSED_FAMILIES
WINDOWED = tuple(arch for arch in ARCHES if architecture_named(arch).sliding_window)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROMPTS = ["The sloth climbs", "Once upon a time, in a forest far away, there", "Hi"]


@pytest.fixture(autouse=True)
def fresh_notices():
    # The tiny models load with fused=False: the fast loop calls the model's own modules,
    # and the Triton interpreter would cost seconds per token.
    say_once.cache_clear()


def _load(arch, lora: bool):
    """``arch``: a tiny model's architecture, or a checkpoint's folder."""
    path = arch if not isinstance(arch, str) else tiny_model_path(arch)
    model, tokenizer = FastModel.from_pretrained(
        str(path), max_seq_length=512, dtype=torch.float32, load_in_4bit=False, fused=False
    )
    model.to(DEVICE)
    if lora:
        model = FastModel.get_peft_model(model, r=8, lora_alpha=16, use_gradient_checkpointing=False)
        torch.manual_seed(0)
        with torch.no_grad():  # PEFT starts B at zero: give the adapters an effect
            for name, parameter in model.named_parameters():
                if "lora_B" in name:
                    parameter.normal_(std=0.05)
    return model, tokenizer


def _hf_then_fast(model, **kwargs):
    FastModel.for_inference(model, fast_decode=False)
    expected = model.generate(**kwargs)
    FastModel.for_inference(model, fast_decode=True)
    got = model.generate(**kwargs)
    assert _fast_decoder(model).cache is not None, "the fast loop did not run"
    return expected, got


def _fast_decoder(model):
    return state_of(model).fast_decoder


def _assert_greedy_tokens_equal_hf(model, tokenizer, prompts, new_tokens: int) -> int:
    """The fast loop's ``new_tokens`` greedy tokens for ``prompts`` (left-padded) equal
    Hugging Face's generate's; returns the padded prompt's length."""
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    inputs = tokenizer(prompts, return_tensors="pt", padding=True).to(DEVICE)
    if len(prompts) > 1:
        assert (inputs["attention_mask"] == 0).any(), "the batch must be left-padded"
    settings = dict(
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
    )
    expected, got = _hf_then_fast(model, **inputs, **settings)
    assert got.shape == expected.shape
    assert torch.equal(got, expected), f"first difference at {(got != expected).nonzero()[:1].tolist()}"
    return inputs["input_ids"].shape[1]


@pytest.mark.parametrize("lora", [False, True], ids=["base", "lora"])
@pytest.mark.parametrize("arch", ARCHES)
def test_greedy_tokens_equal_hf_generate(arch, lora):
    model, tokenizer = _load(arch, lora)
    for prompts in (PROMPTS[:1], PROMPTS):
        _assert_greedy_tokens_equal_hf(model, tokenizer, prompts, 64)


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma3", "gemma2"])
def test_the_cache_grows_past_its_first_length(arch, monkeypatch):
    """A call's cache starts with room for a few new tokens (here 8, slots rounded to 16)
    and doubles as the decode reaches its end, up to prompt + max_new_tokens, moving its
    tokens (Mistral's window of 32 turning into a ring on the way): the greedy tokens of
    one prompt and of a left-padded batch still equal Hugging Face's generate."""
    from slothkit.inference import fast_decoder

    monkeypatch.setattr(fast_decoder, "SLOT_ROUNDING", 16)
    monkeypatch.setattr(fast_decoder, "FIRST_NEW_TOKENS", 8)
    sizes = []
    grow = fast_decoder.FastDecoder._grow

    def recorded(decoder, slots):
        sizes.append((decoder.cache.slots, slots))
        return grow(decoder, slots)

    monkeypatch.setattr(fast_decoder.FastDecoder, "_grow", recorded)
    model, tokenizer = _load(arch, lora=True)
    for prompts in (PROMPTS[:1], PROMPTS):
        sizes.clear()
        prompt = _assert_greedy_tokens_equal_hf(model, tokenizer, prompts, 64)
        largest = -(-(prompt + 64) // 16) * 16
        assert sizes and sizes[-1][1] == largest, f"the cache grew {sizes}"
        assert _fast_decoder(model).cache.slots == largest
    if arch == "mistral":
        assert _fast_decoder(model).cache.rings == [32, 32], "the window did not become a ring"
    # The moved tokens give the model's own logits, step by step (greedy tokens of a tiny
    # model can miss a wrong cache): a cache of the prompt and 2 steps grows into 256
    # slots, past every window, for 20 more steps.
    _check_prefill_and_step_logits(arch, steps=22, grow_after=2)


def test_greedy_tokens_of_a_4bit_model_equal_hf_generate(bitsandbytes_repacks_on_cpu):
    """NF4 base weights (bitsandbytes, quantised on load): one-row steps read them through
    bitsandbytes' layer, the prefill and the batch's steps through slothkit's
    dequantisation; both give Hugging Face's tokens.  bitsandbytes takes the CPU for one
    with AVX512-BF16, whose repacking slothkit's loading turns off."""
    model, tokenizer = FastModel.from_pretrained(
        str(tiny_model_path("llama")), max_seq_length=512, dtype=torch.float32, load_in_4bit=True, fused=False
    )
    model = FastModel.get_peft_model(model, r=8, lora_alpha=16, use_gradient_checkpointing=False)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.05)
    for prompts in (PROMPTS[:1], PROMPTS):
        _assert_greedy_tokens_equal_hf(model, tokenizer, prompts, 16)
    qkv = _fast_decoder(model).step.decode_layers[0].qkv
    assert all(entry is not None for entry in qkv.nf4), "the NF4 bases were not read as NF4"


@pytest.mark.parametrize("arch", ARCHES)
def test_prefill_and_step_logits_equal_the_model_forward(arch):
    """The decode step's logits at every position of a left-padded batch equal the model's
    own forward over the whole sequence."""
    _check_prefill_and_step_logits(arch)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2"])
def test_rope_and_cache_write_in_one_kernel_give_the_same_logits(arch, monkeypatch):
    """On a GPU the step rotates q and k and writes the cache in one launch
    (rope_into_cache); here the Triton interpreter runs that kernel in the same step, and
    the logits still equal the model's forward (Llama; Qwen3's q/k norms before RoPE;
    Gemma 2's windowed layers)."""
    from slothkit.inference import model_step
    from slothkit_kernels.rope import cache as rope_cache

    calls = []

    def counted(*args):
        calls.append(args[0].shape)
        return rope_cache.rope_into_cache(*args)

    monkeypatch.setattr(model_step, "_fused_rope_and_cache_write", lambda q: True)
    monkeypatch.setattr(model_step, "rope_into_cache", counted)
    prompt, cache, _ = _check_prefill_and_step_logits(arch)
    # A ring narrower than the prompt keeps only its last tokens: that layer's prefill
    # rotates and writes separately, its steps through the kernel.
    prefills = sum(ring is None or ring >= prompt for ring in cache.rings)
    assert len(calls) == prefills + 5 * len(cache.rings), "the fused write did not run in every layer"


@pytest.mark.parametrize("arch", ["llama", "gemma2", "phi3"])
def test_long_prefill_runs_the_mlp_in_chunks_of_tokens(arch, monkeypatch):
    """A prefill of more tokens than the chunking threshold runs the MLP over chunks of
    tokens (here 7, so that chunks cut rows of the batch apart), and the logits still
    equal the model's forward (SwiGLU; Gemma 2's GeGLU between its four norms; Phi-3's
    fused gate_up_proj)."""
    from slothkit.inference import model_step

    chunked = []

    def small_chunks(tokens):
        if tokens <= 8:  # the one-token steps
            return None
        chunked.append(tokens)
        return 7

    monkeypatch.setattr(model_step, "mlp_token_chunk", small_chunks)
    _, cache, _ = _check_prefill_and_step_logits(arch)
    assert len(chunked) == len(cache.rings), "the prefill did not chunk every layer's MLP"
    assert all(tokens > 7 and tokens % 7 for tokens in chunked), "no chunk was short"


@pytest.mark.parametrize("arch", WINDOWED)
def test_ring_caches_of_windowed_layers_past_their_window(arch):
    """Layers with a sliding window narrower than the cache keep a ring of that many
    slots: a left-padded prefill longer than the window (its ring keeps the last W
    tokens), then steps that wrap the ring twice, give the model's own logits."""
    _check_prefill_and_step_logits(arch, prompt_lengths=(70, 41, 3), steps=70)


@pytest.mark.parametrize("arch", WINDOWED)
def test_unpadded_prefill_past_the_window_runs_the_tiled_kernel(arch, monkeypatch):
    """A prefill without padding needs no mask: where a window shorter than the prompt or
    a soft-cap rules out plain causal SDPA, slothkit's tiled attention kernel applies
    them in its tiles (on a GPU; here under the Triton interpreter), and the logits still
    equal the model's forward."""
    _check_tiled_prefill(arch, (40, 40, 40), monkeypatch)


def test_padded_prefill_of_capped_layers_runs_the_tiled_kernel(monkeypatch):
    """Gemma 2's soft-capped layers take a left-padded prompt through the tiled kernel
    too, with the padding as its mask, rather than as explicit fp32 scores."""
    _check_tiled_prefill("gemma2", (40, 23, 3), monkeypatch)


def _check_tiled_prefill(arch: str, prompt_lengths, monkeypatch) -> None:
    from slothkit.inference import model_step
    from slothkit_kernels import attention

    calls = []

    def counted(q, k, v, scaling, mask, softcap, window, sinks=None):
        calls.append(mask is None)
        return attention(q, k, v, scaling, mask, softcap, window, sinks)

    monkeypatch.setattr(model_step, "_tiled_prefill_attention", lambda q: True)
    monkeypatch.setattr(model_step, "attention", counted)
    prompt, cache, step = _check_prefill_and_step_logits(arch, prompt_lengths=prompt_lengths, steps=3)
    padded = min(prompt_lengths) < prompt
    needing = [
        layer
        for layer in step.decode_layers
        if layer.softcap is not None or (not padded and (layer.window or prompt) < prompt)
    ]
    assert needing, "no layer needs the tiled kernel in this prefill"
    assert calls == [not padded] * len(needing), "the tiled kernel did not run in every such layer"


def _random_left_padded(lengths, vocab: int) -> dict:
    longest = max(lengths)
    ids = torch.randint(3, vocab, (len(lengths), longest), device=DEVICE)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        mask[row, longest - length :] = 1
    return {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask}


def _check_prefill_and_step_logits(arch: str, prompt_lengths=None, steps: int = 5, grow_after=None) -> tuple:
    """Returns the prompt's length, the cache and the decode step.  ``grow_after``: the cache starts with
    room for the prompt and that many steps, then grows into one of 256 slots."""
    from slothkit.inference.fast_decoder import FastDecoder
    from slothkit.inference.kv_cache import StaticKVCache
    from slothkit.models import architecture_for

    model, tokenizer = _load(arch, lora=True)
    model.eval()
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    torch.manual_seed(1)
    vocab = model.get_input_embeddings().weight.shape[0]
    if prompt_lengths is None:
        batch = tokenizer(PROMPTS, return_tensors="pt", padding=True).to(DEVICE)
    else:
        batch = _random_left_padded(prompt_lengths, vocab)
    extra = torch.randint(3, vocab, (3, steps), device=DEVICE)
    ids = torch.cat([batch["input_ids"], extra], dim=1)
    mask = torch.cat([batch["attention_mask"], torch.ones_like(extra)], dim=1)
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    with torch.no_grad():
        reference = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits.float()
    causal_lm = model.get_base_model()
    decoder = FastDecoder(causal_lm, architecture_for(causal_lm.config).embedding_scale, use_graph=False)
    prompt = batch["input_ids"].shape[1]
    config = causal_lm.config

    def new_cache(slots: int) -> StaticKVCache:
        cache = StaticKVCache(
            config.num_hidden_layers,
            3,
            config.num_key_value_heads,
            slots,
            decoder.step.head_dim,
            torch.float32,
            DEVICE,
            windows=decoder.step.windows,
        )
        windows = decoder.step.windows
        assert cache.rings == [w if w is not None and w < slots else None for w in windows]
        assert all(keys.shape[2] == (ring or slots) for keys, ring in zip(cache.keys, cache.rings))
        return cache

    cache = new_cache(256 if grow_after is None else prompt + grow_after)
    if prompt_lengths is not None:
        assert any(ring is not None and ring < max(prompt_lengths) for ring in cache.rings), "no ring wraps"
    cache.reset(batch["attention_mask"])
    first = torch.zeros(1, dtype=torch.long, device=DEVICE)
    causal = bool(batch["attention_mask"].all())  # as the decode loop decides it
    prefill = decoder.step(
        batch["input_ids"],
        positions[:, :prompt],
        cache,
        first,
        last_only=False,
        visible=prompt,
        causal=causal,
    )
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(prefill[real], reference[:, :prompt][real], atol=1e-4, rtol=1e-4)
    for offset in range(extra.shape[1]):
        if prompt + offset == cache.slots:
            longer = new_cache(256)
            longer.take_over(cache)
            cache = longer
        slot = torch.tensor([prompt + offset], device=DEVICE)
        cache.mark(slot)
        step = decoder.step(
            ids[:, prompt + offset : prompt + offset + 1], positions[:, prompt + offset, None], cache, slot
        )
        torch.testing.assert_close(step, reference[:, prompt + offset], atol=1e-4, rtol=1e-4)
    return prompt, cache, decoder.step


def test_sampling_settings_streamers_and_eos():
    model, tokenizer = _load("llama", lora=True)
    inputs = tokenizer(PROMPTS[:1], return_tensors="pt").to(DEVICE)
    FastModel.for_inference(model, fast_decode=True)

    # Sampling with the same seed is reproducible and every setting reaches the processors:
    # top_k=1 is greedy whatever the temperature.
    torch.manual_seed(7)
    first = model.generate(**inputs, max_new_tokens=16, do_sample=True, temperature=0.8, top_p=0.9, top_k=20)
    torch.manual_seed(7)
    second = model.generate(**inputs, max_new_tokens=16, do_sample=True, temperature=0.8, top_p=0.9, top_k=20)
    assert torch.equal(first, second)
    greedy = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    top1 = model.generate(**inputs, max_new_tokens=16, do_sample=True, temperature=5.0, top_k=1)
    assert torch.equal(greedy, top1)

    # The repetition penalty changes greedy decoding exactly as in Hugging Face's generate.
    expected, got = _hf_then_fast(model, **inputs, max_new_tokens=24, repetition_penalty=1.3, do_sample=False)
    assert torch.equal(got, expected)

    # Stopping at an eos token: the first greedy token made eos stops after one token.
    stop = int(greedy[0, inputs["input_ids"].shape[1] + 3])
    expected, got = _hf_then_fast(model, **inputs, max_new_tokens=16, eos_token_id=stop, do_sample=False)
    assert torch.equal(got, expected)
    assert int(got[0, -1]) == stop and got.shape[1] <= greedy.shape[1]

    # Sampling a left-padded batch that stops early (each row at its own eos, after the
    # loop has decoded past the end before it looked): the same tokens as generate, and
    # the random generator left where generate leaves it.
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True).to(DEVICE)
    settings = dict(max_new_tokens=24, do_sample=True, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(11)
    sampled = model.generate(**batch, **settings)
    stops = [int(sampled[row, batch["input_ids"].shape[1] + 1 + row]) for row in range(len(PROMPTS))]
    results = []
    for fast in (False, True):
        FastModel.for_inference(model, fast_decode=fast)
        torch.manual_seed(11)
        results.append((model.generate(**batch, **settings, eos_token_id=stops), torch.rand(4)))
    (expected, expected_next), (got, got_next) = results
    assert got.shape[1] < sampled.shape[1], "no row stopped early"
    assert torch.equal(got, expected) and torch.equal(got_next, expected_next)

    # Streamers get the same text as the returned tokens.
    FastModel.for_inference(model, fast_decode=True)
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True)
    out = model.generate(**inputs, max_new_tokens=12, streamer=streamer)
    streamed = "".join(streamer)
    assert streamed == tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=False)
    model.generate(**inputs, max_new_tokens=4, streamer=TextStreamer(tokenizer))


def test_unsupported_settings_fall_back_to_hf_with_one_notice(recwarn):
    model, tokenizer = _load("llama", lora=False)
    inputs = tokenizer(PROMPTS[:1], return_tensors="pt").to(DEVICE)
    # Settings at values that change nothing (as a config built by from_config carries
    # them) keep the fast path.
    model.generation_config.output_attentions = False
    model.generation_config.output_hidden_states = False
    model.generation_config.no_repeat_ngram_size = 0
    expected, got = _hf_then_fast(model, **inputs, max_new_tokens=8)
    assert torch.equal(got, expected)
    FastModel.for_inference(model, fast_decode=False)
    expected = model.generate(**inputs, max_new_tokens=8, num_beams=2, do_sample=False)
    FastModel.for_inference(model, fast_decode=True)
    got = model.generate(**inputs, max_new_tokens=8, num_beams=2, do_sample=False)
    assert torch.equal(got, expected)
    notices = [
        str(w.message) for w in recwarn if "fast generation does not cover num_beams" in str(w.message)
    ]
    assert len(notices) == 1


def test_for_training_frees_the_cache_and_training_is_unaffected():
    model, tokenizer = _load("llama", lora=True)
    inputs = tokenizer(PROMPTS[:1], return_tensors="pt").to(DEVICE)
    FastModel.for_inference(model, fast_decode=True)
    before = model.generate(**inputs, max_new_tokens=8)
    decoder = state_of(model).fast_decoder
    assert decoder.nbytes > 0

    FastModel.for_training(model)
    assert state_of(model).fast_decoder is None
    assert decoder.nbytes == 0 and decoder.captured is None
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True).to(DEVICE)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    loss = model(**batch, labels=labels).loss
    loss.backward()
    lora = [p for n, p in model.named_parameters() if "lora_A" in n]
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in lora)
    with torch.no_grad():
        for p in lora:
            p.add_(torch.randn_like(p) * 0.5)

    # The weights changed in place: the next generate sees them (same addresses, so the
    # captured step stays valid on a GPU and reads the new values).
    FastModel.for_inference(model, fast_decode=True)
    after = model.generate(**inputs, max_new_tokens=8)
    assert _fast_decoder(model).cache is not None
    FastModel.for_inference(model, fast_decode=False)
    assert torch.equal(after, model.generate(**inputs, max_new_tokens=8))
    assert not torch.equal(after, before), "the changed adapters changed nothing"


def test_a_shorter_call_reuses_the_cache_of_a_longer_one_and_equals_hf():
    """Slots are rounded up to 256: a call that needs 512 makes the cache, a call that
    needs 256 reuses it (its empty slots masked as unfilled) with HF's tokens, and a call
    that needs 1,024 makes a new one (the cache is never more than twice the need)."""
    from slothkit.inference.fast_decoder import SLOT_ROUNDING

    model, tokenizer = _load("llama", lora=True)
    inputs = tokenizer(PROMPTS[:1], return_tensors="pt").to(DEVICE)
    prompt = inputs["input_ids"].shape[1]
    greedy = dict(do_sample=False, pad_token_id=tokenizer.eos_token_id)

    def fast(new_tokens):
        FastModel.for_inference(model, fast_decode=True)
        out = model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **greedy)
        return out, _fast_decoder(model).cache

    _, long_cache = fast(2 * SLOT_ROUNDING - prompt)
    assert long_cache.slots == 2 * SLOT_ROUNDING
    got, short_cache = fast(32)
    assert short_cache is long_cache
    FastModel.for_inference(model, fast_decode=False)
    expected = model.generate(**inputs, max_new_tokens=32, min_new_tokens=32, **greedy)
    assert torch.equal(got, expected)
    _, longer_cache = fast(3 * SLOT_ROUNDING)
    assert longer_cache is not long_cache and longer_cache.slots == 4 * SLOT_ROUNDING
    _, short_again = fast(32)
    assert short_again is not longer_cache and short_again.slots == SLOT_ROUNDING


def test_disabled_adapters_are_seen_by_the_fast_loop():
    model, tokenizer = _load("llama", lora=True)
    inputs = tokenizer(PROMPTS[:1], return_tensors="pt").to(DEVICE)
    FastModel.for_inference(model, fast_decode=True)
    with_adapters = model.generate(**inputs, max_new_tokens=16)
    with model.disable_adapter():
        without = model.generate(**inputs, max_new_tokens=16)
        assert _fast_decoder(model).cache is not None
        FastModel.for_inference(model, fast_decode=False)
        hf_without = model.generate(**inputs, max_new_tokens=16)
    assert torch.equal(without, hf_without)
    FastModel.for_inference(model, fast_decode=True)
    assert torch.equal(model.generate(**inputs, max_new_tokens=16), with_adapters)


def test_cpu_default_keeps_hf_generate_and_says_so_once_at_loading(recwarn, monkeypatch):
    if DEVICE == "cuda":
        pytest.skip("the CPU default")
    from slothkit.loading.load_model import _notice_plain_path

    monkeypatch.setenv("TRITON_INTERPRET", "0")  # a plain CPU: no Triton

    _notice_plain_path.cache_clear()
    model, _ = FastModel.from_pretrained(
        str(tiny_model_path("llama")), dtype=torch.float32, load_in_4bit=False
    )
    assert enable_fast_decode(model, None) is False
    assert state_of(model).fast_decoder is None
    notices = [str(w.message) for w in recwarn if str(w.message).startswith("slothkit")]
    assert len(notices) == 1 and "generate stays Hugging Face's" in notices[0], notices
    disable_fast_decode(model)


def test_an_architecture_without_the_fast_path_says_so_once(tmp_path, recwarn):
    """A model on the generic path (no architecture record: OLMo 2 here) keeps Hugging
    Face's generate, said once."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from slothkit.testing import build_tiny_tokenizer

    sizes = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=768, pad_token_id=0)  # fmt: skip
    AutoModelForCausalLM.from_config(AutoConfig.for_model("olmo2", **sizes)).save_pretrained(tmp_path)
    build_tiny_tokenizer("bpe", tmp_path)
    model, _ = FastModel.from_pretrained(str(tmp_path), dtype=torch.float32, load_in_4bit=False, fused=False)
    recwarn.clear()
    for _ in range(2):
        assert enable_fast_decode(model, True) is False
    assert state_of(model).fast_decoder is None
    notices = [str(w.message) for w in recwarn if str(w.message).startswith("slothkit")]
    assert len(notices) == 1 and notices[0].startswith(
        "slothkit: fast generation covers llama, mistral, gemma,"
    )
    assert notices[0].endswith("not 'olmo2'; model.generate runs Hugging Face's generate")


def test_decoding_past_the_models_positions_is_said_once(recwarn):
    """A call whose prompt + max_new_tokens passes the model's positions says so, as Hugging
    Face's generate does (the tokens past them degrade); a call within them says nothing."""
    model, tokenizer = FastModel.from_pretrained(
        str(tiny_model_path("llama", max_position_embeddings=64)),
        max_seq_length=64,
        dtype=torch.float32,
        load_in_4bit=False,
        fused=False,
    )
    FastModel.for_inference(model, fast_decode=True)
    prompt = tokenizer(["Sloths"], return_tensors="pt")["input_ids"].to(DEVICE)
    model.generate(input_ids=prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert not [w for w in recwarn if "past the model's" in str(w.message)]
    out = model.generate(input_ids=prompt, max_new_tokens=70, min_new_tokens=70, do_sample=False)
    assert out.shape[1] == prompt.shape[1] + 70
    notices = [str(w.message) for w in recwarn if "past the model's 64 positions" in str(w.message)]
    assert len(notices) == 1 and f"reaches {prompt.shape[1] + 70} tokens" in notices[0]


@pytest.mark.parametrize("lora", [False, True], ids=["base", "lora"])
def test_longrope_calls_within_the_short_factors_decode_fast(tmp_path, recwarn, lora):
    """Phi-3.5's and the 128k Phi-3s' longrope tables switch to the long factors past the
    original context (here 64 positions), where Hugging Face's generate re-runs the prompt.
    A call that stays within them (prompt + max_new_tokens <= 64) decodes through the fast
    loop with the short factors and gives Hugging Face's tokens, for one prompt and a
    left-padded batch, also after a call past them, which runs Hugging Face's generate
    (said once)."""
    import json
    import shutil

    path = shutil.copytree(tiny_model_path("phi3"), tmp_path / "phi3-longrope")
    config = json.loads((path / "config.json").read_text())
    half = config["hidden_size"] // config["num_attention_heads"] // 2
    config.pop("rope_scaling", None)
    config["rope_parameters"] = {
        "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 1.0,
        "short_factor": [1.0 + 0.1 * k for k in range(half)], "long_factor": [4.0] * half,
    }  # fmt: skip
    config["original_max_position_embeddings"] = 64
    (path / "config.json").write_text(json.dumps(config))
    model, tokenizer = _load(path, lora)
    assert model.config.rope_parameters["rope_type"] == "longrope"
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    recwarn.clear()
    inputs = tokenizer(PROMPTS[:1], return_tensors="pt").to(DEVICE)
    FastModel.for_inference(model, fast_decode=True)
    for _ in range(2):
        model.generate(**inputs, max_new_tokens=70, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert _fast_decoder(model).cache is None, "a call past the short factors ran the fast loop"
    notices = [str(w.message) for w in recwarn if str(w.message).startswith("slothkit")]
    assert notices == [
        "slothkit: fast generation does not cover a longrope model's call past its first 64 positions "
        "(its rotary tables switch to the long factors there, and Hugging Face's generate re-runs the "
        "prompt); that call runs Hugging Face's generate"
    ]
    for prompts in (PROMPTS[:1], PROMPTS):
        inputs = tokenizer(prompts, return_tensors="pt", padding=True).to(DEVICE)
        new = 64 - inputs["input_ids"].shape[1]
        settings = dict(
            max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=tokenizer.pad_token_id
        )
        expected, got = _hf_then_fast(model, **inputs, **settings)
        assert torch.equal(got, expected), f"first difference at {(got != expected).nonzero()[:1].tolist()}"


def test_the_captured_steps_key_changes_exactly_when_the_model_does():
    """The step is captured again when the key of the weights changes: a parameter moved to
    new memory, adapters disabled or merged, training mode; and only then."""
    from slothkit.inference.fast_decoder import _weights_key

    model, _ = _load("llama", lora=True)
    model.eval()
    causal_lm = model.get_base_model()
    key = _weights_key(causal_lm)
    assert _weights_key(causal_lm) == key
    with model.disable_adapter():
        assert _weights_key(causal_lm) != key
    assert _weights_key(causal_lm) == key
    causal_lm.train()
    assert _weights_key(causal_lm) != key
    causal_lm.eval()
    assert _weights_key(causal_lm) == key
    norm = causal_lm.model.norm
    norm.weight = torch.nn.Parameter(norm.weight.detach().clone())
    moved = _weights_key(causal_lm)
    assert moved != key
    model.merge_adapter()
    assert _weights_key(causal_lm) != moved
