"""GGUF export of Qwen3.5 (llama.cpp's "qwen35" graph): the tiny random Qwen3.5 (three gated
DeltaNet layers, then a gated attention layer; two key heads for four value heads, so the
value heads' order counts), LoRA-adapted, merged, written and run by llama.cpp against the
HF model; and the files a wrong layout would give, which llama.cpp's logits then tell apart."""

import dataclasses
import importlib.util

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from slothkit.export.gguf import deltanet, save_pretrained_gguf, write_gguf
from slothkit.export.gguf import verify as gguf_verify
from slothkit.export.gguf.layout import architecture_of, gguf_pieces
from slothkit.export.gguf.verify import GGUFVerificationError, verify_gguf
from slothkit.testing.lora_models import load_plain, lora_with_random_b
from slothkit.testing.tiny_generic_models import tiny_generic_model_path

T = gguf.GGMLQuantizationType
needs_llama_cpp = pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None,
    reason="llama-cpp-python is not installed (pip install 'slothkit[gguf]'); it runs the GGUF files",
)
HIDDEN, KEY_HEADS, VALUE_HEADS, HEAD = 64, 2, 4, 16  # the tiny Qwen3.5's (generic_shapes)
# Projections drawn at 0.3 / sqrt(fan_in): large enough that every layer reaches the logits,
# small enough that llama.cpp's 8-bit rounding of activations stays within its tolerance
# (at 1 / sqrt(fan_in) llama.cpp's own quantiser's Q8_0 file is 0.08 from the HF model on its
# own weights, beyond GGUF_WEIGHTS_TOLERANCE).
SCALE = 0.3


def _checkpoint(folder):
    """The tiny Qwen3.5 with non-trivial weights: its norms away from their neutral value
    (0 for the 1 + w norms, 1 for the DeltaNet's gated norm), A_log and dt_bias drawn at
    order one, the projections as SCALE says."""
    source = tiny_generic_model_path("qwen3_5_text")
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            uniform = torch.rand(parameter.shape, generator=generator)
            if name.endswith("linear_attn.norm.weight"):
                parameter.copy_(uniform + 0.5)
            elif name.endswith("norm.weight"):
                parameter.copy_(uniform - 0.5)
            elif name.endswith(("A_log", "dt_bias")):
                parameter.copy_(torch.randn(parameter.shape, generator=generator))
            elif parameter.dim() >= 2:
                parameter.normal_(0, SCALE / parameter.shape[-1] ** 0.5, generator=generator)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(source).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return _checkpoint(tmp_path_factory.mktemp("qwen3_5") / "tiny-qwen3.5")


@pytest.fixture(scope="module")
def lora_model(checkpoint):
    """FastModel's LoRA model of the tiny Qwen3.5, every adapter's B random."""
    model, tokenizer, adapted = lora_with_random_b(checkpoint)
    assert any("linear_attn" in name for name in adapted) and any("self_attn" in name for name in adapted)
    return model, tokenizer


@needs_llama_cpp
@pytest.mark.parametrize("method", ["f16", "q8_0", "q4_k_m"])
def test_lora_model_exports_through_save_pretrained_gguf(method, lora_model, tmp_path):
    """save_pretrained_gguf merges, writes and verifies; the file, run by llama.cpp, gives the
    LoRA model's logits within the method's tolerance; without the adapters they differ."""
    model, tokenizer = lora_model
    paths = model.save_pretrained_gguf(tmp_path / "out", tokenizer, quantization_method=method)
    report = verify_gguf(paths[0], model, tokenizer, method)  # against the unmerged model
    assert report.logit_error < gguf_verify.TOLERANCES[method]
    with model.disable_adapter(), pytest.raises(GGUFVerificationError, match="logits differ"):
        verify_gguf(paths[0], model, tokenizer, method)


@needs_llama_cpp
@pytest.mark.parametrize("method", ["q8_0", "q4_k_m"])
def test_quantised_file_is_the_models_weights_run_as_hf_runs_them(method, checkpoint, tmp_path):
    """The weights read back (DeltaNet's undone: value heads grouped again, log(-A)) are the
    model's within the type's rounding, and llama.cpp runs them as HF does, tightly."""
    model, tokenizer = load_plain(checkpoint)
    file = write_gguf(model, tmp_path / "qwen3_5.gguf", tokenizer, method)
    exact = verify_gguf(file, model, tokenizer, method, reference="gguf_weights")
    assert exact.logit_error < gguf_verify.GGUF_WEIGHTS_TOLERANCE
    assert exact.weight_error < gguf_verify.WEIGHT_TOLERANCES[method]


