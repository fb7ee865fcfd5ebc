"""GGUF export of a mixture-of-experts model (slothkit.export.gguf.experts): a tiny random
Qwen3-MoE, LoRA-adapted on its attention and on every expert (target_parameters) with
random B, merged, written as llama.cpp's qwen3moe and run by llama.cpp against the HF model."""

import importlib.util

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from slothkit import FastModel
from slothkit.export.gguf import save_pretrained_gguf, write_gguf
from slothkit.export.gguf import verify as gguf_verify
from slothkit.export.gguf.tensor_types import quantization_method
from slothkit.export.gguf.verify import GGUFVerificationError, verify_gguf
from slothkit.testing import build_tiny_tokenizer

T = gguf.GGMLQuantizationType
needs_llama_cpp = pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None,
    reason="llama-cpp-python is not installed (pip install 'slothkit[gguf]'); it runs the GGUF files",
)
EXPERTS, USED, WIDTH, HIDDEN = 6, 2, 64, 64  # rows of 64: whole Q8_0 blocks
QWEN3_MOE = dict(
    hidden_size=HIDDEN, intermediate_size=128, moe_intermediate_size=WIDTH, num_experts=EXPERTS,
    num_experts_per_tok=USED, norm_topk_prob=True, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, vocab_size=768, max_position_embeddings=2048, pad_token_id=0,
    rms_norm_eps=1e-6,
)  # fmt: skip


def _checkpoint(folder, gate_up_std: float | None = None, **changes):
    torch.manual_seed(0)
    config = AutoConfig.for_model("qwen3_moe", **{**QWEN3_MOE, **changes})
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):  # away from 1, so that a norm in the wrong place shows
                parameter.uniform_(0.5, 1.5)
            if name.endswith("gate_up_proj") and gate_up_std is not None:
                parameter.normal_(0, gate_up_std)
    model.save_pretrained(folder)
    build_tiny_tokenizer("qwen", folder, arch="qwen3")
    return folder


@pytest.fixture(scope="module")
def lora_model(tmp_path_factory):
    """FastModel's LoRA model of the tiny Qwen3-MoE, every adapter's B random."""
    path = _checkpoint(tmp_path_factory.mktemp("qwen3_moe") / "tiny-qwen3-moe")
    model, tokenizer = FastModel.from_pretrained(str(path), dtype=torch.float32, load_in_4bit=False)
    model = FastModel.get_peft_model(model, r=8, lora_alpha=16, use_gradient_checkpointing=False)
    generator = torch.Generator().manual_seed(5)
    adapted = []
    with torch.no_grad():
        for name, parameter in sorted(model.named_parameters()):
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)
                adapted.append(name)
    assert any("experts" in name for name in adapted)  # the experts are adapted, not only attention
    return model.eval(), tokenizer


@needs_llama_cpp
@pytest.mark.parametrize("method", ["f16", "bf16", "q8_0"])
def test_lora_model_exports_with_the_experts_updates(method, lora_model, tmp_path):
    """The merged file, run by llama.cpp, gives the LoRA model's logits within the method's
    tolerance, and its weights read back are the merged model's; without the adapters the
    logits differ."""
    model, tokenizer = lora_model
    paths = model.save_pretrained_gguf(tmp_path / "out", tokenizer, quantization_method=method, verify=False)
    method = quantization_method(method)
    report = verify_gguf(paths[0], model, tokenizer, method)  # against the unmerged LoRA model
    assert report.logit_error < gguf_verify.TOLERANCES[method.name]
    with model.disable_adapter(), pytest.raises(GGUFVerificationError, match="logits differ"):
        verify_gguf(paths[0], model, tokenizer, method)


