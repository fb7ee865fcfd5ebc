"""GGUF export (slothkit.export.gguf) of the tiny Llama, Mistral and Gemma in every method: the
file read back with gguf.GGUFReader, then run by llama.cpp and compared with the HF model."""

import copy
import dataclasses
import functools
import importlib.util
import json
import math
import re
import shutil

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from slothkit.export.atomic import DirectoryNotEmptyError
from slothkit.export.gguf import save_pretrained_gguf, write_gguf
from slothkit.export.gguf import verify as gguf_verify
from slothkit.export.gguf.layout import hf_weights_from_gguf, permute_rotary_rows
from slothkit.export.gguf.tensor_types import QUANTIZATION_METHODS, quantization_method
from slothkit.export.gguf.verify import GGUFVerificationError, verify_gguf
from slothkit.models import EXPERT_RECORDS, EXPORT_ONLY_RECORDS, RECORDS, architecture_named
from slothkit.testing import CORPUS, tiny_model_path

T = gguf.GGMLQuantizationType
ARCHS = ("llama", "mistral", "gemma", "qwen2", "qwen3", "phi3", "ministral")
METHODS = ("f16", "bf16", "q8_0", "q4_0", "q4_k_m", "q5_k_m", "q6_k")
SIZES = dict(hidden_size=256, intermediate_size=512)  # every row a multiple of 256 (K-quants)
needs_llama_cpp = pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None,
    reason="llama-cpp-python is not installed (pip install 'slothkit[gguf]'); it runs the GGUF files",
)

# What each tiny model is (slothkit.testing): 2 layers, 4 heads, 2 KV heads, 768 vocabulary rows.
EXPECTED = {
    "llama": dict(arch="llama", head_dim=64, rope_base=500000.0, eps=1e-5, tokenizer="gpt2", tied=False),
    "mistral": dict(arch="llama", head_dim=64, rope_base=10000.0, eps=1e-5, tokenizer="llama", tied=False),
    "gemma": dict(arch="gemma", head_dim=256, rope_base=10000.0, eps=1e-6, tokenizer="llama", tied=True),
    "qwen2": dict(arch="qwen2", head_dim=64, rope_base=1e6, eps=1e-6, tokenizer="gpt2", tied=False),
    "qwen3": dict(arch="qwen3", head_dim=64, rope_base=1e6, eps=1e-6, tokenizer="gpt2", tied=False),
    "phi3": dict(arch="phi3", head_dim=64, rope_base=10000.0, eps=1e-5, tokenizer="llama", tied=False),
    "ministral": dict(arch="llama", head_dim=64, rope_base=1e8, eps=1e-5, tokenizer="llama", tied=False),
}
# Each layer's projections: Phi-3 writes its fused ones as they are (attn_qkv; ffn_up holds
# gate and up), as llama.cpp's converter does.
PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
LAYER_PROJECTIONS = {"phi3": ("attn_qkv", "attn_output", "ffn_up", "ffn_down")}
# Tensors beyond Llama's, per layer: Qwen2's q/k/v biases, Qwen3's per-head q/k norms.
EXTRA_LAYER_TENSORS = {
    "qwen2": ("attn_q.bias", "attn_k.bias", "attn_v.bias"),
    "qwen3": ("attn_q_norm.weight", "attn_k_norm.weight"),
}
# The type of each 2-D weight, written out by hand from llama.cpp's rules (not from our code):
# _M mixes: attn_v and ffn_down of layer 1 (of 2) get Q6_K; the output (Gemma: the tied
# token_embd) Q6_K in every llama-quantize mix, the base type for the converter's types.
BASE = {
    "f16": T.F16,
    "bf16": T.BF16,
    "q8_0": T.Q8_0,
    "q4_0": T.Q4_0,
    "q4_k_m": T.Q4_K,
    "q5_k_m": T.Q5_K,
    "q6_k": T.Q6_K,
}

FILE_TYPES = {
    "f16": gguf.LlamaFileType.MOSTLY_F16,
    "bf16": gguf.LlamaFileType.MOSTLY_BF16,
    "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
    "q4_k_m": gguf.LlamaFileType.MOSTLY_Q4_K_M,
    "q5_k_m": gguf.LlamaFileType.MOSTLY_Q5_K_M,
    "q6_k": gguf.LlamaFileType.MOSTLY_Q6_K,
}


