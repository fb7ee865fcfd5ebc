"""export_adapter (the `slothkit export` command's work) and the methods bound onto models."""

import json
import os
import sys
import types

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from slothkit.export import EXPORT_TARGETS, attach_export_methods, export_adapter, save_pretrained_merged

SAME = 1e-4


@pytest.fixture
def adapter_dir(make_lora_model, tmp_path):
    """A saved adapter folder as a Trainer leaves it, and the LoRA model it came from."""
    model, tokenizer, path = make_lora_model("mistral", load_in_4bit=True, seed=30)
    folder = tmp_path / "checkpoint-40"
    save_pretrained_merged(model, folder, tokenizer, save_method="lora")
    state = {"global_step": 40, "epoch": 2.0, "train_batch_size": 4,
             "log_history": [{"loss": 3.1, "learning_rate": 2e-4, "step": 20}, {"loss": 2.4, "learning_rate": 1e-4, "step": 40}]}  # fmt: skip
    (folder / "trainer_state.json").write_text(json.dumps(state))
    return folder, model, path


def test_export_merges_into_the_original_16bit_base(
    adapter_dir, input_ids, logits, assert_merged_16bit, tmp_path
):
    folder, _, base_path = adapter_dir
    result = export_adapter(folder, "merged_16bit", output=tmp_path / "merged")
    assert result.output == tmp_path / "merged" and result.push is None
    assert result.save.merge_source == "16bit"  # the base was loaded unquantised

    from peft import PeftModel

    reference = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32), folder
    )
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert_merged_16bit(tmp_path / "merged", reference, tokenizer, logits(reference, input_ids))

    card = (tmp_path / "merged" / "README.md").read_text()
    for fact in (
        "| steps | 40 |",
        "| epochs | 2 |",
        "| peak learning rate | 0.0002 |",
        "| last logged training loss | 2.4 |",
    ):
        assert fact in card, fact


def test_export_default_output_sits_beside_the_adapter(adapter_dir):
    folder, _, _ = adapter_dir
    result = export_adapter(folder, "lora")
    assert result.output == folder.with_name("checkpoint-40-lora")
    assert (result.output / "adapter_model.safetensors").is_file()