@needs_llama_cpp
def test_file_holds_the_expert_stacks_in_llama_cpps_layout(tmp_path):
    """Tensor names, GGUF shapes (reversed: row first), types and metadata as llama.cpp's
    qwen3moe reads them; the weights read back equal the model's, structure checked tightly."""
    path = _checkpoint(tmp_path / "tiny-qwen3-moe")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    q8_0 = quantization_method("q8_0")
    file = write_gguf(model, tmp_path / "moe.gguf", tokenizer, q8_0)
    reader = gguf.GGUFReader(file)
    tensors = {t.name: t for t in reader.tensors}

    def field(key):
        return reader.fields[key].contents()

    assert field("general.architecture") == "qwen3moe"
    assert field("qwen3moe.expert_count") == EXPERTS
    assert field("qwen3moe.expert_used_count") == USED
    assert field("qwen3moe.expert_feed_forward_length") == WIDTH
    for layer in range(2):
        gate_up = model.model.layers[layer].mlp.experts.gate_up_proj.detach()
        for name, shape, qtype in [
            ("ffn_gate_inp", [HIDDEN, EXPERTS], T.F32),
            ("ffn_gate_exps", [HIDDEN, WIDTH, EXPERTS], T.Q8_0),
            ("ffn_up_exps", [HIDDEN, WIDTH, EXPERTS], T.Q8_0),
            ("ffn_down_exps", [WIDTH, HIDDEN, EXPERTS], T.Q8_0),
            ("attn_q_norm", [32], T.F32),
        ]:
            tensor = tensors[f"blk.{layer}.{name}.weight"]
            assert (list(tensor.shape), tensor.tensor_type) == (shape, qtype), name
        # The gate is the first half of gate_up_proj's rows, the up the second.
        gate = gguf.quants.dequantize(tensors[f"blk.{layer}.ffn_gate_exps.weight"].data, T.Q8_0)
        up = gguf.quants.dequantize(tensors[f"blk.{layer}.ffn_up_exps.weight"].data, T.Q8_0)
        scale = gate_up.abs().max().item()
        np.testing.assert_allclose(gate, gate_up[:, :WIDTH].numpy(), atol=scale / 100)
        np.testing.assert_allclose(up, gate_up[:, WIDTH:].numpy(), atol=scale / 100)
    exact = verify_gguf(file, model, tokenizer, q8_0, reference="gguf_weights")
    assert exact.logit_error < gguf_verify.GGUF_WEIGHTS_TOLERANCE
    assert exact.weight_error < gguf_verify.WEIGHT_TOLERANCES["q8_0"]


@needs_llama_cpp
def test_swapped_gate_and_up_fail_verification(tmp_path):
    """The file written with gate and up exchanged: llama.cpp's logits then differ. The
    experts' inputs are of order 1, where silu(gate) * up and silu(up) * gate differ (at
    transformers' initial std of 0.02 both are about gate * up / 2)."""
    path = _checkpoint(tmp_path / "tiny-qwen3-moe", gate_up_std=1.5 / HIDDEN**0.5)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    swapped = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        for layer in swapped.model.layers:
            gate_up = layer.mlp.experts.gate_up_proj
            gate_up.copy_(torch.cat(gate_up.chunk(2, dim=-2)[::-1], dim=-2))
    f16 = quantization_method("f16")
    file = write_gguf(swapped, tmp_path / "swapped.gguf", tokenizer, f16)
    with pytest.raises(GGUFVerificationError, match="logits differ"):
        verify_gguf(file, model, tokenizer, f16)


@pytest.mark.parametrize(
    "changes,message",
    [
        (
            dict(norm_topk_prob=False),
            "norm_topk_prob=False, which it cannot run; it accepts norm_topk_prob=True",
        ),
        (dict(mlp_only_layers=[1]), r"dense MLP layers \(mlp_only_layers=\[1\]"),
    ],
    ids=["weights-not-renormalised", "dense-layer"],
)
def test_a_qwen3_moe_llama_cpp_computes_otherwise_is_refused(changes, message, tmp_path):
    path = _checkpoint(tmp_path / "tiny-qwen3-moe", **changes)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with pytest.raises(NotImplementedError, match=message):
        save_pretrained_gguf(model, tmp_path / "out", AutoTokenizer.from_pretrained(path), "q8_0")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "model_type,sizes",
    [
        ("qwen2_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16))
    ],  # its shared expert: no record
)
def test_unsupported_mixture_of_experts_names_the_supported_ones(model_type, sizes, tmp_path):
    config = AutoConfig.for_model(
        model_type, hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=768, pad_token_id=0, **sizes,
    )  # fmt: skip
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(
        ValueError, match=f"the mixture-of-experts 'qwen3_moe', 'gpt_oss', 'mixtral'; .* {model_type!r}"
    ):
        save_pretrained_gguf(model, tmp_path / "out", None, "q8_0")
