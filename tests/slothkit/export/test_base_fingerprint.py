"""An adapter saved by slothkit records a fingerprint of the base weights it was trained on;
exporting or loading it onto a base folder with other weights of the same shapes is refused
(unless asked for), and adapters without the record (PEFT's own) work as before."""

import json
import shutil

import pytest
import torch

from slothkit import FastModel
from slothkit.cli import main as cli_main
from slothkit.export import export_adapter, save_pretrained_merged
from slothkit.export.base_fingerprint import FINGERPRINT_FILE
from slothkit.testing import build_tiny_model


@pytest.fixture
def adapter_and_bases(make_lora_model, tmp_path):
    """(adapter folder saved with save_pretrained_merged, its base, another base of the same
    shapes with other weights)."""
    base = tmp_path / "base"
    shutil.copytree(build_tiny_model("llama", tmp_path / "built"), base)
    model, tokenizer, _ = make_lora_model("llama")
    model.peft_config["default"].base_model_name_or_path = str(base)  # the copy it is said to be trained on
    folder = tmp_path / "adapter"
    save_pretrained_merged(model, folder, tokenizer, save_method="lora")
    other = build_tiny_model("llama", tmp_path / "other", seed=1)
    return folder, base, other


def test_an_export_onto_other_base_weights_is_refused(adapter_and_bases, tmp_path):
    folder, base, other = adapter_and_bases
    assert (folder / FINGERPRINT_FILE).is_file()
    with pytest.raises(ValueError, match=r"was trained on other base weights than .*other' holds") as error:
        export_adapter(folder, "merged_16bit", output=tmp_path / "merged", base_model=str(other))
    assert "allow_other_base=True" in str(error.value)
    assert not (tmp_path / "merged").exists()
    export_adapter(folder, "merged_16bit", output=tmp_path / "merged", base_model=str(base))  # its own base
    export_adapter(
        folder, "merged_16bit", output=tmp_path / "forced", base_model=str(other), allow_other_base=True
    )
    assert (tmp_path / "forced" / "model.safetensors").is_file()


def test_a_base_whose_files_changed_is_refused_on_load_and_from_the_command_line(
    adapter_and_bases, tmp_path, capsys
):
    folder, base, other = adapter_and_bases
    shutil.copy(other / "model.safetensors", base / "model.safetensors")  # the base folder overwritten
    with pytest.raises(ValueError, match="was trained on other base weights"):
        FastModel.from_pretrained(str(folder), dtype=torch.float32, load_in_4bit=False)
    model, _ = FastModel.from_pretrained(
        str(folder), dtype=torch.float32, load_in_4bit=False, allow_other_base=True
    )
    assert hasattr(model, "peft_config")

    assert cli_main(["export", str(folder), "--to", "lora", "--output", str(tmp_path / "out")]) == 2
    message = capsys.readouterr().err
    assert "--allow-other-base" in message and "allow_other_base=True" not in message
    assert cli_main(["export", str(folder), "--to", "lora", "--output", str(tmp_path / "out"),
                     "--allow-other-base"]) == 0  # fmt: skip


def test_the_trainers_save_records_the_base_and_peft_adapters_without_it_still_work(
    adapter_and_bases, make_lora_model, tmp_path
):
    folder, base, other = adapter_and_bases
    model, _, _ = make_lora_model("llama")
    model.save_pretrained(tmp_path / "checkpoint-10")  # as a Trainer saves, through PEFT
    recorded = json.loads((tmp_path / "checkpoint-10" / FINGERPRINT_FILE).read_text())
    assert recorded["tensors"] and all(len(digest) == 64 for digest in recorded["tensors"].values())

    (folder / FINGERPRINT_FILE).unlink()  # an adapter PEFT alone wrote
    export_adapter(folder, "merged_16bit", output=tmp_path / "merged", base_model=str(other))
