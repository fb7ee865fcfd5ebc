"""GGUF export of Gemma 4 (llama.cpp's "gemma4" graph): the tiny random Gemma 4 (per-layer
input embeddings, its last two layers reusing the keys and values of the two before with a
double-wide MLP, sliding and full layers alternating with wider full-layer heads and
proportional rope, a window shorter than the prompts), LoRA-adapted, merged, written and run
by llama.cpp against the HF model; and the files a wrong layout would give, which llama.cpp's
logits then tell apart."""

import dataclasses
import importlib.util

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from slothkit.export.gguf import gemma4, save_pretrained_gguf, write_gguf
from slothkit.export.gguf import verify as gguf_verify
from slothkit.export.gguf.layout import architecture_of, gguf_pieces, hf_weights_from_gguf
from slothkit.export.gguf.verify import GGUFVerificationError, verify_gguf
from slothkit.testing.lora_models import load_plain, lora_with_random_b
from slothkit.testing.tiny_generic_models import tiny_generic_model_path

T = gguf.GGMLQuantizationType
needs_llama_cpp = pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None,
    reason="llama-cpp-python is not installed (pip install 'slothkit[gguf]'); it runs the GGUF files",
)
HIDDEN, LAYERS, PER_LAYER, WIDTH = 64, 4, 16, 128  # the tiny Gemma 4's (generic_shapes)
SLIDING_HEAD, FULL_HEAD = 16, 32
# Projections drawn at 0.3 / sqrt(fan_in), as for the tiny Qwen3.5: every layer reaches the
# logits, and llama.cpp's 8-bit rounding of activations stays within its tolerances.
SCALE = 0.3
SOFTCAP = 3.0  # small enough to change these logits (Gemma 4 E4B's is 30, on larger ones)
# The window is 8 tokens: the first prompt runs well past it.
PROMPTS = ("The lighthouse on the northern cape was built " * 2, "Sloths move slowly because")


def _checkpoint(folder, **changes):
    """The tiny Gemma 4 with non-trivial weights: norms and layer scalars drawn in
    [0.5, 1.5), the projections and embeddings as SCALE says, the logits soft-capped."""
    source = tiny_generic_model_path("gemma4_text")
    config = AutoConfig.from_pretrained(source)
    for key, value in {"final_logit_softcapping": SOFTCAP, **changes}.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(("norm.weight", "layer_scalar")):
                parameter.copy_(torch.rand(parameter.shape, generator=generator) + 0.5)
            elif parameter.dim() >= 2:
                parameter.normal_(0, SCALE / parameter.shape[-1] ** 0.5, generator=generator)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(source).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return _checkpoint(tmp_path_factory.mktemp("gemma4") / "tiny-gemma4")


@pytest.fixture(scope="module")
def lora_model(checkpoint):
    """FastModel's LoRA model of the tiny Gemma 4, every adapter's B random."""
    model, tokenizer, _ = lora_with_random_b(checkpoint)
    return model, tokenizer


@needs_llama_cpp
@pytest.mark.parametrize("method", ["f16", "q8_0", "q4_k_m"])
def test_lora_model_exports_through_save_pretrained_gguf(method, lora_model, tmp_path):
    """save_pretrained_gguf merges, writes and verifies; the file, run by llama.cpp, gives the
    LoRA model's logits within the method's tolerance; without the adapters they differ."""
    model, tokenizer = lora_model
    paths = model.save_pretrained_gguf(tmp_path / "out", tokenizer, quantization_method=method)
    report = verify_gguf(paths[0], model, tokenizer, method, prompts=PROMPTS)  # against the unmerged model
    assert report.logit_error < gguf_verify.TOLERANCES[method]
    with model.disable_adapter(), pytest.raises(GGUFVerificationError, match="logits differ"):
        verify_gguf(paths[0], model, tokenizer, method, prompts=PROMPTS)


