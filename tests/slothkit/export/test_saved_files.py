"""A save replaces slothkit's own earlier save of the same method, and nothing of the user's."""

import os
import warnings

import pytest
import torch
from peft.utils import get_peft_model_state_dict
from safetensors.torch import load_file

from slothkit.core.notices import SettingChangedWarning
from slothkit.export import DirectoryNotEmptyError, save_pretrained_merged
from slothkit.export.merge import merged_state_dict
from slothkit.export.saved_files import CARD_WRITTEN_WITHIN_S

from .conftest import randomize_lora_b


def _contents(folder):
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


def _siblings(path):
    return sorted(p.name for p in path.parent.iterdir() if p.name != path.name)


def test_the_notebooks_saves_into_model_replace_their_own_and_refuse_to_mix(
    make_lora_model, tmp_path, monkeypatch
):
    """Unsloth's Llama-3 Alpaca notebook, as written: the 16-bit merge into "model" twice,
    then the adapter (model.save_pretrained) into the same "model"."""
    model, tokenizer, _ = make_lora_model("llama", seed=20)
    monkeypatch.chdir(tmp_path)
    model.save_pretrained_merged("model", tokenizer, save_method="merged_16bit")
    first = load_file("model/model.safetensors")

    randomize_lora_b(model, seed=21)  # trained further: the second save must hold the new weights
    with pytest.warns(SettingChangedWarning, match="held only slothkit's earlier merged_16bit save") as said:
        model.save_pretrained_merged("model", tokenizer, save_method="merged_16bit")
    assert sum(issubclass(w.category, SettingChangedWarning) for w in said) == 1
    second = load_file("model/model.safetensors")
    expected, _ = merged_state_dict(model)
    assert any(not torch.equal(first[name], second[name]) for name in second)
    for name, tensor in second.items():
        assert torch.equal(tensor, expected[name].to(tensor.dtype)), name
    assert _siblings(tmp_path / "model") == []  # no staging or set-aside folder left

    before = _contents(tmp_path / "model")
    with pytest.raises(
        DirectoryNotEmptyError,
        match=r"'model' holds a full model \(config.json, model.safetensors\); an adapter saved beside it "
        r"would make transformers load the base model .* model.save_pretrained\('model_lora'\).* "
        r"save_method='lora', overwrite=True",
    ):
        model.save_pretrained("model")
    assert _contents(tmp_path / "model") == before

    model.save_pretrained("model_lora")  # where the message points: a plain PEFT adapter
    assert (tmp_path / "model_lora" / "adapter_config.json").is_file()
    model.save_pretrained("model_lora")  # an adapter over an adapter, as Trainer checkpoints do
    model.save_pretrained_merged("model", tokenizer, save_method="lora", overwrite=True)
    assert not (tmp_path / "model" / "config.json").exists()


def test_an_adapter_is_not_saved_beside_a_users_transformers_model(make_lora_model, tmp_path):
    from slothkit.testing import build_tiny_model

    model, _, _ = make_lora_model("llama", seed=22)
    plain = build_tiny_model("llama", tmp_path / "plain")
    before = _contents(plain)
    with pytest.raises(DirectoryNotEmptyError, match="holds a full model"):
        model.save_pretrained(str(plain))
    assert _contents(plain) == before


@pytest.mark.parametrize("earlier, later", [("merged_16bit", "lora"), ("lora", "merged_16bit")])
def test_a_save_of_another_method_is_refused_naming_the_earlier_one(
    earlier, later, make_lora_model, tmp_path
):
    model, tokenizer, _ = make_lora_model("llama", seed=23)
    target = tmp_path / "out"
    save_pretrained_merged(model, target, tokenizer, save_method=earlier)
    before = _contents(target)
    with pytest.raises(
        DirectoryNotEmptyError,
        match=rf"holds slothkit's earlier {earlier} save, and this one is {later}; pass overwrite=True",
    ):
        save_pretrained_merged(model, target, tokenizer, save_method=later)
    assert _contents(target) == before


def _add_notes(folder):
    (folder / "notes.txt").write_text("mine")


def _add_a_folder(folder):
    (folder / "runs").mkdir()


def _edit_the_config(folder):
    config = folder / "adapter_config.json"
    config.write_text(config.read_text().replace('"r": 4', '"r": 4 '))
    stamp = os.stat(folder / "README.md").st_mtime_ns + 1_000_000_000
    os.utime(config, ns=(stamp, stamp))  # however coarse the filesystem's clock


def _edit_the_card(folder):
    card = folder / "README.md"
    card.write_text(card.read_text() + "\nMy notes on this run.\n")
    stamp = os.stat(card).st_mtime_ns + (CARD_WRITTEN_WITHIN_S + 1) * 1_000_000_000
    os.utime(card, ns=(stamp, stamp))


def _add_an_older_gguf_file(folder):
    gguf = folder / "model.Q8_0.gguf"
    gguf.write_bytes(b"GGUF")
    stamp = os.stat(folder / "README.md").st_mtime_ns - 1_000_000_000
    os.utime(gguf, ns=(stamp, stamp))  # not newer than the card: refused for being GGUF


def _replace_the_card_with_the_users(folder):
    (folder / "README.md").write_text("# My adapter\n")


@pytest.mark.parametrize(
    "change",
    [_add_notes, _add_a_folder, _edit_the_config, _edit_the_card, _add_an_older_gguf_file,
     _replace_the_card_with_the_users],
)  # fmt: skip
def test_an_earlier_save_with_anything_of_the_users_is_refused(change, make_lora_model, tmp_path):
    model, tokenizer, _ = make_lora_model("llama", seed=24)
    target = tmp_path / "out"
    save_pretrained_merged(model, target, tokenizer, save_method="lora")
    change(target)
    before = _contents(target)
    with pytest.raises(DirectoryNotEmptyError, match="pass overwrite=True"):
        save_pretrained_merged(model, target, tokenizer, save_method="lora")
    assert _contents(target) == before


def test_an_unchanged_adapter_save_is_replaced_and_said_once_per_folder(make_lora_model, tmp_path):
    model, tokenizer, _ = make_lora_model("llama", seed=25)
    target = tmp_path / "adapter"
    save_pretrained_merged(model, target, tokenizer, save_method="lora")
    randomize_lora_b(model, seed=26)
    with pytest.warns(SettingChangedWarning, match="adapter' held only slothkit's earlier lora save"):
        save_pretrained_merged(model, target, tokenizer, save_method="lora")
    saved = load_file(target / "adapter_model.safetensors")
    expected = get_peft_model_state_dict(model)
    assert saved.keys() == expected.keys()
    for name, tensor in saved.items():
        assert torch.equal(tensor, expected[name]), name
    with warnings.catch_warnings():
        warnings.simplefilter("error", SettingChangedWarning)  # the same folder again: not said twice
        save_pretrained_merged(model, target, tokenizer, save_method="lora")