def expected_type(method: str, name: str, tied: bool):
    if name.endswith("_norm.weight") or name.endswith(".bias"):
        return T.F32
    is_output = name == "output.weight" or (tied and name == "token_embd.weight")
    if is_output and method in ("q4_0", "q4_k_m", "q5_k_m", "q6_k"):
        return T.Q6_K
    if method in ("q4_k_m", "q5_k_m") and name in ("blk.1.attn_v.weight", "blk.1.ffn_down.weight"):
        return T.Q6_K
    if name.endswith(".attn_qkv.weight") and method in ("q4_k_m", "q5_k_m"):  # one step up, every layer
        return T.Q5_K if method == "q4_k_m" else T.Q6_K
    return BASE[method]


@functools.cache
def tiny(arch: str, dtype: torch.dtype = torch.float32):
    # Qwen3's tiny head_dim (32) is not hidden_size // num_heads; 4 x 64 keeps rows of 256.
    path = tiny_model_path(arch, **SIZES, **({"head_dim": 64} if arch == "qwen3" else {}))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    return model, AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """exported(arch, method) -> path of the GGUF file, written once per module."""
    root = tmp_path_factory.mktemp("gguf")

    @functools.cache
    def get(arch, method):
        model, tokenizer = tiny(arch)
        return write_gguf(model, root / f"{arch}.{method}.gguf", tokenizer, quantization_method(method))

    return get


def field(reader, key):
    return reader.fields[key].contents()


# ---------------------------------------------------------------------------------------
# The file, read back
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("arch", ARCHS)
def test_metadata_tensor_names_shapes_and_types(arch, method, exported):
    model, tokenizer = tiny(arch)
    spec = EXPECTED[arch]
    reader = gguf.GGUFReader(exported(arch, method))
    a = spec["arch"]
    assert field(reader, "general.architecture") == a
    assert field(reader, "general.file_type") == int(FILE_TYPES[method])
    assert field(reader, f"{a}.context_length") == 2048
    assert field(reader, f"{a}.embedding_length") == 256
    assert field(reader, f"{a}.block_count") == 2
    assert field(reader, f"{a}.feed_forward_length") == 512
    assert field(reader, f"{a}.attention.head_count") == 4
    assert field(reader, f"{a}.attention.head_count_kv") == 2
    assert field(reader, f"{a}.attention.key_length") == spec["head_dim"]
    assert field(reader, f"{a}.attention.value_length") == spec["head_dim"]
    assert field(reader, f"{a}.rope.freq_base") == spec["rope_base"]
    assert math.isclose(field(reader, f"{a}.attention.layer_norm_rms_epsilon"), spec["eps"], rel_tol=1e-6)
    window = reader.fields.get(f"{a}.attention.sliding_window")
    assert (window.contents() if window else None) == {"mistral": 32, "ministral": 8}.get(arch)

    assert field(reader, "tokenizer.ggml.model") == spec["tokenizer"]
    tokens = field(reader, "tokenizer.ggml.tokens")
    assert len(tokens) == model.config.vocab_size == 768  # one token per embedding row
    bos = reader.fields.get("tokenizer.ggml.bos_token_id")
    assert (bos.contents() if bos else None) == tokenizer.bos_token_id
    assert field(reader, "tokenizer.ggml.eos_token_id") == tokenizer.eos_token_id
    # Qwen's tokenizer adds no BOS (and has none).
    assert field(reader, "tokenizer.ggml.add_bos_token") is (not arch.startswith("qwen"))
    assert field(reader, "tokenizer.chat_template") == tokenizer.chat_template

    names = {"token_embd.weight", "output_norm.weight"} | {
        f"blk.{i}.{t}.weight"
        for i in range(2)
        for t in ("attn_norm", "ffn_norm", *LAYER_PROJECTIONS.get(arch, PROJECTIONS))
    }
    names |= {f"blk.{i}.{t}" for i in range(2) for t in EXTRA_LAYER_TENSORS.get(arch, ())}
    if not spec["tied"]:
        names.add("output.weight")
    tensors = {t.name: t for t in reader.tensors}
    assert set(tensors) == names
    hf = {
        "token_embd.weight": model.model.embed_tokens.weight,
        "output.weight": model.lm_head.weight,
        "blk.0.ffn_down.weight": model.model.layers[0].mlp.down_proj.weight,
        "blk.0.attn_norm.weight": model.model.layers[0].input_layernorm.weight,
    }
    attention, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    if arch == "phi3":  # (4 + 2 * 2) heads of 64 rows; gate's 512 rows then up's
        hf["blk.1.attn_qkv.weight"] = attention.qkv_proj.weight
        hf["blk.1.ffn_up.weight"] = mlp.gate_up_proj.weight
        assert attention.qkv_proj.weight.shape == (8 * 64, 256) and mlp.gate_up_proj.weight.shape == (
            1024,
            256,
        )
    else:
        hf["blk.1.attn_q.weight"] = attention.q_proj.weight
        hf["blk.1.attn_k.weight"] = attention.k_proj.weight
    for name, weight in hf.items():
        if name in tensors:
            assert tuple(int(n) for n in tensors[name].shape) == tuple(reversed(weight.shape)), name
    for name, tensor in tensors.items():
        assert tensor.tensor_type == expected_type(method, name, spec["tied"]), name