@needs_llama_cpp
def test_file_holds_qwen3_5_in_llama_cpps_layout(checkpoint, tmp_path):
    """Names, shapes (GGUF's order: row first), types and keys as llama.cpp's qwen35 reads
    them, and the DeltaNet tensors' contents: A = -exp(A_log), the value heads tiled, the
    convolution's channel axis dropped, the gated norm without the offset the others get."""
    model, tokenizer = load_plain(checkpoint)
    file = write_gguf(model, tmp_path / "qwen3_5.gguf", tokenizer, "f32")
    reader = gguf.GGUFReader(file)
    tensors = {t.name: t for t in reader.tensors}

    def field(key):
        return reader.fields[key].contents()

    assert field("general.architecture") == "qwen35"
    assert field("qwen35.full_attention_interval") == 4
    assert (field("qwen35.ssm.group_count"), field("qwen35.ssm.time_step_rank")) == (KEY_HEADS, VALUE_HEADS)
    assert (field("qwen35.ssm.state_size"), field("qwen35.ssm.inner_size")) == (HEAD, VALUE_HEADS * HEAD)
    assert field("qwen35.ssm.conv_kernel") == 4
    assert field("qwen35.rope.dimension_count") == 4  # a quarter of 16
    assert field("qwen35.rope.dimension_sections") == [1, 1, 0, 0]  # two pairs: time, height
    qkv_rows = 2 * KEY_HEADS * HEAD + VALUE_HEADS * HEAD
    for name, shape in [
        ("attn_qkv.weight", [HIDDEN, qkv_rows]),
        ("attn_gate.weight", [HIDDEN, VALUE_HEADS * HEAD]),
        ("ssm_alpha.weight", [HIDDEN, VALUE_HEADS]),
        ("ssm_beta.weight", [HIDDEN, VALUE_HEADS]),
        ("ssm_a", [VALUE_HEADS]),
        ("ssm_dt.bias", [VALUE_HEADS]),
        ("ssm_conv1d.weight", [4, qkv_rows]),
        ("ssm_norm.weight", [HEAD]),
        ("ssm_out.weight", [VALUE_HEADS * HEAD, HIDDEN]),
        ("post_attention_norm.weight", [HIDDEN]),
    ]:
        assert list(tensors[f"blk.0.{name}"].shape) == shape, name
    assert list(tensors["blk.3.attn_q.weight"].shape) == [HIDDEN, 2 * 4 * HEAD]  # queries and gates
    assert "blk.3.ssm_a" not in tensors and "blk.0.attn_q.weight" not in tensors

    layer = model.model.layers[0].linear_attn
    tiled = [0, 2, 1, 3]  # value heads (key head, r): (0,0) (1,0) (0,1) (1,1)
    np.testing.assert_allclose(
        tensors["blk.0.ssm_a"].data, -layer.A_log.detach().exp().numpy()[tiled], rtol=1e-6
    )
    np.testing.assert_array_equal(tensors["blk.0.ssm_dt.bias"].data, layer.dt_bias.detach().numpy()[tiled])
    z = layer.in_proj_z.weight.detach().reshape(VALUE_HEADS, HEAD, HIDDEN)[tiled].reshape(-1, HIDDEN)
    np.testing.assert_array_equal(tensors["blk.0.attn_gate.weight"].data, z.numpy())
    conv = layer.conv1d.weight.detach()[:, 0]  # (channels, width)
    values = conv[2 * KEY_HEADS * HEAD :].reshape(VALUE_HEADS, HEAD, 4)[tiled].reshape(-1, 4)
    expected = torch.cat([conv[: 2 * KEY_HEADS * HEAD], values])
    np.testing.assert_array_equal(tensors["blk.0.ssm_conv1d.weight"].data, expected.numpy())
    np.testing.assert_array_equal(tensors["blk.0.ssm_norm.weight"].data, layer.norm.weight.detach().numpy())
    norm = model.model.layers[0].input_layernorm.weight.detach().numpy()
    np.testing.assert_allclose(tensors["blk.0.attn_norm.weight"].data, norm + 1, rtol=1e-6)

    q4 = gguf.GGUFReader(write_gguf(model, tmp_path / "q4.gguf", tokenizer, "q4_k_m"))
    types = {t.name: t.tensor_type for t in q4.tensors}
    assert types["blk.0.ssm_conv1d.weight"] == T.F32  # ggml's ssm_conv reads F32
    # llama-quantize's Q4_K_M: attn_qkv as attn_v, Q6_K (here its fallback Q8_0) in layer 2 of 4
    assert (types["blk.1.attn_qkv.weight"], types["blk.2.attn_qkv.weight"]) == (T.Q5_0, T.Q8_0)