@needs_llama_cpp
def test_file_is_the_models_weights_run_as_hf_runs_them(checkpoint, tmp_path):
    """At F16 llama.cpp runs the file's own weights as HF does, tightly; at Q4_K_M the weights
    read back are the model's within the type's rounding. (On this tiny model llama.cpp's
    8-bit rounding of activations alone puts its quantised files, its own quantiser's
    included, near GGUF_WEIGHTS_TOLERANCE: docs/gguf-export.md.)"""
    model, tokenizer = load_plain(checkpoint)
    file = write_gguf(model, tmp_path / "f16.gguf", tokenizer, "f16")
    exact = verify_gguf(file, model, tokenizer, "f16", prompts=PROMPTS, reference="gguf_weights")
    assert exact.logit_error < 0.01
    file = write_gguf(model, tmp_path / "q4.gguf", tokenizer, "q4_k_m")
    state = model.state_dict()
    read_back = hf_weights_from_gguf(file, model)
    assert set(read_back) == set(state) - {"lm_head.weight"}  # the head is the tied embeddings
    for name, value in read_back.items():
        error = (value - state[name]).square().mean().sqrt() / state[name].square().mean().sqrt()
        assert error < gguf_verify.WEIGHT_TOLERANCES["q4_k_m"], name


@needs_llama_cpp
def test_file_holds_gemma4_in_llama_cpps_layout(checkpoint, tmp_path):
    """Names, shapes (GGUF's order: row first), types and keys as llama.cpp's gemma4 reads
    them: per-layer widths and head sizes, the shared layers without keys and values, the
    per-layer input tensors, rope_freqs leaving the unrotated pairs still, norms as they are."""
    model, tokenizer = load_plain(checkpoint)
    file = write_gguf(model, tmp_path / "gemma4.gguf", tokenizer, "f32")
    reader = gguf.GGUFReader(file)
    tensors = {t.name: t for t in reader.tensors}

    def field(key):
        return reader.fields[key].contents()

    assert field("general.architecture") == "gemma4"
    assert field("gemma4.feed_forward_length") == [WIDTH, WIDTH, 2 * WIDTH, 2 * WIDTH]
    assert (field("gemma4.attention.key_length"), field("gemma4.attention.key_length_swa")) == (
        FULL_HEAD,
        SLIDING_HEAD,
    )
    assert field("gemma4.attention.head_count_kv") == 2
    assert field("gemma4.attention.shared_kv_layers") == 2
    assert field("gemma4.embedding_length_per_layer_input") == PER_LAYER
    assert field("gemma4.attention.sliding_window") == 8
    assert field("gemma4.attention.sliding_window_pattern") == [True, False, True, False]
    assert (field("gemma4.rope.dimension_count"), field("gemma4.rope.dimension_count_swa")) == (
        FULL_HEAD,
        SLIDING_HEAD,
    )
    assert field("gemma4.rope.freq_base") == pytest.approx(1e6)
    assert field("gemma4.rope.freq_base_swa") == pytest.approx(1e4)
    assert field("gemma4.final_logit_softcapping") == pytest.approx(SOFTCAP)
    # a quarter of the full head rotates: 4 of its 16 pairs
    np.testing.assert_allclose(tensors["rope_freqs.weight"].data, [1.0] * 4 + [1e30] * 12)
    assert list(tensors["per_layer_token_embd.weight"].shape) == [LAYERS * PER_LAYER, 768]
    assert list(tensors["per_layer_model_proj.weight"].shape) == [HIDDEN, LAYERS * PER_LAYER]
    assert list(tensors["blk.0.inp_gate.weight"].shape) == [HIDDEN, PER_LAYER]
    assert list(tensors["blk.0.proj.weight"].shape) == [PER_LAYER, HIDDEN]
    assert list(tensors["blk.1.attn_q.weight"].shape) == [HIDDEN, 4 * FULL_HEAD]
    assert list(tensors["blk.3.ffn_up.weight"].shape) == [HIDDEN, 2 * WIDTH]
    assert "blk.1.attn_k.weight" in tensors and "blk.3.attn_k.weight" not in tensors
    assert "output.weight" not in tensors  # tied to token_embd
    layer = model.model.layers[1]
    np.testing.assert_array_equal(tensors["blk.1.layer_output_scale.weight"].data, layer.layer_scalar.numpy())
    np.testing.assert_array_equal(
        tensors["blk.1.post_norm.weight"].data, layer.post_per_layer_input_norm.weight.detach().numpy()
    )  # w, not 1 + w

    q4 = gguf.GGUFReader(write_gguf(model, tmp_path / "q4.gguf", tokenizer, "q4_k_m"))
    types = {t.name: t.tensor_type for t in q4.tensors}
    # as llama-quantize gives them (compared on this model): the per-layer embeddings as the
    # output (Q6_K, here its fallback Q8_0), the projection unquantised, and layer 1's attn_v
    # the last of two attn_v tensors: Q6_K (Q8_0) by use_more_bits(1, 2)
    assert types["per_layer_token_embd.weight"] == T.Q8_0
    assert types["per_layer_model_proj.weight"] == T.F16
    assert (types["blk.0.attn_v.weight"], types["blk.1.attn_v.weight"]) == (T.Q5_0, T.Q8_0)