def _stored(reader, name):
    t = next(t for t in reader.tensors if t.name == name)
    values = gguf.quants.dequantize(np.array(t.data), t.tensor_type)
    return torch.from_numpy(np.array(values, dtype=np.float32)).reshape(
        tuple(reversed([int(n) for n in t.shape]))
    )


@pytest.mark.parametrize("arch", ARCHS)
def test_weights_are_transformed_as_llama_cpp_expects(arch, exported):
    model, _ = tiny(arch)
    reader = gguf.GGUFReader(exported(arch, "f16"))
    layer = model.model.layers[0]
    norm = layer.input_layernorm.weight.detach()
    if arch == "phi3":  # the fused rows as stored: q, k, v (neox rotation) and gate, up
        qkv, gate_up = layer.self_attn.qkv_proj.weight.detach(), layer.mlp.gate_up_proj.weight.detach()
        assert torch.allclose(_stored(reader, "blk.0.attn_qkv.weight"), qkv, rtol=1e-3, atol=1e-4)
        assert torch.allclose(_stored(reader, "blk.0.ffn_up.weight"), gate_up, rtol=1e-3, atol=1e-4)
        assert torch.equal(_stored(reader, "blk.0.attn_norm.weight"), norm)
        return
    q, k = layer.self_attn.q_proj.weight.detach(), layer.self_attn.k_proj.weight.detach()
    if arch == "gemma":  # no permutation; norms hold 1 + w, in F32
        assert torch.allclose(_stored(reader, "blk.0.attn_q.weight"), q, rtol=1e-3, atol=1e-4)
        assert torch.equal(_stored(reader, "blk.0.attn_norm.weight"), norm.float() + 1)
    elif arch.startswith("qwen"):  # no permutation (neox rotation); norms and biases as they are
        assert torch.allclose(_stored(reader, "blk.0.attn_q.weight"), q, rtol=1e-3, atol=1e-4)
        assert torch.allclose(_stored(reader, "blk.0.attn_k.weight"), k, rtol=1e-3, atol=1e-4)
        assert torch.equal(_stored(reader, "blk.0.attn_norm.weight"), norm)
        if arch == "qwen2":
            assert torch.equal(_stored(reader, "blk.0.attn_k.bias"), layer.self_attn.k_proj.bias.detach())
        else:
            assert torch.equal(
                _stored(reader, "blk.0.attn_q_norm.weight"), layer.self_attn.q_norm.weight.detach()
            )
    else:  # Q rows permuted within 4 heads, K rows within 2 KV heads
        assert torch.allclose(
            _stored(reader, "blk.0.attn_q.weight"), permute_rotary_rows(q, 4), rtol=1e-3, atol=1e-4
        )
        assert torch.allclose(
            _stored(reader, "blk.0.attn_k.weight"), permute_rotary_rows(k, 2), rtol=1e-3, atol=1e-4
        )
        assert not torch.allclose(_stored(reader, "blk.0.attn_q.weight"), q, rtol=1e-3, atol=1e-4)
        assert torch.equal(_stored(reader, "blk.0.attn_norm.weight"), norm)


