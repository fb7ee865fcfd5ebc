"""Tests for slothkit.testing: the tiny offline Llama, Mistral, Gemma and Gemma 3 checkpoints."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: nothing may download

import dataclasses
import functools
import json
import socket
from collections.abc import Mapping

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from slothkit.models import architecture_named
from slothkit.testing import (
    ARCHITECTURES,
    LARGE_VOCAB_SIZE,
    build_tiny_model,
    build_tiny_tokenizer,
    tiny_model_path,
)


@pytest.fixture
def no_network(monkeypatch):
    """Any attempt to open a connection fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError("tried to reach the network")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


@functools.cache
def _load(arch: str, **kwargs):
    path = tiny_model_path(arch, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    return path, model, AutoTokenizer.from_pretrained(path)


def _config_json(path) -> dict:
    return json.loads((path / "config.json").read_text())


def _eos_ids(model) -> set[int]:
    eos = model.generation_config.eos_token_id
    return {eos} if isinstance(eos, int) else set(eos)


def _input_ids(encoded) -> list[int]:
    return list(encoded["input_ids"] if isinstance(encoded, Mapping) else encoded)


# ---------------------------------------------------------------------------------------
# Building and loading
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_builds_and_loads_offline(arch, tmp_path, no_network):
    path = build_tiny_model(arch, tmp_path / "model")
    assert path == tmp_path / "model"
    for name in [
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
    ]:
        assert (path / name).is_file(), name
    assert "chat_template" in json.loads((path / "tokenizer_config.json").read_text())

    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    expected_class = {
        "llama": "LlamaForCausalLM",
        "mistral": "MistralForCausalLM",
        "gemma": "GemmaForCausalLM",
        "gemma3": "Gemma3ForCausalLM",
        "gemma2": "Gemma2ForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
        "phi3": "Phi3ForCausalLM",
        "ministral": "MinistralForCausalLM",
    }
    assert type(model).__name__ == expected_class[arch]
    assert tokenizer.is_fast
    assert len(tokenizer) <= model.config.vocab_size
    assert model.config.vocab_size % 256 == 0
    if tokenizer.bos_token_id is not None:  # Qwen's tokenizer has none, its config does
        assert model.generation_config.bos_token_id == tokenizer.bos_token_id
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id
    assert tokenizer.eos_token_id in _eos_ids(model)


def test_default_path_is_a_fresh_folder():
    first, second = build_tiny_model("llama"), build_tiny_model("llama")
    assert first != second and (first / "model.safetensors").is_file()


# Per-architecture traits: (arch, hidden_act, rope_theta, tied, head_dim, sliding_window, norm_neutral)
TRAITS = [
    ("llama", "silu", 500_000.0, False, 16, None, 1.0),
    ("mistral", "silu", 10_000.0, False, 16, 32, 1.0),
    ("gemma", "gelu_pytorch_tanh", 10_000.0, True, 256, None, 0.0),
    ("qwen2", "silu", 1_000_000.0, False, 16, None, 1.0),
    ("qwen3", "silu", 1_000_000.0, False, 32, None, 1.0),
    ("gemma2", "gelu_pytorch_tanh", 10_000.0, True, 256, 16, 0.0),
    ("ministral", "silu", 100_000_000.0, False, 16, 8, 1.0),
]


@pytest.mark.parametrize("arch, act, theta, tied, head_dim, window, norm_neutral", TRAITS)
def test_architecture_traits(arch, act, theta, tied, head_dim, window, norm_neutral):
    path, model, _ = _load(arch)
    config = model.config
    raw = _config_json(path)

    assert config.hidden_act == act
    if arch == "gemma":
        assert raw["hidden_activation"] == act  # the key transformers 4.x reads
    rope_parameters = getattr(config, "rope_parameters", None) or {}
    assert rope_parameters.get("rope_theta", getattr(config, "rope_theta", None)) == theta
    assert raw["rope_theta"] == theta
    assert config.tie_word_embeddings is tied
    assert (model.lm_head.weight is model.model.embed_tokens.weight) is tied
    assert config.head_dim == head_dim
    assert getattr(config, "sliding_window", None) == window
    assert raw.get("sliding_window") == window

    # Grouped-query attention: fewer key/value heads than query heads.
    attention = model.model.layers[0].self_attn
    assert config.num_key_value_heads == 2 < config.num_attention_heads == 4
    assert attention.q_proj.out_features == 4 * head_dim
    assert attention.k_proj.out_features == attention.v_proj.out_features == 2 * head_dim

    # Norm weights sit near their neutral value but not on it, so w vs (1 + w) is visible.
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        norm = f.get_tensor("model.layers.0.input_layernorm.weight")
        assert ("lm_head.weight" in f.keys()) is not tied
    assert (norm - norm_neutral).abs().mean() == pytest.approx(0.08, abs=0.04)


def test_gemma_scales_embeddings_by_sqrt_hidden():
    _, model, _ = _load("gemma")
    ids = torch.tensor([[5, 17, 300]])
    seen = {}

    def record_input(module, args, kwargs):
        seen["hidden"] = args[0] if args else kwargs["hidden_states"]

    hook = model.model.layers[0].register_forward_pre_hook(record_input, with_kwargs=True)
    try:
        with torch.no_grad():
            model(ids)
    finally:
        hook.remove()
    expected = model.model.embed_tokens.weight[ids] * model.config.hidden_size**0.5
    torch.testing.assert_close(seen["hidden"], expected)


def test_mistral_sliding_window_is_hit_after_32_tokens():
    """Same weights with and without a window: identical logits up to the window, different after."""
    _, windowed, _ = _load("mistral")
    _, unwindowed, _ = _load("mistral", sliding_window=2048)
    ids = torch.randint(0, 600, (1, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (windowed(ids).logits - unwindowed(ids).logits).abs().amax(-1)[0]
    assert diff[:32].max() < 1e-5
    assert diff[32:].min() > 1e-3


def test_gemma3_alternates_sliding_and_global_layers():
    """Layer 0 slides (window 16, rope base 10,000), layer 1 attends globally (1,000,000);
    the window is hit after 16 tokens. Each head's queries and keys have their own norm."""
    path, windowed, _ = _load("gemma3")
    config, raw = windowed.config, _config_json(path)
    assert raw["layer_types"] == config.layer_types == ["sliding_attention", "full_attention"]
    assert raw["sliding_window"] == config.sliding_window == 16
    thetas = {kind: p["rope_theta"] for kind, p in config.rope_parameters.items()}
    assert thetas == {"sliding_attention": 10_000.0, "full_attention": 1_000_000.0}
    assert config.query_pre_attn_scalar == config.head_dim == 256
    assert windowed.model.layers[0].self_attn.q_norm.weight.shape == (256,)

    _, unwindowed, _ = _load("gemma3", sliding_window=2048)
    ids = torch.randint(0, 600, (1, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (windowed(ids).logits - unwindowed(ids).logits).abs().amax(-1)[0]
    assert diff[:16].max() < 1e-5
    assert diff[16:].min() > 1e-3


def test_a_layer_types_pattern_repeats_over_the_layers_built(tmp_path, monkeypatch):
    """A record's tiny `layer_types` is a pattern: the fixture repeats it over as many layers
    as it builds, so that any num_layers gives a valid config."""
    from slothkit.testing import tiny_models

    qwen2 = architecture_named("qwen2")
    pattern = ["full_attention", "sliding_attention"]
    patterned = dataclasses.replace(
        qwen2, tiny=dataclasses.replace(qwen2.tiny, config={"layer_types": pattern})
    )
    monkeypatch.setattr(tiny_models, "architecture_named", lambda name: patterned)
    for layers, expected in [(1, pattern[:1]), (3, [*pattern, pattern[0]]), (4, pattern * 2)]:
        path = build_tiny_model("qwen2", tmp_path / str(layers), num_layers=layers)
        assert AutoConfig.from_pretrained(path).layer_types == expected
        assert _config_json(path)["layer_types"] == expected


def test_ministral_slides_on_its_first_layer_only(tmp_path):
    """Layer 0 slides over 8 tokens, layer 1 attends to everything: the window is hit after
    8 tokens, q/k/v carry no bias (Mistral's, not Qwen2's), and the pattern repeats over
    however many layers are built."""
    path, windowed, _ = _load("ministral")
    config, raw = windowed.config, _config_json(path)
    assert raw["layer_types"] == config.layer_types == ["sliding_attention", "full_attention"]
    assert [layer.self_attn.sliding_window for layer in windowed.model.layers] == [8, None]
    assert windowed.model.layers[0].self_attn.q_proj.bias is None
    deeper = AutoConfig.from_pretrained(build_tiny_model("ministral", tmp_path, num_layers=3))
    assert deeper.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]

    _, unwindowed, _ = _load("ministral", sliding_window=2048)
    ids = torch.randint(0, 600, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (windowed(ids).logits - unwindowed(ids).logits).abs().amax(-1)[0]
    assert diff[:8].max() < 1e-5
    assert diff[8:].min() > 1e-3


# ---------------------------------------------------------------------------------------
# Weights and logits
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_logits_are_finite_and_spread(arch):
    _, model, tokenizer = _load(arch)
    ids = tokenizer("The lighthouse keeper writes the weather in a ledger.", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(ids).logits[0]  # (T, vocab)
    assert torch.isfinite(logits).all()
    assert logits.std(-1).min() > 0.3  # not a flat distribution
    assert logits.softmax(-1).amax(-1).max() < 0.9  # nor a one-hot one
    assert (logits[1:] - logits[:-1]).abs().amax(-1).min() > 0.1  # depends on the input


def _tensors(path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def test_weights_are_deterministic_per_seed(tmp_path):
    a = _tensors(build_tiny_model("llama", tmp_path / "a", seed=3))
    b = _tensors(build_tiny_model("llama", tmp_path / "b", seed=3))
    c = _tensors(build_tiny_model("llama", tmp_path / "c", seed=4))
    assert a.keys() == b.keys() == c.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
        assert not torch.equal(a[name], c[name]), name


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_checkpoint(dtype):
    path = tiny_model_path("mistral", dtype=dtype)
    fp32 = _tensors(tiny_model_path("mistral"))
    half = _tensors(path)
    assert all(t.dtype == dtype for t in half.values())
    torch.testing.assert_close(
        half["model.norm.weight"].float(), fp32["model.norm.weight"], atol=1e-2, rtol=1e-2
    )
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    assert model.dtype == dtype


def test_large_vocab_gives_gemma_256000_rows():
    path, model, tokenizer = _load("gemma", large_vocab=True)
    assert model.config.vocab_size == LARGE_VOCAB_SIZE == 256_000
    assert model.model.embed_tokens.weight.shape == (256_000, 64)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert len(tokenizer) < 1000  # rows beyond the tokenizer exist but are never produced
    with torch.no_grad():
        logits = model(torch.tensor([[1, 20, 30]])).logits
    assert logits.shape == (1, 3, 256_000) and torch.isfinite(logits).all()


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_hidden_256_gives_rows_of_multiples_of_256(arch):
    """GGUF K-quants pack rows in blocks of 256 values."""
    # Qwen3's tiny head_dim (32) is not hidden_size // num_heads; 4 x 64 gives 256.
    head_dim = {"head_dim": 64} if arch == "qwen3" else {}
    path = tiny_model_path(arch, hidden_size=256, intermediate_size=512, **head_dim)
    config = _config_json(path)
    assert config["hidden_size"] == 256 and config["vocab_size"] % 256 == 0
    matrices = {name: t for name, t in _tensors(path).items() if t.ndim == 2}
    per_layer = 4 if arch == "phi3" else 7  # Phi-3: qkv_proj, o_proj, gate_up_proj, down_proj
    assert (
        len(matrices) == (1 if config["tie_word_embeddings"] else 2) + per_layer * config["num_hidden_layers"]
    )
    for name, tensor in matrices.items():
        assert tensor.shape[-1] % 256 == 0, (name, tuple(tensor.shape))


# ---------------------------------------------------------------------------------------
# Tokenizers and chat templates
# ---------------------------------------------------------------------------------------

ROUND_TRIP_TEXTS = [
    "Hello world, the 08:15 train leaves from platform 3.",
    "It's 2024; prices rose 3.5% (from 14.50 to 15.01)!",
    "Unseen characters: naïve café, 東京, ☃ and a tab\there.\nNew line  and  double spaces.",
    "def add(a, b):\n    return a + b\n",
]


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_tokenizer_round_trips_text(arch, text):
    _, _, tokenizer = _load(arch)
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    if tokenizer.unk_token_id is not None:
        assert tokenizer.unk_token_id not in ids  # byte fallback instead of <unk>


@pytest.mark.parametrize("arch", [arch for arch in ARCHITECTURES if not arch.startswith("qwen")])
def test_encoding_adds_exactly_one_bos(arch):
    _, _, tokenizer = _load(arch)
    ids = tokenizer("Sloths are good swimmers.")["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
    assert tokenizer.eos_token_id not in ids
    assert tokenizer("Sloths", add_special_tokens=False)["input_ids"][0] != tokenizer.bos_token_id

    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    chat_ids = _input_ids(tokenizer.apply_chat_template(messages, tokenize=True))
    assert chat_ids[0] == tokenizer.bos_token_id and chat_ids.count(tokenizer.bos_token_id) == 1


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_tokenizer_adds_no_bos_and_splits_digits(arch):
    """Qwen's tokenizer has no BOS (its config's bos_token_id, <|endoftext|>, is never
    added), ends turns with <|im_end|> and pads with <|endoftext|>; digits go one by one."""
    path, model, tokenizer = _load(arch)
    assert tokenizer.bos_token_id is None
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert model.config.bos_token_id == tokenizer.pad_token_id
    ids = tokenizer("Sloths are good swimmers.")["input_ids"]
    assert tokenizer.pad_token_id not in ids and tokenizer.eos_token_id not in ids
    digits = tokenizer("2024", add_special_tokens=False)["input_ids"]
    assert [tokenizer.decode([i]) for i in digits] == ["2", "0", "2", "4"]


MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "How are you?"},
    {"role": "assistant", "content": "Fine, thanks."},
]

# arch: (MESSAGES rendered, how the last assistant answer is rendered). With
# add_generation_prompt, MESSAGES[:-1] renders as the first minus the second.
EXPECTED_CHAT = {
    "llama": (
        "<|begin_of_text|>"
        "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHow are you?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nFine, thanks.<|eot_id|>",
        "Fine, thanks.<|eot_id|>",
    ),
    "mistral": (
        "<s>[INST] Be brief.\n\nHi there [/INST] Hello!</s>[INST] How are you? [/INST] Fine, thanks.</s>",
        " Fine, thanks.</s>",  # no generation prompt: [/INST] already hands over
    ),
    "gemma": (
        "<s><start_of_turn>user\nBe brief.\n\nHi there<end_of_turn>\n"
        "<start_of_turn>model\nHello!<end_of_turn>\n"
        "<start_of_turn>user\nHow are you?<end_of_turn>\n"
        "<start_of_turn>model\nFine, thanks.<end_of_turn>\n",
        "Fine, thanks.<end_of_turn>\n",
    ),
}
EXPECTED_CHAT["gemma3"] = EXPECTED_CHAT["gemma"]  # Gemma 3 keeps Gemma's turn format
EXPECTED_CHAT["gemma2"] = EXPECTED_CHAT["gemma"]  # and so does Gemma 2
EXPECTED_CHAT["ministral"] = EXPECTED_CHAT["mistral"]  # Mistral's [INST] turns
_CHATML = (
    "<|im_start|>system\nBe brief.<|im_end|>\n"
    "<|im_start|>user\nHi there<|im_end|>\n"
    "<|im_start|>assistant\nHello!<|im_end|>\n"
    "<|im_start|>user\nHow are you?<|im_end|>\n"
    "<|im_start|>assistant\nFine, thanks.<|im_end|>\n",
    "Fine, thanks.<|im_end|>\n",
)
EXPECTED_CHAT["qwen2"] = _CHATML
# Qwen3: the answer after the last user turn opens with an empty thinking block.
EXPECTED_CHAT["qwen3"] = (
    _CHATML[0].replace("assistant\nFine", "assistant\n<think>\n\n</think>\n\nFine"),
    "<think>\n\n</think>\n\nFine, thanks.<|im_end|>\n",
)

# Phi-3: a header per role, each turn closed by <|end|>, the conversation by <|endoftext|>.
EXPECTED_CHAT["phi3"] = (
    "<s><|system|>\nBe brief.<|end|>\n<|user|>\nHi there<|end|>\n<|assistant|>\nHello!<|end|>\n"
    "<|user|>\nHow are you?<|end|>\n<|assistant|>\nFine, thanks.<|end|>\n<|endoftext|>",
    "Fine, thanks.<|end|>\n<|endoftext|>",
)


def test_qwen_chat_templates_default_system_and_thinking_switch():
    """Qwen2.5 adds its default system turn when none is given; Qwen3 adds none, and with
    enable_thinking=False closes an empty think block after the generation prompt."""
    user = [{"role": "user", "content": "Hi"}]
    _, _, qwen2 = _load("qwen2")
    assert qwen2.apply_chat_template(user, tokenize=False).startswith(
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
    )
    _, _, qwen3 = _load("qwen3")
    prompt = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert qwen3.apply_chat_template(user, tokenize=False, add_generation_prompt=True) == prompt
    no_thinking = qwen3.apply_chat_template(
        user, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert no_thinking == prompt + "<think>\n\n</think>\n\n"


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_chat_template_renders_the_real_format(arch):
    _, model, tokenizer = _load(arch)
    expected, last_answer = EXPECTED_CHAT[arch]
    assert tokenizer.apply_chat_template(MESSAGES, tokenize=False) == expected
    prompt = tokenizer.apply_chat_template(MESSAGES[:-1], tokenize=False, add_generation_prompt=True)
    assert prompt + last_answer == expected

    # Each assistant answer is followed by a token that stops generation.
    encoded = tokenizer(expected, add_special_tokens=False, return_offsets_mapping=True)
    starts = {start: i for i, (start, _) in enumerate(encoded["offset_mapping"])}
    eos_ids = _eos_ids(model)
    for answer in ("Hello!", "Fine, thanks."):
        end = expected.index(answer) + len(answer)
        assert encoded["input_ids"][starts[end]] in eos_ids, (answer, tokenizer.decode(encoded["input_ids"]))


def test_mistral_template_rejects_unalternating_roles():
    _, _, tokenizer = _load("mistral")
    with pytest.raises(Exception, match="alternate"):
        tokenizer.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


@pytest.mark.parametrize("flavour, bos, eos, pad, unk", [
    ("bpe", "<|begin_of_text|>", "<|end_of_text|>", "<|finetune_right_pad_id|>", None),
    ("sentencepiece", "<s>", "</s>", "<pad>", "<unk>"),
])  # fmt: skip
def test_build_tiny_tokenizer_alone(flavour, bos, eos, pad, unk, tmp_path, no_network):
    tokenizer = AutoTokenizer.from_pretrained(build_tiny_tokenizer(flavour, tmp_path))
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token, tokenizer.unk_token) == (
        bos,
        eos,
        pad,
        unk,
    )
    assert 512 <= len(tokenizer) <= 1000
    assert len({tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id}) == 3
    if flavour == "sentencepiece":
        # Byte tokens are in the vocabulary for fallback but typing their name gives plain text.
        assert tokenizer.convert_tokens_to_ids("<0x41>") not in tokenizer("<0x41>")["input_ids"]


def test_tokenizer_is_trained_deterministically(tmp_path):
    first = build_tiny_tokenizer("sentencepiece", tmp_path / "a", arch="gemma")
    second = build_tiny_tokenizer("sentencepiece", tmp_path / "b", arch="gemma")
    assert (first / "tokenizer.json").read_text() == (second / "tokenizer.json").read_text()
    assert "<start_of_turn>" in (first / "tokenizer.json").read_text()


# ---------------------------------------------------------------------------------------
# Cache and bad input
# ---------------------------------------------------------------------------------------


def test_tiny_model_path_caches_by_arguments():
    assert tiny_model_path("llama") == tiny_model_path("llama", seed=0, hidden_size=64)
    assert tiny_model_path("llama") != tiny_model_path("llama", seed=1)
    assert tiny_model_path("llama") != tiny_model_path("gemma")
    with pytest.raises(TypeError, match="path"):
        tiny_model_path("llama", path="/tmp/x")


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(arch="gpt2"), ValueError, "arch"),
    (dict(arch="llama", tokenizer="wordpiece"), ValueError, "tokenizer"),
    (dict(arch="llama", num_heads=4, num_kv_heads=3), ValueError, "num_kv_heads"),
    (dict(arch="llama", hidden_size=66), ValueError, "num_heads"),
    (dict(arch="llama", vocab_size=100), ValueError, "vocab_size"),
    (dict(arch="gemma", large_vocab=True, vocab_size=1024), ValueError, "large_vocab"),
    (dict(arch="llama", sliding_window=16), ValueError, "sliding_window"),
    (dict(arch="llama", num_layers=0), ValueError, "num_layers"),
    (dict(arch="llama", dtype=torch.int8), TypeError, "dtype"),
])  # fmt: skip
def test_bad_arguments_are_refused(kwargs, error, match, tmp_path):
    with pytest.raises(error, match=match):
        build_tiny_model(path=tmp_path, **kwargs)