def test_every_weight_is_named_as_the_gguf_package_names_it(checkpoint):
    """Every Qwen3.5 weight gets gguf-py's name for it in the qwen35 graph (dt_bias as the
    converter renames it, dt_proj.bias; A_log with no suffix, as ssm_a), and each is a tensor
    of the graph."""
    import re

    model, _ = load_plain(checkpoint)
    tensor_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN35, model.config.num_hidden_layers)
    graph = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[gguf.MODEL_ARCH.QWEN35]}
    arch = architecture_of(model)
    for hf_name, _ in model.named_parameters():
        stem, _, kind = hf_name.rpartition(".")
        if kind == "A_log":
            expected = tensor_map.get_name(hf_name)
        elif kind == "dt_bias":
            expected = tensor_map.get_name(f"{stem}.dt_proj") + ".bias"
        else:
            expected = f"{tensor_map.get_name(stem)}.{kind}"
        (piece,) = gguf_pieces(hf_name, arch)
        assert piece.name == expected, hf_name
        assert (
            re.sub(r"^blk\.\d+\.", "blk.{bid}.", piece.name).removesuffix(".weight").removesuffix(".bias")
            in graph
        )


@needs_llama_cpp
@pytest.mark.parametrize("fault", ["grouped-value-heads", "a-log-as-stored", "no-norm-offset"])
def test_a_file_without_a_part_of_the_layout_fails_verification(fault, checkpoint, tmp_path, monkeypatch):
    """Each part of the DeltaNet layout counts: value heads left grouped by key head, A_log
    stored instead of A, or the 1 + w norms written as w give other logits than the model's."""
    model, tokenizer = load_plain(checkpoint)
    arch = architecture_of(model)
    if fault == "grouped-value-heads":
        monkeypatch.setattr(deltanet, "_tiled", lambda value, *args: value)
    elif fault == "a-log-as-stored":
        monkeypatch.setitem(deltanet._STORED, "ssm_a", (lambda a_log: a_log, lambda a: a))
    else:
        arch = dataclasses.replace(arch, norm_adds_one=False)
    file = write_gguf(model, tmp_path / "wrong.gguf", tokenizer, "f32", arch=arch)
    monkeypatch.undo()
    with pytest.raises(GGUFVerificationError, match="logits differ"):
        verify_gguf(file, model, tokenizer, "f32")


def test_a_layer_pattern_llama_cpp_cannot_state_is_refused(tmp_path):
    """llama.cpp's qwen35 graph reads one full_attention_interval: another pattern is refused
    before anything is written."""
    config = AutoConfig.for_model(
        "qwen3_5_text", hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=768, pad_token_id=0, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
    )  # fmt: skip
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(NotImplementedError, match="full_attention_interval n"):
        save_pretrained_gguf(model, tmp_path / "out", None, "q8_0")
    assert not (tmp_path / "out").exists()


@needs_llama_cpp
def test_a_llama_cpp_python_older_than_the_graph_is_refused_by_name(checkpoint, tmp_path, monkeypatch):
    """Verification names the llama-cpp-python release that runs qwen35 when an older one is
    installed, and refuses before loading anything."""
    import llama_cpp

    model, tokenizer = load_plain(checkpoint)
    file = write_gguf(model, tmp_path / "qwen3_5.gguf", tokenizer, "f16")
    monkeypatch.setattr(llama_cpp, "__version__", "0.3.16")
    with pytest.raises(GGUFVerificationError, match=r"'qwen35' architecture needs llama-cpp-python 0\.3\.36"):
        verify_gguf(file, model, tokenizer, "f16")


@needs_llama_cpp
def test_an_architecture_llama_cpp_does_not_know_fails_with_its_name(checkpoint, tmp_path):
    """A file whose general.architecture the installed llama.cpp does not know (as qwen35 is
    to an older one) fails verification with the architecture named, not a crash."""
    model, tokenizer = load_plain(checkpoint)
    arch = architecture_of(model)
    unknown = dataclasses.replace(
        arch, gguf=dataclasses.replace(arch.gguf, arch="qwen99", llama_cpp_python=None)
    )
    file = write_gguf(model, tmp_path / "unknown.gguf", tokenizer, "f16", arch=unknown)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("slothkit.export.gguf.verify.architecture_of", lambda model: unknown)
        with pytest.raises(GGUFVerificationError, match="could not load the file, of architecture 'qwen99'"):
            verify_gguf(file, model, tokenizer, "f16")


# Qwen3.5's MoE sizes (qwen3_5_moe_text, llama.cpp's qwen35moe): the same layers with 4
# experts of width 64 (2 per token) and a shared expert of width 64 in every layer.
MOE = dict(
    hidden_size=HIDDEN, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=HEAD,
    vocab_size=768, linear_num_key_heads=KEY_HEADS, linear_num_value_heads=VALUE_HEADS,
    linear_key_head_dim=HEAD, linear_value_head_dim=HEAD, moe_intermediate_size=64,
    shared_expert_intermediate_size=64, num_experts=4, num_experts_per_tok=2, pad_token_id=0,
)  # fmt: skip