def test_export_rejects_bad_arguments(adapter_dir, tmp_path):
    folder, _, _ = adapter_dir
    with pytest.raises(ValueError, match="merged_16bit, merged_4bit, lora, gguf"):
        export_adapter(folder, "onnx")
    with pytest.raises(ValueError, match="--quant applies to --to gguf only"):
        export_adapter(folder, "merged_16bit", quant="q4_k_m")
    with pytest.raises(FileNotFoundError, match="no adapter_config.json"):
        export_adapter(tmp_path, "merged_16bit")
    config = json.loads((folder / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(tmp_path / "gone")
    (folder / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(FileNotFoundError, match="not a local checkpoint folder"):
        export_adapter(folder, "merged_16bit")
    assert set(EXPORT_TARGETS) == {"merged_16bit", "merged_4bit", "lora", "gguf"}


def test_export_refuses_an_output_that_is_or_holds_its_inputs(make_lora_model, tmp_path):
    import shutil

    model, tokenizer, shared_base = make_lora_model("llama", seed=32)
    base = tmp_path / "base"  # a copy: the shared tiny model must survive a failure here
    shutil.copytree(shared_base, base)
    adapter = tmp_path / "runs" / "adapter"
    save_pretrained_merged(model, adapter, tokenizer, save_method="lora")
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": str(base)}))
    snapshot = {folder: {p.name: p.read_bytes() for p in folder.iterdir()} for folder in (adapter, base)}
    for output, message in (
        (adapter, "is the adapter"),
        (base, "is the base model"),
        (base / "merged", "is inside the base model"),
        (tmp_path / "runs", "contains the adapter"),
    ):
        with pytest.raises(ValueError, match=message):
            export_adapter(adapter, "merged_16bit", output=output, overwrite=True)
    for folder, files in snapshot.items():
        assert {p.name: p.read_bytes() for p in folder.iterdir()} == files
    assert not (base / "merged").exists()


def test_export_checks_cheap_things_before_loading_the_model(adapter_dir, monkeypatch, tmp_path):
    from slothkit.export import adapter_export

    folder, _, _ = adapter_dir

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(adapter_export, "load_adapter_model", no_loading)
    with pytest.raises(ValueError, match="unknown GGUF quantization_method 'q3_k_s'"):
        export_adapter(folder, "gguf", quant="q4_k_m,q3_k_s", output=tmp_path / "g")
    with pytest.raises(ValueError, match="is not a Hub repo id"):
        export_adapter(folder, "lora", push="me/bad name!")
    with pytest.raises(FileExistsError, match="not empty"):
        export_adapter(folder, "lora", output=folder.parent)
    read_only = tmp_path / "read-only"
    read_only.mkdir()
    read_only.chmod(0o555)
    try:
        if not os.access(read_only, os.W_OK):  # root writes anywhere
            with pytest.raises(PermissionError, match="not writable"):
                export_adapter(folder, "lora", output=read_only / "out")
    finally:
        read_only.chmod(0o755)


def test_export_messages_name_the_flags_and_the_real_problem(adapter_dir, tmp_path):
    folder, _, _ = adapter_dir
    config = json.loads((folder / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(tmp_path / "gone")
    (folder / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(FileNotFoundError) as error:
        export_adapter(folder, "merged_16bit")
    assert "--base-model" in str(error.value) and "huggingface-cli download" not in str(error.value)

    weights = folder / "adapter_model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])  # cut short, as a copy or save that stopped
    with pytest.raises(ValueError, match="adapter_model.safetensors' is not a complete safetensors file"):
        export_adapter(folder, "merged_16bit", base_model=str(tmp_path))

    weights.unlink()
    with pytest.raises(FileNotFoundError, match="no adapter weights"):
        export_adapter(folder, "merged_16bit")


def test_export_refuses_a_base_that_lacks_a_tensor(adapter_dir, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    folder, _, base_path = adapter_dir
    base = tmp_path / "base"
    shutil.copytree(base_path, base)
    weights = load_file(base / "model.safetensors")
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, base / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="lacks 1 tensor.*: model.layers.1.mlp.down_proj.weight"):
        export_adapter(folder, "merged_16bit", output=tmp_path / "merged", base_model=str(base))
    assert not (tmp_path / "merged").exists()


def test_export_and_push(adapter_dir, local_hub):
    folder, _, _ = adapter_dir
    result = export_adapter(folder, "merged_16bit", push="local-user/exported", token="hf_writer",
                            endpoint=local_hub.endpoint)  # fmt: skip
    assert result.output is None  # pushed from a temporary folder
    assert set(local_hub.files("local-user/exported")) == {".gitattributes", *result.save.files}


def _fake_gguf_module(calls):
    """Stands in for slothkit.export.gguf (written separately) to test the wiring only: it
    records the model it is given."""
    module = types.ModuleType("slothkit.export.gguf")

    def save_pretrained_gguf(model, save_directory, tokenizer, quantization_method="q8_0", overwrite=False):
        calls.append((model, quantization_method))
        import pathlib

        pathlib.Path(save_directory).mkdir(parents=True, exist_ok=True)
        (pathlib.Path(save_directory) / f"model-{quantization_method}.gguf").write_bytes(b"GGUF")
        return save_directory

    from slothkit.export.gguf.tensor_types import quantization_methods

    module.save_pretrained_gguf = save_pretrained_gguf
    module.quantization_methods = quantization_methods
    module.push_to_hub_gguf = lambda model, repo_id, tokenizer, **kw: calls.append((model, repo_id))
    return module


def test_export_to_gguf_hands_the_writer_a_merged_model_and_pushes_its_folder(
    adapter_dir, local_hub, monkeypatch, input_ids, logits, relative_error
):
    folder, _, base_path = adapter_dir
    calls = []
    monkeypatch.setitem(sys.modules, "slothkit.export.gguf", _fake_gguf_module(calls))
    export_adapter(
        folder, "gguf", quant="q4_k_m", push="local-user/gguf", token="hf_writer", endpoint=local_hub.endpoint
    )
    [(model, quant)] = calls
    assert quant == "q4_k_m" and not hasattr(model, "peft_config")  # plain, merged
    from peft import PeftModel

    reference = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32), folder
    )
    assert relative_error(logits(model, input_ids), logits(reference, input_ids)) < SAME
    assert set(local_hub.files("local-user/gguf")) == {".gitattributes", "model-q4_k_m.gguf"}


def test_attach_export_methods_binds_to_the_instance_only(make_lora_model, monkeypatch, tmp_path, input_ids,
                                                         logits, relative_error):  # fmt: skip
    model, tokenizer, _ = make_lora_model("llama", seed=31)
    calls = []
    monkeypatch.setitem(sys.modules, "slothkit.export.gguf", _fake_gguf_module(calls))
    assert attach_export_methods(model) is model
    for name in ("save_pretrained_merged", "push_to_hub_merged", "save_pretrained_gguf", "push_to_hub_gguf"):
        assert name in vars(model) and not hasattr(type(model), name)

    result = model.save_pretrained_merged(tmp_path / "a", tokenizer, save_method="lora")
    assert (result.path / "adapter_config.json").is_file()
    model.save_pretrained_gguf(tmp_path / "g", tokenizer, quantization_method="q8_0")
    model.push_to_hub_gguf("me/x", tokenizer)
    # Unsloth FastModel's spelling: a local folder first, the repository as repo_id=.
    model.push_to_hub_gguf("gemma-3-finetune", tokenizer=tokenizer, quantization_type="Q8_0", repo_id="me/y")
    assert [c[1] for c in calls] == ["q8_0", "me/x", "me/y"]
    for merged, _ in calls:  # the GGUF functions get the merged plain model, not the PEFT one
        assert not hasattr(merged, "peft_config")
        assert relative_error(logits(merged, input_ids), logits(model, input_ids)) < SAME
    eos = calls[0][0].generation_config.eos_token_id
    assert tokenizer.convert_tokens_to_ids("<|eot_id|>") in eos

    # Another instance, a plain PEFT model, is untouched.
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from slothkit.testing import tiny_model_path

    plain = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_model_path("llama")),
        LoraConfig(r=4, target_modules=["q_proj"]),
    )
    assert "save_pretrained_merged" not in vars(plain)
    assert not hasattr(plain, "save_pretrained_merged")


def test_gguf_methods_are_left_out_when_the_module_is_missing(make_lora_model, monkeypatch):
    from slothkit.export import methods

    monkeypatch.setattr(methods, "_gguf_available", lambda: False)
    model, _, _ = make_lora_model("llama")
    attach_export_methods(model)
    assert "save_pretrained_merged" in vars(model) and "save_pretrained_gguf" not in vars(model)
