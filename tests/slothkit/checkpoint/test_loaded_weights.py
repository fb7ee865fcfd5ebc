"""A checkpoint that lacks a tensor, or holds NaN or Inf, is refused at load naming the
tensors, rather than training from random or poisoned weights; what is legitimately not
in the file (a tied head, a new sequence-classification head) still loads."""

import shutil
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

from slothkit import FastModel
from slothkit.testing import tiny_model_path

Q_PROJ = "model.layers.0.self_attn.q_proj.weight"


def _copy(arch, tmp_path):
    folder = tmp_path / arch
    shutil.copytree(tiny_model_path(arch), folder)
    return folder


def _rewrite_weights(folder, change):
    weights = load_file(folder / "model.safetensors")
    change(weights)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("load_in_4bit", [False, True])
def test_a_tensor_missing_from_the_checkpoint_is_named(tmp_path, load_in_4bit):
    folder = _copy("llama", tmp_path)
    _rewrite_weights(folder, lambda weights: [weights.pop(Q_PROJ), weights.pop("lm_head.weight")])
    with pytest.raises(ValueError, match=r"lacks 2 tensor\(s\) the model needs: lm_head.weight, " + Q_PROJ):
        FastModel.from_pretrained(str(folder), dtype=torch.float32, load_in_4bit=load_in_4bit)


def test_a_tied_head_and_a_new_score_head_are_not_missing(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # Gemma's tied head: not even a warning
        FastModel.from_pretrained(str(tiny_model_path("gemma")), dtype=torch.float32, load_in_4bit=False)
    with pytest.warns(UserWarning, match=r"the score head \(score.weight\) is new") as seen:
        FastModel.from_pretrained(
            str(tiny_model_path("llama")), dtype=torch.float32, load_in_4bit=False, num_labels=1
        )
    assert sum("score head" in str(w.message) for w in seen) == 1
    folder = _copy("llama", tmp_path)  # the decoder's own tensors stay required with num_labels
    _rewrite_weights(folder, lambda weights: weights.pop(Q_PROJ))
    with pytest.raises(ValueError, match=f"lacks 1 tensor\\(s\\) the model needs: {Q_PROJ}"):
        FastModel.from_pretrained(str(folder), dtype=torch.float32, load_in_4bit=False, num_labels=1)


def _fill_with_ff_bytes(folder, name):
    """Overwrite tensor `name`'s bytes in model.safetensors with 0xFF, as damage would:
    every float32 value becomes NaN."""
    import json

    path = folder / "model.safetensors"
    raw = bytearray(path.read_bytes())
    header_length = int.from_bytes(raw[:8], "little")
    start, end = json.loads(raw[8 : 8 + header_length])[name]["data_offsets"]
    raw[8 + header_length + start : 8 + header_length + end] = b"\xff" * (end - start)
    path.write_bytes(raw)


@pytest.mark.parametrize("load_in_4bit", [False, True])
def test_a_checkpoint_holding_nan_or_inf_is_refused_naming_the_tensors(tmp_path, load_in_4bit):
    folder = _copy("llama", tmp_path)
    up = "model.layers.1.mlp.up_proj.weight"
    _fill_with_ff_bytes(folder, up)
    _rewrite_weights(folder, lambda weights: weights["model.norm.weight"].__setitem__(3, float("inf")))
    with pytest.raises(
        ValueError,
        match=rf"refusing to load '{folder}': 2 tensor\(s\) hold values a model must not: "
        rf"{up} \(NaN\), model.norm.weight \(Inf\)",
    ):
        FastModel.from_pretrained(str(folder), dtype=torch.float32, load_in_4bit=load_in_4bit)
