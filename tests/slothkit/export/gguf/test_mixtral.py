"""GGUF export of Mixtral (llama.cpp's "llama" graph with experts): a tiny random Mixtral,
LoRA-adapted on its attention and experts with random B, merged, written and run by
llama.cpp against the HF model; its layout, and a file with gate and up exchanged, which
llama.cpp's logits tell apart."""

import importlib.util

import gguf
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from slothkit.export.gguf import verify as gguf_verify
from slothkit.export.gguf import write_gguf
from slothkit.export.gguf.layout import permute_rotary_rows
from slothkit.export.gguf.tensor_types import quantization_method
from slothkit.export.gguf.verify import GGUFVerificationError, verify_gguf
from slothkit.testing import build_tiny_tokenizer
from slothkit.testing.lora_models import load_plain, lora_with_random_b

T = gguf.GGMLQuantizationType
needs_llama_cpp = pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None,
    reason="llama-cpp-python is not installed (pip install 'slothkit[gguf]'); it runs the GGUF files",
)
EXPERTS, USED, WIDTH, HIDDEN, HEADS = 4, 2, 64, 64, 4  # rows of 64: whole Q8_0 blocks
MIXTRAL = dict(
    hidden_size=HIDDEN, intermediate_size=WIDTH, num_local_experts=EXPERTS, num_experts_per_tok=USED,
    num_hidden_layers=2, num_attention_heads=HEADS, num_key_value_heads=2, vocab_size=768,
    max_position_embeddings=2048, pad_token_id=0,
)  # fmt: skip


def _checkpoint(folder, gate_up_std: float | None = None):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("mixtral", **MIXTRAL))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):  # away from 1, so that a norm in the wrong place shows
                parameter.uniform_(0.5, 1.5)
            if name.endswith("gate_up_proj") and gate_up_std is not None:
                parameter.normal_(0, gate_up_std)
    model.save_pretrained(folder)
    build_tiny_tokenizer("sentencepiece", folder, arch="mistral")
    return folder


@pytest.fixture(scope="module")
def lora_model(tmp_path_factory):
    """FastModel's LoRA model of the tiny Mixtral, every adapter's B random."""
    path = _checkpoint(tmp_path_factory.mktemp("mixtral") / "tiny-mixtral")
    model, tokenizer, adapted = lora_with_random_b(path)
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
    report = verify_gguf(paths[0], model, tokenizer, method)  # against the unmerged LoRA model
    assert report.logit_error < gguf_verify.TOLERANCES[method.name]
    with model.disable_adapter(), pytest.raises(GGUFVerificationError, match="logits differ"):
        verify_gguf(paths[0], model, tokenizer, method)


@needs_llama_cpp
def test_file_holds_mixtral_as_llama_with_experts(tmp_path):
    """llama.cpp's llama graph with expert stacks: no dense ffn tensors, the expert keys, Q
    and K rows permuted as for Llama; the weights read back equal the model's and llama.cpp
    runs them as HF does, tightly."""
    model, tokenizer = load_plain(_checkpoint(tmp_path / "tiny-mixtral"))
    q8_0 = quantization_method("q8_0")
    file = write_gguf(model, tmp_path / "mixtral.gguf", tokenizer, q8_0)
    reader = gguf.GGUFReader(file)
    tensors = {t.name: t for t in reader.tensors}
    assert reader.fields["general.architecture"].contents() == "llama"
    assert reader.fields["llama.expert_count"].contents() == EXPERTS
    assert reader.fields["llama.expert_used_count"].contents() == USED
    for layer in range(2):
        for name, shape, qtype in [
            ("ffn_gate_inp.weight", [HIDDEN, EXPERTS], T.F32),
            ("ffn_gate_exps.weight", [HIDDEN, WIDTH, EXPERTS], T.Q8_0),
            ("ffn_up_exps.weight", [HIDDEN, WIDTH, EXPERTS], T.Q8_0),
            ("ffn_down_exps.weight", [WIDTH, HIDDEN, EXPERTS], T.Q8_0),
        ]:
            tensor = tensors[f"blk.{layer}.{name}"]
            assert (list(tensor.shape), tensor.tensor_type) == (shape, qtype), name
        assert f"blk.{layer}.ffn_gate.weight" not in tensors
    q = model.model.layers[0].self_attn.q_proj.weight.detach()
    stored = torch.from_numpy(gguf.quants.dequantize(tensors["blk.0.attn_q.weight"].data, T.Q8_0))
    scale = q.abs().max().item() / 100
    assert torch.allclose(stored, permute_rotary_rows(q, HEADS), atol=scale)
    assert not torch.allclose(stored, q, atol=scale)
    exact = verify_gguf(file, model, tokenizer, q8_0, reference="gguf_weights")
    assert exact.logit_error < gguf_verify.GGUF_WEIGHTS_TOLERANCE
    assert exact.weight_error < gguf_verify.WEIGHT_TOLERANCES["q8_0"]


@needs_llama_cpp
def test_swapped_gate_and_up_fail_verification(tmp_path):
    """The file written with gate and up exchanged: llama.cpp's logits then differ (inputs of
    order 1, where silu(gate) * up and silu(up) * gate differ)."""
    path = _checkpoint(tmp_path / "tiny-mixtral", gate_up_std=1.5 / HIDDEN**0.5)
    model, tokenizer = load_plain(path)
    swapped, _ = load_plain(path)
    with torch.no_grad():
        for layer in swapped.model.layers:
            gate_up = layer.mlp.experts.gate_up_proj
            gate_up.copy_(torch.cat(gate_up.chunk(2, dim=-2)[::-1], dim=-2))
    f16 = quantization_method("f16")
    file = write_gguf(swapped, tmp_path / "swapped.gguf", tokenizer, f16)
    with pytest.raises(GGUFVerificationError, match="logits differ"):
        verify_gguf(file, model, tokenizer, f16)
