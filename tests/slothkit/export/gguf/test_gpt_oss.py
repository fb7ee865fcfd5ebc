"""GGUF export of gpt-oss (llama.cpp's "gpt-oss" graph): a tiny random gpt-oss with its
attention sinks, attention and expert biases, interleaved gate and up, sliding and full
layers alternating and YaRN rope, LoRA-adapted on its attention and experts, merged, written
and run by llama.cpp against the HF model; and the files a wrong layout would give, which
llama.cpp's logits then tell apart."""

import dataclasses
import importlib.util
import warnings

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from slothkit.core.notices import DataWarning, say_once
from slothkit.export.gguf import save_pretrained_gguf, write_gguf
from slothkit.export.gguf import verify as gguf_verify
from slothkit.export.gguf.layout import architecture_of
from slothkit.export.gguf.tensor_types import quantization_method
from slothkit.export.gguf.verify import GGUFVerificationError, verify_gguf
from slothkit.testing import build_tiny_tokenizer
from slothkit.testing.lora_models import load_plain, lora_with_random_b

T = gguf.GGMLQuantizationType
# gpt-oss's unrounded YaRN range gives a notice at every export; its own test checks it.
pytestmark = pytest.mark.filterwarnings("ignore::slothkit.core.notices.DataWarning")
needs_llama_cpp = pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None,
    reason="llama-cpp-python is not installed (pip install 'slothkit[gguf]'); it runs the GGUF files",
)
EXPERTS, USED, WIDTH, HIDDEN, HEADS, WINDOW = 4, 2, 64, 64, 4, 4  # rows of 64: whole Q8_0 blocks
# YaRN as gpt-oss sets it, over an original context of 256 so that the prompts' positions
# reach the slowed pairs' range.
YARN = dict(
    rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
    original_max_position_embeddings=256, rope_theta=150_000.0,
)  # fmt: skip
GPT_OSS = dict(
    hidden_size=HIDDEN, intermediate_size=WIDTH, num_local_experts=EXPERTS, num_experts_per_tok=USED,
    num_hidden_layers=2, num_attention_heads=HEADS, num_key_value_heads=2, head_dim=16, vocab_size=768,
    max_position_embeddings=8192, pad_token_id=0, sliding_window=WINDOW, rope_parameters=YARN,
    # weights drawn at 0.1 (transformers' default: 0.02) so that attention's output, and with
    # it the sinks, reaches the logits
    initializer_range=0.1,
)  # fmt: skip
# A prompt well past the window, so that the sliding layer's mask counts.
PROMPTS = ("The lighthouse on the northern cape was built " * 5, "Sloths move slowly because")


def _checkpoint(folder, **changes):
    """The tiny gpt-oss saved with its tokenizer: sinks and biases drawn at order one (they
    start at zero), norms away from 1, and gate and up large enough that the clamp, the
    sigmoid and the +1 of gpt-oss's SwiGLU tell gate from up."""
    torch.manual_seed(0)
    config = AutoConfig.for_model("gpt_oss", **{**GPT_OSS, **changes})
    model = AutoModelForCausalLM.from_config(config)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(("sinks", "bias")):
                parameter.copy_(torch.randn(parameter.shape, generator=generator))
            if name.endswith("norm.weight"):
                parameter.uniform_(0.5, 1.5, generator=generator)
            if name.endswith("gate_up_proj"):
                parameter.normal_(0, 1.5 / HIDDEN**0.5, generator=generator)
    model.save_pretrained(folder)
    build_tiny_tokenizer("bpe", folder)
    return folder


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return _checkpoint(tmp_path_factory.mktemp("gpt_oss") / "tiny-gpt-oss")


@pytest.fixture(scope="module")
def lora_model(checkpoint):
    """FastModel's LoRA model of the tiny gpt-oss, every adapter's B random."""
    model, tokenizer, adapted = lora_with_random_b(checkpoint)
    assert any("experts" in name for name in adapted) and any("q_proj" in name for name in adapted)
    return model, tokenizer


@needs_llama_cpp
@pytest.mark.parametrize("method", ["f16", "q8_0"])
def test_lora_model_exports_with_the_experts_updates(method, lora_model, tmp_path):
    """The merged file, run by llama.cpp, gives the LoRA model's logits within the method's
    tolerance; without the adapters the logits differ."""
    model, tokenizer = lora_model
    paths = model.save_pretrained_gguf(tmp_path / "out", tokenizer, quantization_method=method, verify=False)
    method = quantization_method(method)
    report = verify_gguf(paths[0], model, tokenizer, method, prompts=PROMPTS)  # against the unmerged model
    assert report.logit_error < gguf_verify.TOLERANCES[method.name]
    with model.disable_adapter(), pytest.raises(GGUFVerificationError, match="logits differ"):
        verify_gguf(paths[0], model, tokenizer, method, prompts=PROMPTS)