@pytest.fixture(scope="module")
def moe_model():
    """The tiny Qwen3.5 MoE with its weights drawn as _checkpoint draws the dense one's, and
    the dense tiny model's tokenizer."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_generic_model_path("qwen3_5_text"))
    torch.manual_seed(0)
    config = AutoConfig.for_model("qwen3_5_moe_text", **MOE, eos_token_id=tokenizer.eos_token_id)
    model = AutoModelForCausalLM.from_config(config).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            uniform = torch.rand(parameter.shape, generator=generator)
            if name.endswith("linear_attn.norm.weight"):
                parameter.copy_(uniform + 0.5)
            elif name.endswith("norm.weight"):
                parameter.copy_(uniform - 0.5)
            elif name.endswith(("A_log", "dt_bias")):
                parameter.copy_(torch.randn(parameter.shape, generator=generator))
            elif parameter.dim() >= 2:
                parameter.normal_(0, SCALE / parameter.shape[-1] ** 0.5, generator=generator)
    return model, tokenizer


@needs_llama_cpp
@pytest.mark.parametrize("method", ["f16", "q8_0"])
def test_moe_file_runs_in_llama_cpp_as_the_model(method, moe_model, tmp_path):
    """The MoE file, run by llama.cpp, gives the model's logits within the method's tolerance;
    the file holds the experts as stacks, the shared expert and its one-row gate (F32) beside
    them, and the expert widths as keys. (A random router scores experts nearly alike, so the
    read-back weights' rounding moves some tokens to other experts: the gguf_weights check is
    not the measure here, as for Qwen3-MoE: docs/gguf-export.md.)"""
    model, tokenizer = moe_model
    file = write_gguf(model, tmp_path / "moe.gguf", tokenizer, method)
    report = verify_gguf(file, model, tokenizer, method)
    assert report.logit_error < gguf_verify.TOLERANCES[method]
    reader = gguf.GGUFReader(file)
    tensors = {t.name: t for t in reader.tensors}
    assert reader.fields["general.architecture"].contents() == "qwen35moe"
    assert reader.fields["qwen35moe.expert_shared_feed_forward_length"].contents() == 64
    assert reader.fields["qwen35moe.expert_feed_forward_length"].contents() == 64
    assert "qwen35moe.feed_forward_length" not in reader.fields  # no dense MLP
    assert list(tensors["blk.0.ffn_gate_exps.weight"].shape) == [HIDDEN, 64, 4]
    assert list(tensors["blk.0.ffn_up_shexp.weight"].shape) == [HIDDEN, 64]
    assert tensors["blk.0.ffn_gate_inp_shexp.weight"].tensor_type == T.F32
    assert "blk.0.ssm_a" in tensors and "blk.3.attn_q.weight" in tensors


@needs_llama_cpp
def test_moe_file_with_gate_and_up_exchanged_fails_verification(moe_model, tmp_path):
    """The experts' gate and up halves taken the other way round (as alternating columns)
    give other logits than the model's."""
    model, tokenizer = moe_model
    arch = architecture_of(model)
    experts = dataclasses.replace(arch.gguf.experts, interleaved=True)
    arch = dataclasses.replace(arch, gguf=dataclasses.replace(arch.gguf, experts=experts))
    file = write_gguf(model, tmp_path / "wrong.gguf", tokenizer, "f32", arch=arch)
    with pytest.raises(GGUFVerificationError, match="logits differ"):
        verify_gguf(file, model, tokenizer, "f32")


def test_every_moe_weight_is_named_as_the_gguf_package_names_it(moe_model):
    """The shared expert, its gate and the router get gguf-py's qwen35moe names; the expert
    stacks the names of separate gate_proj and up_proj, as for Qwen3-MoE."""
    import re

    model, _ = moe_model
    tensor_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN35MOE, 4)
    graph = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[gguf.MODEL_ARCH.QWEN35MOE]}
    arch = architecture_of(model)
    for hf_name, _ in model.named_parameters():
        stem, _, kind = hf_name.rpartition(".")
        if kind == "gate_up_proj":
            expected = [
                f"{tensor_map.get_name(f'{stem}.{half}')}.weight" for half in ("gate_proj", "up_proj")
            ]
        elif kind == "down_proj" and ".experts" in stem:
            expected = [f"{tensor_map.get_name(hf_name)}.weight"]
        elif kind in ("A_log", "dt_bias"):
            continue  # as the dense model's (test_every_weight_is_named_as_the_gguf_package_names_it)
        else:
            expected = [f"{tensor_map.get_name(stem)}.{kind}"]
        pieces = gguf_pieces(hf_name, arch)
        assert [piece.name for piece in pieces] == expected, hf_name
        for piece in pieces:
            assert re.sub(r"^blk\.\d+\.", "blk.{bid}.", piece.name).removesuffix(".weight") in graph
