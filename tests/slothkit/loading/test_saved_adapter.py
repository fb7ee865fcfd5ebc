"""FastModel.from_pretrained of a saved adapter folder (slothkit.loading.saved_adapter): a base
model that is no longer where the adapter says is named as the adapter's base, with how to
point at another one."""

import shutil
import warnings

import pytest
import torch

from slothkit import FastModel
from slothkit.testing import tiny_model_path


def test_a_base_folder_that_is_gone_is_named_as_the_adapters_base(tmp_path):
    base = tmp_path / "base"
    shutil.copytree(tiny_model_path("llama"), base)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, _ = FastModel.from_pretrained(str(base), dtype=torch.float32, load_in_4bit=False)
        model = FastModel.get_peft_model(model, r=4, use_gradient_checkpointing=False)
    model.save_pretrained(tmp_path / "adapter")
    shutil.rmtree(base)
    with pytest.raises(FileNotFoundError) as error:
        FastModel.from_pretrained(str(tmp_path / "adapter"), dtype=torch.float32, load_in_4bit=False)
    message = str(error.value)
    assert f"names its base model '{base}' (base_model_name_or_path in its adapter_config.json)" in message
    assert "no such folder on this machine" in message
    assert f"set base_model_name_or_path in '{tmp_path / 'adapter' / 'adapter_config.json'}'" in message


def test_a_base_named_like_a_hub_id_that_cannot_be_found_is_named_as_the_adapters_base(tmp_path, monkeypatch):
    import json

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": "outputs/base"})
    )
    monkeypatch.chdir(tmp_path)  # no outputs/base here, nor on the offline Hub
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # read at import: the variable is too late
    with pytest.raises(FileNotFoundError) as error:
        FastModel.from_pretrained(str(adapter), load_in_4bit=False)
    message = str(error.value)
    assert message.startswith(f"the adapter '{adapter}' names its base model 'outputs/base'")
    assert "cannot load model 'outputs/base'" in message and "set base_model_name_or_path in" in message


def test_a_cut_short_adapter_file_is_named_before_the_base_loads(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, _ = FastModel.from_pretrained(
            str(tiny_model_path("llama")), dtype=torch.float32, load_in_4bit=False
        )
        model = FastModel.get_peft_model(model, r=4, use_gradient_checkpointing=False)
    model.save_pretrained(tmp_path / "adapter")
    weights = tmp_path / "adapter" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:64])
    with pytest.raises(ValueError, match="adapter_model.safetensors' is not a complete safetensors file"):
        FastModel.from_pretrained(str(tmp_path / "adapter"), dtype=torch.float32, load_in_4bit=False)
