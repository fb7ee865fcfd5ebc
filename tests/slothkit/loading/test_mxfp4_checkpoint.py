"""A checkpoint with MXFP4 experts (gpt-oss as released) is named before it loads, with the
16-bit copy that trains; other checkpoints load without the notice."""

import json
import shutil
import warnings

import pytest
import torch

from slothkit import FastModel
from slothkit.core.notices import FallbackWarning
from slothkit.loading.mxfp4_checkpoint import quantization_method
from slothkit.testing.tiny_generic_models import tiny_generic_model_path

MXFP4 = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "lm_head"]}


@pytest.mark.parametrize("quantization, said", [(MXFP4, True), (None, False)], ids=["mxfp4", "16-bit"])
def test_mxfp4_experts_are_said_with_what_trains(quantization, said, tmp_path):
    path = tmp_path / "gpt-oss"
    shutil.copytree(tiny_generic_model_path("gpt_oss"), path)
    config = json.loads((path / "config.json").read_text())
    if quantization is not None:
        config["quantization_config"] = quantization
    (path / "config.json").write_text(json.dumps(config))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            FastModel.from_pretrained(str(path), dtype=torch.float32, load_in_4bit=False)
        except Exception:  # what transformers then does with MXFP4 weights is its own affair
            assert said
    notices = [w for w in caught if issubclass(w.category, FallbackWarning) and "MXFP4" in str(w.message)]
    assert len(notices) == said
    if said:
        assert f"{path} stores its experts in MXFP4" in str(notices[0].message)
        assert "unsloth/gpt-oss-20b-BF16" in str(notices[0].message)


def test_quantization_method_reads_dicts_and_configs():
    from transformers import BitsAndBytesConfig

    assert quantization_method(type("C", (), {"quantization_config": MXFP4})()) == "mxfp4"
    assert (
        quantization_method(type("C", (), {"quantization_config": BitsAndBytesConfig()})()) == "bitsandbytes"
    )
    assert quantization_method(type("C", (), {})()) is None