@needs_llama_cpp
def test_file_holds_gpt_oss_in_llama_cpps_layout(checkpoint, tmp_path):
    """Tensor names, GGUF shapes (reversed: row first), types and metadata as llama.cpp's
    gpt-oss reads them; gate and up are the even and odd columns of gate_up_proj; the
    weights read back are the model's and llama.cpp runs them as HF does, tightly."""
    model, tokenizer = load_plain(checkpoint)
    q8_0 = quantization_method("q8_0")
    file = write_gguf(model, tmp_path / "gpt-oss.gguf", tokenizer, q8_0)
    reader = gguf.GGUFReader(file)
    tensors = {t.name: t for t in reader.tensors}

    def field(key):
        return reader.fields[key].contents()

    assert field("general.architecture") == "gpt-oss"
    assert (field("gpt-oss.expert_count"), field("gpt-oss.expert_used_count")) == (EXPERTS, USED)
    assert field("gpt-oss.expert_feed_forward_length") == WIDTH
    assert field("gpt-oss.attention.sliding_window") == WINDOW
    assert field("gpt-oss.rope.scaling.type") == "yarn"
    assert field("gpt-oss.rope.scaling.factor") == pytest.approx(32.0)
    assert field("gpt-oss.rope.scaling.original_context_length") == 256
    for layer in range(2):
        experts = model.model.layers[layer].mlp.experts
        for name, shape, qtype in [
            ("attn_sinks.weight", [HEADS], T.F32),
            ("attn_q.bias", [HEADS * 16], T.F32),
            ("post_attention_norm.weight", [HIDDEN], T.F32),
            ("ffn_gate_inp.weight", [HIDDEN, EXPERTS], T.F32),
            ("ffn_gate_inp.bias", [EXPERTS], T.F32),
            ("ffn_gate_exps.weight", [HIDDEN, WIDTH, EXPERTS], T.Q8_0),
            ("ffn_up_exps.weight", [HIDDEN, WIDTH, EXPERTS], T.Q8_0),
            ("ffn_down_exps.weight", [WIDTH, HIDDEN, EXPERTS], T.Q8_0),
            ("ffn_gate_exps.bias", [WIDTH, EXPERTS], T.F32),
            ("ffn_up_exps.bias", [WIDTH, EXPERTS], T.F32),
            ("ffn_down_exps.bias", [HIDDEN, EXPERTS], T.F32),
        ]:
            tensor = tensors[f"blk.{layer}.{name}"]
            assert (list(tensor.shape), tensor.tensor_type) == (shape, qtype), name
        gate_up = experts.gate_up_proj.detach().transpose(1, 2)  # (E, 2I, hidden): an expert's rows
        scale = gate_up.abs().max().item()
        for half, rows in (("gate", gate_up[:, 0::2]), ("up", gate_up[:, 1::2])):
            stored = gguf.quants.dequantize(tensors[f"blk.{layer}.ffn_{half}_exps.weight"].data, T.Q8_0)
            np.testing.assert_allclose(stored, rows.numpy(), atol=scale / 100)
        bias = experts.gate_up_proj_bias.detach().numpy()
        np.testing.assert_array_equal(tensors[f"blk.{layer}.ffn_gate_exps.bias"].data, bias[:, 0::2])
        np.testing.assert_array_equal(tensors[f"blk.{layer}.ffn_up_exps.bias"].data, bias[:, 1::2])
        down = gguf.quants.dequantize(tensors[f"blk.{layer}.ffn_down_exps.weight"].data, T.Q8_0)
        expected = experts.down_proj.detach().transpose(1, 2).numpy()  # (E, hidden, I)
        np.testing.assert_allclose(down, expected, atol=np.abs(expected).max() / 100)
    exact = verify_gguf(file, model, tokenizer, q8_0, prompts=PROMPTS, reference="gguf_weights")
    assert exact.logit_error < gguf_verify.GGUF_WEIGHTS_TOLERANCE
    assert exact.weight_error < gguf_verify.WEIGHT_TOLERANCES["q8_0"]