# ---------------------------------------------------------------------------------------
# llama.cpp runs the files
# ---------------------------------------------------------------------------------------


@needs_llama_cpp
def test_the_verifier_loads_without_llama_cpps_extra_cpu_buffers():
    """The extra buffer types (AMX among them) are off while the verifier builds its Llama,
    and llama.cpp's defaults are as they were afterwards, also after an error."""
    from llama_cpp import llama_cpp as bindings

    from slothkit.export.gguf.verify import _plain_cpu_kernels

    assert bindings.llama_model_default_params().use_extra_bufts
    with _plain_cpu_kernels():
        assert not bindings.llama_model_default_params().use_extra_bufts
    assert bindings.llama_model_default_params().use_extra_bufts
    with pytest.raises(RuntimeError), _plain_cpu_kernels():
        raise RuntimeError("a load that fails")
    assert bindings.llama_model_default_params().use_extra_bufts


@needs_llama_cpp
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("arch", ARCHS)
def test_llama_cpp_logits_and_greedy_tokens_match_hf(arch, method, exported):
    model, tokenizer = tiny(arch)
    path = exported(arch, method)
    # Structure: HF on the file's own (dequantised) weights vs llama.cpp, one tight tolerance.
    exact = verify_gguf(path, model, tokenizer, quantization_method(method), reference="gguf_weights")
    assert exact.logit_error < gguf_verify.GGUF_WEIGHTS_TOLERANCE and exact.greedy_tokens == 18
    assert exact.weight_error < gguf_verify.WEIGHT_TOLERANCES[method]
    # Quality: the original model vs llama.cpp, within the method's tolerance.
    report = verify_gguf(path, model, tokenizer, quantization_method(method))
    assert report.logit_error < gguf_verify.TOLERANCES[method]
    assert exact.logit_error <= report.logit_error + 0.01  # rounding of weights is most of the error


@needs_llama_cpp
def test_bf16_model_is_verified_in_bf16(tmp_path):
    model, tokenizer = tiny("llama", torch.bfloat16)
    bf16 = quantization_method("bf16")
    path = write_gguf(model, tmp_path / "llama.bf16.gguf", tokenizer, bf16)
    report = verify_gguf(path, model, tokenizer, bf16)
    assert report.tolerance == gguf_verify.BF16_REFERENCE_FLOOR and report.logit_error < 0.03


@needs_llama_cpp
@pytest.mark.parametrize(
    "arch,layout_fault,record_fault",
    [
        ("llama", dict(permute_qk=False), {}),
        ("gemma", dict(permute_qk=True), {}),
        ("gemma", {}, dict(norm_adds_one=False)),  # no norm offset
    ],
    ids=["llama-unpermuted", "gemma-permuted", "gemma-no-norm-offset"],
)
def test_a_structural_fault_fails_verification_at_4_bits(arch, layout_fault, record_fault, tmp_path):
    """A file written with the wrong layout: at Q4, where the quality tolerance is wide, the
    comparison of the file's weights with the model's still catches it."""
    model, tokenizer = tiny(arch)
    record = architecture_named(arch)
    wrong = dataclasses.replace(record, gguf=dataclasses.replace(record.gguf, **layout_fault), **record_fault)
    q4_k_m = quantization_method("q4_k_m")
    path = write_gguf(model, tmp_path / "wrong.gguf", tokenizer, q4_k_m, arch=wrong)
    with pytest.raises(GGUFVerificationError, match="the file's weights differ from the model's"):
        verify_gguf(path, model, tokenizer, q4_k_m, reference="gguf_weights")


