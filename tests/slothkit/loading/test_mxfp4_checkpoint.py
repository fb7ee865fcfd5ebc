"""A checkpoint with MXFP4 experts (gpt-oss as released) loads through transformers' MXFP4
dequantisation, said once: 16-bit experts, or with load_in_4bit=True NF4 experts quantised
one tensor at a time as they load; other checkpoints load without the notice."""

import json
import shutil
import warnings

import torch
from safetensors.torch import load_file, save_file

from slothkit import FastModel
from slothkit.core.notices import FallbackWarning
from slothkit.engine.experts_nf4 import nf4_experts_of
from slothkit.loading.mxfp4_checkpoint import quantization_method
from slothkit.testing.tiny_generic_models import tiny_generic_model_path
from slothkit_kernels.moe import quantize_nf4_experts

MXFP4 = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "lm_head"]}
EXPERTS = ("gate_up_proj", "down_proj")


def _mxfp4_checkpoint(folder):
    """The tiny gpt-oss with its experts stored as gpt-oss ships them: for each (E, in, out)
    tensor, (E, out, in / 32, 16) bytes of FP4 pairs and (E, out, in / 32) power-of-two
    scales (random, each a valid MXFP4 value)."""
    shutil.copytree(tiny_generic_model_path("gpt_oss"), folder)
    tensors = load_file(folder / "model.safetensors")
    gen = torch.Generator().manual_seed(0)
    for name in [n for n in tensors if n.endswith(EXPERTS)]:
        experts, rows, cols = tensors.pop(name).shape
        tensors[f"{name}_blocks"] = torch.randint(
            0, 256, (experts, cols, rows // 32, 16), generator=gen, dtype=torch.uint8
        )
        tensors[f"{name}_scales"] = torch.randint(
            122, 128, (experts, cols, rows // 32), generator=gen, dtype=torch.uint8
        )
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = MXFP4
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _transformers_dequantised(folder):
    """The experts as transformers' own MXFP4 dequantisation makes them, in fp32."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    model = AutoModelForCausalLM.from_pretrained(
        folder, quantization_config=Mxfp4Config(dequantize=True), dtype=torch.float32
    )
    return {n: p.detach() for n, p in model.named_parameters() if n.endswith(EXPERTS)}


def _load(folder, load_in_4bit):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, _ = FastModel.from_pretrained(
            str(folder), dtype=torch.float32, load_in_4bit=load_in_4bit, fused=True
        )
    notices = [
        str(w.message)
        for w in caught
        if issubclass(w.category, FallbackWarning) and "MXFP4" in str(w.message)
    ]
    return model, notices, [str(w.message) for w in caught]


def test_mxfp4_experts_load_as_transformers_dequantises_them(tmp_path):
    folder = _mxfp4_checkpoint(tmp_path / "gpt-oss")
    expected = _transformers_dequantised(folder)
    model, notices, _ = _load(folder, load_in_4bit=False)
    assert len(notices) == 1 and f"{folder} stores its experts in MXFP4" in notices[0]
    assert "stay in the model's dtype" in notices[0]
    loaded = {n: p for n, p in model.named_parameters() if n.endswith(EXPERTS)}
    assert loaded.keys() == expected.keys() and len(loaded) == 4
    for name, weight in loaded.items():
        assert nf4_experts_of(weight) is None
        torch.testing.assert_close(weight.detach(), expected[name], rtol=0, atol=0)
    # Nothing of MXFP4 is left for a merged save to write into its config.json.
    assert getattr(model.config, "quantization_config", None) is None


def test_mxfp4_experts_load_in_4_bits_as_nf4_of_their_dequantised_values(tmp_path):
    folder = _mxfp4_checkpoint(tmp_path / "gpt-oss")
    expected = _transformers_dequantised(folder)
    model, notices, messages = _load(folder, load_in_4bit=True)
    assert len(notices) == 1 and "quantises each to NF4 as it arrives" in notices[0]
    # Quantised by the loading hook as each tensor arrived, not after a whole 16-bit load.
    assert not any("quantised to NF4 after loading" in m for m in messages)
    loaded = {n: p for n, p in model.named_parameters() if n.endswith(EXPERTS)}
    assert loaded.keys() == expected.keys()
    for name, weight in loaded.items():
        record = nf4_experts_of(weight)
        assert record is not None, f"{name} was left in 16 bits"
        torch.testing.assert_close(
            record.dequantize(), quantize_nf4_experts(expected[name]).dequantize(), rtol=0, atol=0
        )


def test_a_16_bit_checkpoint_loads_without_the_notice(tmp_path):
    path = tmp_path / "gpt-oss"
    shutil.copytree(tiny_generic_model_path("gpt_oss"), path)
    _, notices, _ = _load(path, load_in_4bit=False)
    assert notices == []


def test_quantization_method_reads_dicts_and_configs():
    from transformers import BitsAndBytesConfig

    assert quantization_method(type("C", (), {"quantization_config": MXFP4})()) == "mxfp4"
    assert (
        quantization_method(type("C", (), {"quantization_config": BitsAndBytesConfig()})()) == "bitsandbytes"
    )
    assert quantization_method(type("C", (), {})()) is None