@needs_llama_cpp
@pytest.mark.parametrize("fault", ["gate-and-up-halves", "no-sinks", "no-yarn", "other-window"])
def test_a_file_without_a_part_of_gpt_oss_fails_verification(fault, checkpoint, tmp_path):
    """Each part of the layout counts: the file written with gate and up taken as halves
    instead of alternating columns, with the sinks at zero, from the model without YaRN, or
    from the model with another window gives other logits than the model's."""
    model, tokenizer = load_plain(checkpoint)
    f32 = quantization_method("f32")  # llama.cpp within 0.001 of HF: any fault shows
    arch = architecture_of(model)
    wrong = model
    if fault == "gate-and-up-halves":
        experts = dataclasses.replace(arch.gguf.experts, interleaved=False)
        arch = dataclasses.replace(arch, gguf=dataclasses.replace(arch.gguf, experts=experts))
    elif fault == "no-sinks":
        wrong, _ = load_plain(checkpoint)
        with torch.no_grad():
            for layer in wrong.model.layers:
                layer.self_attn.sinks.zero_()
    elif fault == "no-yarn":
        wrong, _ = load_plain(
            _checkpoint(
                tmp_path / "no-yarn", rope_parameters={"rope_type": "default", "rope_theta": 150_000.0}
            )
        )
    else:
        wrong, _ = load_plain(_checkpoint(tmp_path / "other-window", sliding_window=2 * WINDOW))
    file = write_gguf(wrong, tmp_path / "wrong.gguf", tokenizer, f32, arch=arch)
    with pytest.raises(GGUFVerificationError, match="logits differ"):
        verify_gguf(file, model, tokenizer, f32, prompts=PROMPTS)


@needs_llama_cpp
def test_unrounded_yarn_range_is_written_with_a_notice_and_stays_close(checkpoint, tmp_path):
    """gpt-oss's truncate: false, which llama.cpp cannot state: a DataWarning says so, and the
    file, run by llama.cpp, stays within F32's tolerance of the model on this tiny one; the
    same model with a rounded range matches closer still."""
    say_once.cache_clear()
    model, tokenizer = load_plain(checkpoint)
    f32 = quantization_method("f32")
    with pytest.warns(DataWarning, match="truncate: false"):
        file = write_gguf(model, tmp_path / "unrounded.gguf", tokenizer, f32)
    unrounded = verify_gguf(file, model, tokenizer, f32, prompts=PROMPTS).logit_error
    rounded_model, _ = load_plain(
        _checkpoint(tmp_path / "rounded", rope_parameters={**YARN, "truncate": True})
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", DataWarning)  # no notice for a range llama.cpp states
        file = write_gguf(rounded_model, tmp_path / "rounded.gguf", tokenizer, f32)
    rounded = verify_gguf(file, rounded_model, tokenizer, f32, prompts=PROMPTS).logit_error
    assert rounded < unrounded < gguf_verify.TOLERANCES["f32"]


@pytest.mark.parametrize(
    "changes,message",
    [
        (
            dict(swiglu_limit=5.0),
            "swiglu_limit=7.0 and reads no setting for it; this model has swiglu_limit=5.0",
        ),
        (dict(swiglu_alpha=1.5), "it accepts swiglu_alpha=1.702"),
        (
            dict(layer_types=["full_attention", "sliding_attention"]),
            r"slides on the layers i with i % 2 != 1 .* this model's sliding layers are \[False, True\]",
        ),
        (dict(rope_parameters={**YARN, "attention_factor": 1.0}), "attention_factor=1.0; it accepts"),
        (
            dict(rope_parameters={**YARN, "mscale": 1.0, "mscale_all_dim": 1.0}),
            "mscale=1.0, which it cannot run",
        ),
    ],
    ids=["swiglu-limit", "swiglu-alpha", "sliding-pattern", "yarn-attention-factor", "yarn-mscale"],
)
def test_a_gpt_oss_llama_cpp_computes_otherwise_is_refused(changes, message, tmp_path):
    config = AutoConfig.for_model("gpt_oss", **{**GPT_OSS, **changes})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(NotImplementedError, match=message):
        save_pretrained_gguf(model, tmp_path / "out", None, "q8_0")
    assert not (tmp_path / "out").exists()


def test_yarn_is_refused_for_a_graph_that_does_not_run_it(tmp_path):
    """YaRN is written only for the records whose llama.cpp graph is known to run it."""
    config = AutoConfig.for_model(
        "qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=768, pad_token_id=0, rope_parameters=YARN,
    )  # fmt: skip
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(
        NotImplementedError, match="'yarn' rope scaling is supported for the gpt-oss architecture only"
    ):
        save_pretrained_gguf(model, tmp_path / "out", None, "q8_0")