@needs_llama_cpp
@pytest.mark.parametrize("rope_type", ["llama3", "linear"])
def test_rope_scaling_is_written_as_llama_cpp_applies_it(rope_type, tmp_path):
    """llama3: a rope_freqs tensor of per-frequency divisors; linear: scaling type and factor."""
    path = tiny_model_path("llama", **SIZES)
    config = AutoConfig.from_pretrained(path)
    scaling = {"rope_type": rope_type, "factor": 4.0}
    if rope_type == "llama3":  # wavelengths below 64 / 4 kept, above 64 slowed 4x, blended between
        scaling.update(low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)
    if hasattr(config, "rope_parameters"):  # transformers 5
        config.rope_parameters = {**config.rope_parameters, **scaling}
    else:
        config.rope_scaling = scaling
    model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    f32 = quantization_method("f32")
    file = write_gguf(model, tmp_path / f"{rope_type}.gguf", tokenizer, f32)
    reader = gguf.GGUFReader(file)
    if rope_type == "llama3":
        divisors = _stored(reader, "rope_freqs.weight")
        default = 1.0 / 500000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64)
        assert torch.allclose(
            divisors, default / model.model.rotary_emb.inv_freq.float(), rtol=1e-5
        )  # HF's own
        assert divisors.min() == 1.0 and divisors.max() == 4.0 and ((divisors > 1) & (divisors < 4)).any()
    else:
        assert field(reader, "llama.rope.scaling.type") == "linear"
        assert field(reader, "llama.rope.scaling.factor") == 4.0
    verify_gguf(file, model, tokenizer, f32, reference="gguf_weights")
    plain = write_gguf(tiny("llama")[0], tmp_path / "plain.gguf", tokenizer, f32)  # same weights, plain rope
    with pytest.raises(GGUFVerificationError, match="logits differ"):
        verify_gguf(plain, model, tokenizer, f32)


# ---------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------

PLAIN_TEXTS = (
    [p.strip() for p in CORPUS.split("\n\n")]
    + [
        "naïve café, Ünïcödé straße: 東京 🦥 — “quotes”",
        "tabs\tand  double  spaces\n\nand new lines",
        "x = 3.14159; y = 1,000,000 and 2024-12-31",
    ]
    + sorted(set(CORPUS.split()))[::7]
)


def _vocab_only(path):
    import llama_cpp

    return llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)


@needs_llama_cpp
@pytest.mark.parametrize("arch", ARCHS)
def test_llama_cpp_tokenises_plain_text_like_hf(arch, exported):
    _, tokenizer = tiny(arch)
    llm = _vocab_only(exported(arch, "q8_0"))
    try:
        for text in PLAIN_TEXTS:
            assert llm.tokenize(text.encode(), add_bos=True, special=False) == tokenizer(text)["input_ids"], (
                text
            )
            decoded = llm.detokenize(tokenizer(text, add_special_tokens=False)["input_ids"]).decode()
            # llama-cpp-python joins token pieces: the "▁" that starts SentencePiece text stays a space
            assert decoded == (text if arch in ("llama", "qwen2", "qwen3") else " " + text)
    finally:
        llm.close()


@needs_llama_cpp
def test_byte_level_special_tokens_tokenise_like_hf(exported):
    _, tokenizer = tiny("llama")
    llm = _vocab_only(exported("llama", "q8_0"))
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi there!"}], tokenize=False, add_generation_prompt=True
    )
    try:
        assert (
            llm.tokenize(text.encode(), add_bos=False, special=True)
            == tokenizer(text, add_special_tokens=False)["input_ids"]
        )
    finally:
        llm.close()