def test_every_weight_is_named_as_the_gguf_package_names_it():
    """Every Gemma 4 weight gets gguf-py's name for it in the gemma4 graph (layer_scalar with
    the .weight the converter gives it), and each is a tensor of the graph."""
    import re

    model = AutoModelForCausalLM.from_pretrained(tiny_generic_model_path("gemma4_text"))
    tensor_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA4, LAYERS)
    graph = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[gguf.MODEL_ARCH.GEMMA4]}
    arch = architecture_of(model)
    for hf_name, _ in model.named_parameters():
        stem, _, kind = hf_name.rpartition(".")
        expected = f"{tensor_map.get_name(hf_name)}.weight" if kind == "layer_scalar" else None
        expected = expected or f"{tensor_map.get_name(stem)}.{kind}"
        (piece,) = gguf_pieces(hf_name, arch)
        assert piece.name == expected, hf_name
        assert re.sub(r"^blk\.\d+\.", "blk.{bid}.", piece.name).removesuffix(".weight") in graph


@needs_llama_cpp
@pytest.mark.parametrize("fault", ["every-pair-rotated", "norm-offset-added", "no-softcap"])
def test_a_file_without_a_part_of_the_layout_fails_verification(fault, checkpoint, tmp_path, monkeypatch):
    """Each part counts: the full layers' unrotated pairs rotated (rope_freqs all 1), Gemma's
    1 + w norms instead of Gemma 4's w, or the soft-cap left out give other logits than the
    model's."""
    model, tokenizer = load_plain(checkpoint)
    arch, written = architecture_of(model), model
    if fault == "every-pair-rotated":
        monkeypatch.setattr(gemma4, "_UNROTATED", 1.0)
    elif fault == "norm-offset-added":
        arch = dataclasses.replace(arch, norm_adds_one=True)
    else:
        written, _ = load_plain(_checkpoint(tmp_path / "uncapped", final_logit_softcapping=None))
    file = write_gguf(written, tmp_path / "wrong.gguf", tokenizer, "f32", arch=arch)
    monkeypatch.undo()
    with pytest.raises(GGUFVerificationError, match="logits differ"):
        verify_gguf(file, model, tokenizer, "f32", prompts=PROMPTS)


