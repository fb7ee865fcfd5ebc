"""Pieces of the offloaded checkpointer that need no model: the unread sum and when
the layers keep intermediates for their re-runs (the rest is tested through FastModel
in test_fast_model.py and, on a GPU, with the offload copies)."""

import pytest
import torch
from torch import nn

from slothkit.engine.offload_checkpoint import enable_checkpointing, keep, kept, unread_sum


def test_unread_sum_sends_the_gradient_to_both_terms():
    gen = torch.Generator().manual_seed(7)
    a = torch.randn(2, 3, 4, generator=gen, requires_grad=True)
    b = torch.randn(3, 1, generator=gen, requires_grad=True)  # broadcast, as a + b allows
    grad = torch.randn(2, 3, 4, generator=gen)
    out = unread_sum(a, b)
    assert out.shape == (2, 3, 4) and out.dtype == a.dtype
    got = torch.autograd.grad(out, [a, b], grad)
    expected = torch.autograd.grad(a + b, [a, b], grad)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=1e-6)


def test_keep_and_kept_do_nothing_outside_a_checkpointed_layer():
    keep("anything", torch.ones(2))
    assert kept("anything") is None


def test_keeping_by_default_only_on_fast_gpus(monkeypatch):
    class Layer(nn.Module):
        gradient_checkpointing = False

    def keeps_for(capability, setting=None, mode="offload"):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: capability is not None)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
        layer = Layer()
        enable_checkpointing([layer], mode, cuda_graphs=False, keep_sums=setting)
        return layer._gradient_checkpointing_func.keeps

    assert keeps_for((9, 0)) and keeps_for((8, 0))
    assert not keeps_for((7, 5)) and not keeps_for(None)  # T4, CPU
    assert keeps_for((7, 5), True) and not keeps_for((9, 0), False)
    with pytest.raises(ValueError, match="keep_sums='yes'; accepted: None .*True, False"):
        keeps_for((9, 0), "yes")