@needs_llama_cpp
@pytest.mark.parametrize("arch", ["mistral", "gemma"])
def test_sentencepiece_style_reads_a_space_after_special_tokens(arch, exported):
    """The documented difference (gguf_tokenizer): HF's Metaspace "first" puts no "▁" in front
    of text that follows a special token, llama.cpp (like SentencePiece) does; so llama.cpp
    tokenises a chat prompt as HF tokenises it with a space after each special token."""
    _, tokenizer = tiny(arch)
    llm = _vocab_only(exported(arch, "q8_0"))
    messages = [{"role": "user", "content": "Hi there!"}, {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": "Bake bread?"}]  # fmt: skip
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    try:
        ours = llm.tokenize(text.encode(), add_bos=False, special=True)
    finally:
        llm.close()
    specials = "|".join(re.escape(t) for t in tokenizer.all_special_tokens)
    spaced = re.sub(f"({specials})(?!{specials}|$)", r"\1 ", text)
    assert spaced != text
    assert ours == tokenizer(spaced, add_special_tokens=False)["input_ids"]
    assert ours != tokenizer(text, add_special_tokens=False)["input_ids"]


@needs_llama_cpp
def test_never_prefixing_tokenizer_matches_exactly_with_special_tokens(tmp_path):
    source = tiny_model_path("gemma", **SIZES)
    folder = tmp_path / "gemma-never"
    shutil.copytree(source, folder)
    spec = json.loads((folder / "tokenizer.json").read_text())
    spec["pre_tokenizer"]["prepend_scheme"] = "never"  # as Gemma's own tokenizer: no dummy prefix
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    path = write_gguf(tiny("gemma")[0], tmp_path / "never.gguf", tokenizer, quantization_method("q8_0"))
    assert gguf.GGUFReader(path).fields["tokenizer.ggml.add_space_prefix"].contents() is False
    llm = _vocab_only(path)
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi there!"}], tokenize=False, add_generation_prompt=True
    )
    try:
        for text in PLAIN_TEXTS[:8] + [" starts with a space", chat]:
            assert (
                llm.tokenize(text.encode(), add_bos=False, special=True)
                == tokenizer(text, add_special_tokens=False)["input_ids"]
            )
    finally:
        llm.close()


@pytest.mark.parametrize("arch", ARCHS)
def test_token_types_scores_and_merges(arch, exported):
    _, tokenizer = tiny(arch)
    reader = gguf.GGUFReader(exported(arch, "q8_0"))
    tokens = field(reader, "tokenizer.ggml.tokens")
    types = field(reader, "tokenizer.ggml.token_type")
    vocab = tokenizer.get_vocab()
    for token in tokenizer.all_special_tokens:
        expected = gguf.TokenType.UNKNOWN if token == tokenizer.unk_token else gguf.TokenType.CONTROL
        assert types[vocab[token]] == expected, token
    assert (
        tokens[700] == "[PAD700]" and types[700] == gguf.TokenType.UNUSED
    )  # embedding rows past the tokenizer
    assert all(tokens[i] == t for t, i in vocab.items())
    if arch in ("llama", "qwen2", "qwen3"):  # byte-level BPE: merges and the family's pre-tokenizer
        assert field(reader, "tokenizer.ggml.pre") == ("llama-bpe" if arch == "llama" else "qwen2")
        merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
        assert field(reader, "tokenizer.ggml.merges") == [
            m if isinstance(m, str) else " ".join(m) for m in merges
        ]
        assert "tokenizer.ggml.scores" not in reader.fields
    else:  # SentencePiece style: bytes, scores in merge order, no merges
        assert types[vocab["<0x41>"]] == gguf.TokenType.BYTE and types[vocab["▁the"]] == gguf.TokenType.NORMAL
        scores = field(reader, "tokenizer.ggml.scores")
        merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
        first, later = ("".join(m if isinstance(m, list) else m.split(" ")) for m in (merges[0], merges[100]))
        assert scores[vocab[first]] == 0.0 and scores[vocab[later]] == -100.0
        assert "tokenizer.ggml.merges" not in reader.fields
        assert field(reader, "tokenizer.ggml.add_space_prefix") is True


# ---------------------------------------------------------------------------------------
# save_pretrained_gguf: folders, Modelfiles, bad input
# ---------------------------------------------------------------------------------------


def test_save_writes_one_file_per_method_and_modelfiles(tmp_path):
    model, tokenizer = tiny("gemma")
    name = "gemma"  # files are named after the model (its cache folder's name less the hash)
    paths = save_pretrained_gguf(model, tmp_path / "out", tokenizer, ["q4_k_m", "Q8_0"], verify=False)
    assert paths == [
        tmp_path / "out" / n
        for n in (f"{name}.Q4_K_M.gguf", f"{name}.Q8_0.gguf", "Modelfile.Q4_K_M", "Modelfile.Q8_0")
    ]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(p.name for p in paths)
    assert (tmp_path / "out" / "Modelfile.Q8_0").read_text().startswith(f"FROM ./{name}.Q8_0.gguf\n")
    single = save_pretrained_gguf(model, tmp_path / "one", tokenizer, "f16", verify=False)
    assert [p.name for p in single] == [f"{name}.F16.gguf", "Modelfile"]


def test_unknown_method_lists_the_valid_ones(tmp_path):
    model, tokenizer = tiny("llama")
    with pytest.raises(
        ValueError, match="unknown GGUF quantization_method 'q3_k_s'; valid: 'f32', 'f16', 'bf16', 'q8_0'"
    ):
        save_pretrained_gguf(model, tmp_path / "x", tokenizer, ["q8_0", "q3_k_s"])
    with pytest.raises(ValueError, match="lists a method twice"):
        save_pretrained_gguf(model, tmp_path / "x", tokenizer, ["q8_0", "Q8_0"])
    assert not (tmp_path / "x").exists()
    assert set(QUANTIZATION_METHODS) == {"f32", *METHODS}
    # The verifier has a tolerance for every method the writer accepts.
    assert set(gguf_verify.TOLERANCES) == set(gguf_verify.WEIGHT_TOLERANCES) == set(QUANTIZATION_METHODS)


def test_saves_add_their_files_and_replace_only_their_own_with_overwrite(tmp_path):
    """As notebooks use it: one folder, one save per quantisation, beside other files. A
    save never deletes what it did not write; replacing its own files needs overwrite."""
    model, tokenizer = tiny("llama")
    name = "llama"
    target = tmp_path / "out"
    target.mkdir()
    (target / "old.txt").write_text("keep me")
    save_pretrained_gguf(model, target, tokenizer, "q8_0", verify=False)
    assert sorted(p.name for p in target.iterdir()) == sorted(["Modelfile", "old.txt", f"{name}.Q8_0.gguf"])
    first = (target / f"{name}.Q8_0.gguf").read_bytes()

    save_pretrained_gguf(model, target, tokenizer, "f16", verify=False)  # another type: added
    names = sorted(["Modelfile", "Modelfile.F16", "old.txt", f"{name}.F16.gguf", f"{name}.Q8_0.gguf"])
    assert sorted(p.name for p in target.iterdir()) == names
    assert (target / f"{name}.Q8_0.gguf").read_bytes() == first
    assert f"FROM ./{name}.Q8_0.gguf" in (target / "Modelfile").read_text()
    assert f"FROM ./{name}.F16.gguf" in (target / "Modelfile.F16").read_text()

    with pytest.raises(DirectoryNotEmptyError, match=rf"already holds {name}\.Q8_0\.gguf.*overwrite=True"):
        save_pretrained_gguf(model, target, tokenizer, "q8_0", verify=False)
    assert sorted(p.name for p in target.iterdir()) == names
    changed = copy.deepcopy(model)  # tiny() is shared by the module's tests
    with torch.no_grad():
        changed.model.embed_tokens.weight.mul_(2)
    save_pretrained_gguf(changed, target, tokenizer, "q8_0", verify=False, overwrite=True)
    assert sorted(p.name for p in target.iterdir()) == names
    assert (target / f"{name}.Q8_0.gguf").read_bytes() != first
    assert (target / "old.txt").read_text() == "keep me"


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    from transformers import Olmo2Config, Olmo2ForCausalLM

    model = Olmo2ForCausalLM(Olmo2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                         pad_token_id=0))  # fmt: skip
    _, tokenizer = tiny("llama")
    records = RECORDS + EXPORT_ONLY_RECORDS
    supported = ", ".join(repr(model_type) for record in records for model_type in record.model_types)
    assert "'qwen3_5_text'" in supported
    assert "'llama', 'mistral', 'gemma', 'qwen2', 'qwen3', 'gemma3_text'" in supported
    experts = ", ".join(repr(model_type) for record in EXPERT_RECORDS for model_type in record.model_types)
    assert "'qwen3_moe', 'gpt_oss', 'mixtral'" in experts
    expected = f"supports the architectures {re.escape(supported)} and the mixture-of-experts {experts}; "
    with pytest.raises(ValueError, match=f"{expected}.* 'olmo2'"):
        save_pretrained_gguf(model, tmp_path / "x", tokenizer, "q8_0")


