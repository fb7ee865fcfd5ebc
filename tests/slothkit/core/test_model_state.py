"""slothkit.core.model_state: one typed record per model, module and 4-bit weight, found
through a PeftModel, carried by copies, and with no attribute named by string elsewhere."""

import copy
import pathlib
import pickle
import subprocess

import pytest
import torch
from torch import nn

from slothkit.core.model_state import (
    ModelState,
    PatchedModule,
    attach_patched_module,
    attach_state,
    detach_patched_module,
    keep_nf4_cache,
    nf4_cache,
    patched_module,
    state_of,
)
from slothkit.fast_model import FastModel
from slothkit.testing import tiny_model_path


def test_attached_once_and_read_back():
    model = nn.Linear(3, 3)
    assert state_of(model) is None
    state = attach_state(model)
    assert isinstance(state, ModelState) and attach_state(model) is state is state_of(model)


def test_copies_carry_the_state_but_not_the_decoder():
    model = nn.Linear(3, 3)
    state = attach_state(model)
    state.tokenizer, state.max_seq_length, state.architecture = "tokenizer", 64, "llama"
    state.fast_decoder = object()
    for copied in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        copy_state = state_of(copied)
        assert copy_state is not state
        assert (copy_state.tokenizer, copy_state.max_seq_length, copy_state.architecture) == (
            "tokenizer",
            64,
            "llama",
        )
        assert copy_state.fast_decoder is None
    assert state.fast_decoder is not None  # the original keeps its own


def test_a_module_patched_twice_keeps_its_own_forward():
    module = nn.Linear(3, 3)
    own = module.forward
    attach_patched_module(module, PatchedModule(original_forward=own, eps=1e-6))
    module.forward = lambda x: x
    record = attach_patched_module(module, PatchedModule(original_forward=module.forward, eps=1e-5))
    assert record.original_forward == own and patched_module(module).eps == 1e-5
    assert detach_patched_module(module) is record and patched_module(module) is None
    assert detach_patched_module(module) is None


def test_a_model_and_its_patched_record_live_side_by_side():
    """A causal LM carries both: its ModelState and, patched, its own forward's record."""
    model = nn.Linear(3, 3)
    state = attach_state(model)
    attach_patched_module(model, PatchedModule(original_forward=model.forward))
    assert state_of(model) is state and patched_module(model) is not None


def test_nf4_cache_on_a_parameter():
    param = nn.Parameter(torch.zeros(2))
    assert nf4_cache(param) is None
    keep_nf4_cache(param, ("key",), "weight")
    assert (nf4_cache(param).key, nf4_cache(param).weight) == (("key",), "weight")


def test_fast_model_state_is_shared_through_peft():
    path = str(tiny_model_path("llama"))
    model, tokenizer = FastModel.from_pretrained(
        path, dtype=torch.float32, load_in_4bit=False, max_seq_length=64, fused=True
    )
    state = state_of(model)
    assert (state.tokenizer, state.max_seq_length, state.architecture) == (tokenizer, 64, "llama")
    assert model.max_seq_length == 64  # Unsloth's attribute, for user code
    peft_model = FastModel.get_peft_model(model, r=4, use_gradient_checkpointing=False, max_seq_length=32)
    assert state_of(peft_model) is state and state.max_seq_length == 32
    layer = peft_model.get_base_model().model.layers[0]
    assert patched_module(layer.mlp).activation == "swiglu"
    assert patched_module(layer.self_attn).attention_values is not None


@pytest.mark.parametrize("folder", ["slothkit", "slothkit_kernels"])
def test_no_slothkit_attribute_is_named_outside_the_state_module(folder):
    root = pathlib.Path(__file__).resolve().parents[3]
    found = subprocess.run(
        ["git", "grep", "-n", "_slothkit_", "--", folder], cwd=root, capture_output=True, text=True
    ).stdout.splitlines()
    assert [line for line in found if not line.startswith("slothkit/core/model_state.py:")] == []