@pytest.mark.parametrize(
    "changes,message",
    [
        (dict(use_bidirectional_attention="all"), "attends causally"),
        (
            dict(layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"]),
            r"keys and values of layer 0 \(sliding\) and 1 \(full\)",
        ),
    ],
    ids=["bidirectional", "shared-after-another-pattern"],
)
def test_a_gemma4_llama_cpp_would_compute_otherwise_is_refused(changes, message, tmp_path):
    values = AutoConfig.from_pretrained(tiny_generic_model_path("gemma4_text")).to_dict()
    for key in ("model_type", "per_layer_config"):  # the layers' head sizes follow layer_types again
        values.pop(key)
    config = AutoConfig.for_model("gemma4_text", **{**values, "global_head_dim": FULL_HEAD, **changes})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(NotImplementedError, match=message):
        save_pretrained_gguf(model, tmp_path / "out", None, "q8_0")
    assert not (tmp_path / "out").exists()


@needs_llama_cpp
def test_full_layers_with_keys_as_values_run_as_the_model(tmp_path):
    """attention_k_eq_v (Gemma 4 31B's full layers): no v_proj there, the values k_proj's
    output; with one key/value head on the full layers and two on the sliding ones, the file
    states the heads per layer and llama.cpp gives the model's logits."""
    values = AutoConfig.from_pretrained(_checkpoint(tmp_path / "source")).to_dict()
    for key in ("model_type", "per_layer_config"):  # the layers' shapes follow the new settings
        values.pop(key)
    config = AutoConfig.for_model(
        "gemma4_text", **{**values, "global_head_dim": FULL_HEAD, "attention_k_eq_v": True,
                          "num_global_key_value_heads": 1},
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(("norm.weight", "layer_scalar")):
                parameter.copy_(torch.rand(parameter.shape, generator=generator) + 0.5)
            elif parameter.dim() >= 2:
                parameter.normal_(0, SCALE / parameter.shape[-1] ** 0.5, generator=generator)
    assert model.model.layers[1].self_attn.v_proj is None
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "source")
    file = write_gguf(model, tmp_path / "k-eq-v.gguf", tokenizer, "f32")
    reader = gguf.GGUFReader(file)
    assert reader.fields["gemma4.attention.head_count_kv"].contents() == [2, 1, 2, 1]
    assert "blk.1.attn_v.weight" not in {t.name for t in reader.tensors}
    report = verify_gguf(file, model, tokenizer, "f32", prompts=PROMPTS)
    assert report.logit_error < gguf_verify.TOLERANCES["f32"]


def _moe_model(folder):
    """A tiny Gemma 4 with the mixture-of-experts block beside each layer's MLP (26B-A4B's
    layout: 4 experts of width 64, 2 per token), its router's scales drawn in [0.5, 1.5)."""
    values = AutoConfig.from_pretrained(_checkpoint(folder)).to_dict()
    for key in ("model_type", "per_layer_config"):
        values.pop(key)
    config = AutoConfig.for_model(
        "gemma4_text", **{**values, "global_head_dim": FULL_HEAD, "enable_moe_block": True, "num_experts": 4,
                          "top_k_experts": 2, "moe_intermediate_size": 64},
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(("norm.weight", "layer_scalar", "router.scale", "per_expert_scale")):
                parameter.copy_(torch.rand(parameter.shape, generator=generator) + 0.5)
            elif parameter.dim() >= 2:
                parameter.normal_(0, SCALE / parameter.shape[-1] ** 0.5, generator=generator)
    return model, AutoTokenizer.from_pretrained(folder)


@needs_llama_cpp
def test_the_mixture_of_experts_block_runs_as_the_model(tmp_path):
    """enable_moe_block (26B-A4B): the router (its weight, input scale and per-expert scales),
    the fused gate/up and down expert stacks and the block's three norms are written as
    llama.cpp's gemma4 reads them, and llama.cpp gives the model's logits at F16; a file of
    the model without its per-expert scales (all 1) fails verification."""
    model, tokenizer = _moe_model(tmp_path / "source")
    file = write_gguf(model, tmp_path / "moe.gguf", tokenizer, "f16")
    reader = gguf.GGUFReader(file)
    tensors = {t.name: t for t in reader.tensors}
    assert (
        reader.fields["gemma4.expert_count"].contents(),
        reader.fields["gemma4.expert_used_count"].contents(),
    ) == (
        4,
        2,
    )
    assert list(tensors["blk.0.ffn_gate_up_exps.weight"].shape) == [HIDDEN, 2 * 64, 4]
    assert list(tensors["blk.0.ffn_down_exps.weight"].shape) == [64, HIDDEN, 4]
    assert list(tensors["blk.0.ffn_down_exps.scale"].shape) == [4]
    assert tensors["blk.0.ffn_gate_inp.scale"].tensor_type == T.F32
    assert {
        "blk.0.pre_ffw_norm_2.weight",
        "blk.0.post_ffw_norm_1.weight",
        "blk.0.post_ffw_norm_2.weight",
    } <= set(tensors)
    report = verify_gguf(file, model, tokenizer, "f16", prompts=PROMPTS)
    assert report.logit_error < gguf_verify.TOLERANCES["f16"]

    with torch.no_grad():
        scales = [layer.router.per_expert_scale.clone() for layer in model.model.layers]
        for layer in model.model.layers:
            layer.router.per_expert_scale.fill_(1.0)
        wrong = write_gguf(model, tmp_path / "unscaled.gguf", tokenizer, "f32")
        for layer, scale in zip(model.model.layers, scales):
            layer.router.per_expert_scale.copy_(scale)
    with pytest.raises(GGUFVerificationError, match="logits differ"):
        verify_gguf(wrong, model, tokenizer, "f32", prompts=PROMPTS)