def test_peft_model_must_be_merged_first(tmp_path):
    from peft import LoraConfig, get_peft_model

    _, tokenizer = tiny("mistral")
    peft_model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_model_path("mistral", **SIZES)),
        LoraConfig(r=2, target_modules=["q_proj"]),
    )
    with pytest.raises(TypeError, match="needs a merged model"):
        save_pretrained_gguf(peft_model, tmp_path / "x", tokenizer, "q8_0")


@needs_llama_cpp
def test_failed_verification_leaves_no_folder(tmp_path, monkeypatch):
    model, tokenizer = tiny("llama")
    monkeypatch.setitem(gguf_verify.TOLERANCES, "q8_0", 1e-6)
    with pytest.raises(GGUFVerificationError, match="above the 1e-06 allowed for q8_0"):
        save_pretrained_gguf(model, tmp_path / "out", tokenizer, "q8_0")  # verify=None: on, llama_cpp is here
    assert list(tmp_path.iterdir()) == []


@needs_llama_cpp
def test_file_weights_read_back_in_hf_layout(exported):
    model, _ = tiny("llama")
    weights = hf_weights_from_gguf(exported("llama", "f16"), model)
    assert set(weights) == set(model.state_dict())
    for name, value in weights.items():
        assert torch.allclose(value, model.state_dict()[name], rtol=1e-3, atol=1e-4), name


