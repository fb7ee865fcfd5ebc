"""slothkit.core.allocator: expandable segments for a CUDA model unless the user chose the
allocator's setting, said once."""

import os
import warnings

import pytest
import torch

from slothkit.core import allocator
from slothkit.core.allocator import EXPANDABLE, VARIABLES, prefer_expandable_segments


@pytest.fixture
def fresh_process(monkeypatch):
    """No allocator variable set and no earlier choice, as in a new process."""
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(allocator, "_chosen_here", False)
    applied = []
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", applied.append)
    return applied


def _notices(call):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = call()
    return result, [str(w.message) for w in caught if "expandable segments" in str(w.message)]


def test_unset_variable_is_set_to_expandable_segments_and_said_once(fresh_process):
    chosen, notices = _notices(prefer_expandable_segments)
    assert chosen is True and len(notices) == 1
    assert "PYTORCH_ALLOC_CONF yourself" in notices[0]
    assert allocator.users_setting() == EXPANDABLE
    # The one name this torch reads (PYTORCH_ALLOC_CONF from torch 2.9) holds it.
    assert sum(name in os.environ for name in VARIABLES) == 1
    assert os.environ[allocator._variable_torch_reads()] == EXPANDABLE
    assert fresh_process == []  # CUDA had not started: the variable is enough
    again, notices = _notices(prefer_expandable_segments)
    assert again is True and notices == []


@pytest.mark.parametrize("name", VARIABLES)
@pytest.mark.parametrize("value", ["", "max_split_size_mb:512", "expandable_segments:False"])
def test_a_users_setting_is_kept_even_empty(fresh_process, monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    chosen, notices = _notices(prefer_expandable_segments)
    assert chosen is False and notices == [] and fresh_process == []
    assert allocator.users_setting() == value


def test_after_cuda_started_the_setting_is_applied_at_run_time(fresh_process, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert prefer_expandable_segments() is True
    assert fresh_process == [EXPANDABLE]


def test_a_cpu_model_leaves_the_allocator_alone(fresh_process, monkeypatch):
    """from_pretrained of a model for the CPU sets nothing, GPU or not."""
    from slothkit import FastModel
    from slothkit.loading.load_model import _on_cpu_only
    from slothkit.testing import tiny_model_path

    assert _on_cpu_only("cpu") and _on_cpu_only({"": "cpu", "lm_head": "disk"})
    assert not _on_cpu_only(None) and not _on_cpu_only({"": 0}) and not _on_cpu_only("auto")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        FastModel.from_pretrained(str(tiny_model_path("llama")), load_in_4bit=False, device_map="cpu")
    assert allocator.users_setting() is None and allocator._chosen_here is False
