"""Pieces of the offloaded checkpointer that need no model: the unread sum and when
the layers keep intermediates for their re-runs (the rest is tested through FastModel
in test_fast_model.py and, on a GPU, with the offload copies)."""

import pytest
import torch
from torch import nn

from slothkit.engine.checkpointing.choice import enable_checkpointing
from slothkit.engine.checkpointing.recomputation import keep, kept, unread_sum


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


def test_past_the_host_limit_a_layer_is_not_offloaded_and_that_is_said_once(recwarn):
    """offload() answers None (the caller keeps the tensors on the GPU) once the pinned
    bytes would pass host_limit_bytes; the notice comes once per limit."""
    import slothkit.engine.checkpointing.offload_checkpoint as offload_checkpoint
    from slothkit.engine.checkpointing.offload_checkpoint import OffloadedCheckpointer

    offload_checkpoint._notice_host_memory_spent.cache_clear()
    checkpointer = OffloadedCheckpointer(marks_recompute=True, host_limit_bytes=100.0)
    hidden = torch.zeros(4, 8)  # 128 bytes
    assert checkpointer.offload(hidden) is None and checkpointer.offload(hidden, hidden) is None
    assert checkpointer.pinned_bytes == 0
    said = [str(w.message) for w in recwarn if "pinned host memory" in str(w.message)]
    assert len(said) == 1 and "0.0 GiB" in said[0] and "keep their inputs on the GPU" in said[0]


@pytest.mark.cuda
def test_a_host_limit_keeps_later_layers_on_the_gpu_and_trains_the_same(tmp_path):
    """On a GPU: a limit of one and a half layers' inputs offloads the first layer of each
    step and keeps the others' inputs on the GPU; the losses are those of an unlimited
    run, and every pinned byte is given back by the end of each backward."""
    from slothkit import FastModel
    from slothkit.memory.sizes import pinned_bytes
    from slothkit.testing import build_tiny_model

    path = build_tiny_model("llama", tmp_path / "tiny", num_layers=4)
    ids = torch.randint(3, 200, (2, 24), generator=torch.Generator().manual_seed(3)).cuda()
    losses = {}
    for limit in (None, "one and a half layers"):
        model, _ = FastModel.from_pretrained(str(path), dtype=torch.float32, load_in_4bit=False, fused=True)
        model = FastModel.get_peft_model(model, r=8, use_gradient_checkpointing="offload", cuda_graphs=False)
        checkpointer = model.get_base_model().model.layers[0]._gradient_checkpointing_func
        # The input (and kept sum) as pinned host memory holds them: power-of-two pieces.
        per_layer = pinned_bytes(2 * 24 * model.config.hidden_size * 4) * (1 + checkpointer.keeps)
        checkpointer.host_limit_bytes = None if limit is None else 1.5 * per_layer
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-3)
        losses[limit] = []
        for _ in range(2):
            loss = model(input_ids=ids, labels=ids).loss
            assert checkpointer.pinned_bytes == (4 if limit is None else 1) * per_layer
            loss.backward()
            assert checkpointer.pinned_bytes == 0
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses[limit].append(loss.item())
    torch.testing.assert_close(
        torch.tensor(losses["one and a half layers"]), torch.tensor(losses[None]), rtol=1e-5, atol=0
    )


class _Uncopyable:
    """Stands for a CUDA stream or graph: copy.deepcopy and pickle refuse it."""

    def __reduce_ex__(self, protocol):
        raise TypeError("cannot pickle 'Stream' object")


def test_a_copied_model_gets_a_checkpointer_without_streams_or_graphs():
    """copy.deepcopy of a model whose layers offload (TRL's reference model, a merged copy)
    must not copy the original's CUDA streams and captured layer graphs, which cannot be
    copied: the copy starts without them, one checkpointer shared by its layers as in the
    original, and the original keeps its own."""
    import copy

    from slothkit.engine.checkpointing.offload_checkpoint import OffloadedCheckpointer

    layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
    checkpointer = OffloadedCheckpointer(cuda_graphs=True)
    for layer in layers:
        layer._gradient_checkpointing_func = checkpointer
    stream, graph = _Uncopyable(), _Uncopyable()
    checkpointer._streams[torch.device("cuda", 0)] = stream
    checkpointer.graphs.graphs[("layer", 0)] = graph
    checkpointer.graphs.pool = _Uncopyable()
    with pytest.raises(TypeError):
        copy.deepcopy(stream)
    copied = copy.deepcopy(layers)
    twin = copied[0]._gradient_checkpointing_func
    assert twin is copied[1]._gradient_checkpointing_func and twin is not checkpointer
    assert twin._streams == {} and twin.graphs.graphs == {} and twin.graphs.pool is None
    assert checkpointer._streams[torch.device("cuda", 0)] is stream
    assert checkpointer.graphs.graphs[("layer", 0)] is graph