def test_push_to_hub_gguf(local_hub, tmp_path):
    from huggingface_hub import hf_hub_download

    from slothkit.export.gguf import push_to_hub_gguf

    model, tokenizer = tiny("llama")
    file = "llama.Q4_K_M.gguf"  # named after the model, not the repo
    result = push_to_hub_gguf(
        model, "local-user/tiny-gguf", tokenizer, "q4_k_m", token="hf_writer", verify=False
    )
    assert set(local_hub.files("local-user/tiny-gguf")) == {
        ".gitattributes",
        file,
        "Modelfile",
    }
    assert sorted(result.files) == ["Modelfile", file]
    pulled = hf_hub_download("local-user/tiny-gguf", file, token="hf_writer", local_dir=tmp_path)
    reader = gguf.GGUFReader(pulled)
    assert (
        field(reader, "general.file_type") == int(gguf.LlamaFileType.MOSTLY_Q4_K_M)
        and len(reader.tensors) == 21
    )


@needs_llama_cpp
def test_lora_model_exports_through_the_attached_method(make_lora_model, tmp_path):
    """FastModel's model.save_pretrained_gguf merges the adapters (slothkit.export.merge) and
    hands the plain model to this writer; llama.cpp then reproduces the LoRA model's logits."""
    model, tokenizer, _ = make_lora_model("mistral", seed=3)
    paths = model.save_pretrained_gguf(
        tmp_path / "out", tokenizer, quantization_method="q8_0"
    )  # verifies too
    q8_0 = quantization_method("q8_0")
    report = verify_gguf(paths[0], model, tokenizer, q8_0)  # against the unmerged LoRA model
    assert report.logit_error < gguf_verify.TOLERANCES["q8_0"]
    with model.disable_adapter(), pytest.raises(GGUFVerificationError, match="logits differ"):
        verify_gguf(paths[0], model, tokenizer, q8_0)  # the file holds the adapters' change


def test_unknown_byte_level_pre_tokenizer_is_refused(tmp_path):
    folder = tmp_path / "tok"
    shutil.copytree(tiny_model_path("llama", **SIZES), folder)
    spec = json.loads((folder / "tokenizer.json").read_text())
    spec["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = r"\p{L}+|\p{N}+|\s+|."  # not a known one
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(ValueError, match="'llama-bpe': by Llama 3's regex"):
        write_gguf(
            tiny("llama")[0],
            tmp_path / "x.gguf",
            AutoTokenizer.from_pretrained(folder),
            quantization_method("q8_0"),
        )
