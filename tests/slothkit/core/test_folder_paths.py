"""A save folder or cache_dir under a path that is a file is refused naming that file (it
was a bare "[Errno 17] File exists" naming only the file, or "Not a directory")."""

import importlib.util
import warnings

import pytest
import torch

from slothkit import FastModel
from slothkit.cli import main as cli_main
from slothkit.testing import real_model_path, tiny_model_path


@pytest.fixture(scope="module")
def lora_model():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, tokenizer = FastModel.from_pretrained(
            str(tiny_model_path("llama")), dtype=torch.float32, load_in_4bit=False
        )
        return FastModel.get_peft_model(model, r=4, use_gradient_checkpointing=False), tokenizer


@pytest.fixture
def a_file(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("the user's notes")
    return path


def _names_the_file(a_file):
    return rf"'{a_file}' is a file, not a folder"


@pytest.mark.parametrize("save_method", ["merged_16bit", "lora"])
def test_a_save_under_a_file_names_the_file(lora_model, a_file, save_method):
    model, tokenizer = lora_model
    with pytest.raises(
        NotADirectoryError,
        match=rf"the save folder '{a_file}/out/model' cannot be made: " + _names_the_file(a_file),
    ):
        model.save_pretrained_merged(str(a_file / "out" / "model"), tokenizer, save_method=save_method)
    with pytest.raises(NotADirectoryError, match=_names_the_file(a_file)):
        model.save_pretrained(str(a_file / "out"))  # PEFT's, as a Trainer calls it
    assert a_file.read_text() == "the user's notes"


@pytest.mark.skipif(importlib.util.find_spec("gguf") is None, reason="the gguf package is not installed")
def test_a_gguf_export_under_a_file_names_the_file(lora_model, a_file):
    model, tokenizer = lora_model
    with pytest.raises(NotADirectoryError, match=_names_the_file(a_file)):
        model.save_pretrained_gguf(str(a_file / "gguf"), tokenizer)


def test_a_cache_dir_that_is_a_file_is_named(a_file):
    with pytest.raises(NotADirectoryError, match=rf"cache_dir '{a_file}' is a file, not a folder"):
        FastModel.from_pretrained("someone/some-model", cache_dir=str(a_file))
    with pytest.raises(NotADirectoryError, match=_names_the_file(a_file)):
        real_model_path("smollm2-135m-instruct", cache_dir=a_file / "models")


def test_the_export_command_names_the_file(lora_model, a_file, tmp_path, capsys):
    model, tokenizer = lora_model
    model.save_pretrained_merged(str(tmp_path / "adapter"), tokenizer, save_method="lora")
    assert (
        cli_main(["export", str(tmp_path / "adapter"), "--to", "lora", "--output", str(a_file / "out")]) == 2
    )
    assert f"'{a_file}' is a file, not a folder" in capsys.readouterr().err
