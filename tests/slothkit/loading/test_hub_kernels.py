"""transformers' Hub kernels (on by default where the `kernels` package is installed)
re-kernelize a model at each train()/eval() switch and put back the class forward of the
modules they decorate: FastModel loads with them off, so that its patches of those
instances hold through get_peft_model and the trainers' mode switches."""

import warnings

import pytest
import torch

from slothkit import FastModel
from slothkit.testing import tiny_model_path


def _patched_norm_forwards(model) -> int:
    return sum(
        "forward" in module.__dict__ for name, module in model.named_modules() if name.endswith("layernorm")
    )


def test_patched_norms_keep_their_forward_through_mode_switches():
    pytest.importorskip("kernels")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, _ = FastModel.from_pretrained(
            str(tiny_model_path("llama")), dtype=torch.float32, load_in_4bit=False, fused=True
        )
    assert not model.use_kernels
    patched = _patched_norm_forwards(model)
    assert patched == 2 * model.config.num_hidden_layers  # two norms a layer, each fused
    model = FastModel.get_peft_model(model, r=8)
    model.eval()
    model.train()
    assert _patched_norm_forwards(model) == patched

    # What the default would do: the same switches undo every patch of a decorated module.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hub, _ = FastModel.from_pretrained(
            str(tiny_model_path("llama")),
            dtype=torch.float32,
            load_in_4bit=False,
            fused=True,
            use_kernels=True,
        )
    hub.eval()
    hub.train()
    assert _patched_norm_forwards(hub) == 0
