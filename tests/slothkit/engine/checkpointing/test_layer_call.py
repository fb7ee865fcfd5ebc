"""Layers that read tensors with grad besides their input, and write tensors into a mapping
that later layers read (layer_call): the offloaded checkpointer gives the gradients of
no checkpointing."""

import collections

import pytest
import torch
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer

from slothkit.engine.checkpointing.choice import enable_checkpointing


class _SharingLayer(GradientCheckpointingLayer):
    """hidden + tanh(q(hidden) * k) * side + offsets["bias"][0], where k is this layer's
    own k(hidden) (stored in ``shared`` when ``stores``) or the one a layer before it
    stored (``reuses``)."""

    def __init__(self, width: int, stores: bool, reuses: bool):
        super().__init__()
        self.q = nn.Linear(width, width)
        self.k = None if reuses else nn.Linear(width, width)
        self.stores = stores
        self.cut = False  # read the stored k as a constant: its gradient lost

    def forward(self, hidden, side, shared=None, offsets=None):
        k = shared["k"] if self.k is None else self.k(hidden)
        if self.k is None and self.cut:
            k = k.detach()
        if self.stores:
            shared["k"] = k
        return hidden + torch.tanh(self.q(hidden) * k) * side + offsets["bias"][0]


class _SharingModel(nn.Module):
    """Each layer gets its slice of a side input computed once before the layers (as
    Gemma's per-layer embeddings), positionally, and a bias inside a tuple inside a dict;
    layer 0 stores its k in ``shared`` for layers 2 and 3 (as Gemma's shared k/v)."""

    def __init__(self, width: int = 8, mapping=dict):
        super().__init__()
        self.embed = nn.Linear(width, width)
        self.side = nn.Linear(width, 4 * width)
        self.bias = nn.Parameter(torch.randn(width) * 0.1)
        self.layers = nn.ModuleList(_SharingLayer(width, stores=i == 0, reuses=i >= 2) for i in range(4))
        self.mapping = mapping

    def forward(self, x):
        hidden = self.embed(x)
        sides = torch.tanh(self.side(x)).unflatten(-1, (4, -1))
        shared = self.mapping()
        for i, layer in enumerate(self.layers):
            hidden = layer(hidden, sides[..., i, :], shared=shared, offsets={"bias": (self.bias,)})
        return hidden


@pytest.mark.parametrize("mapping", [dict, collections.UserDict], ids=["dict", "UserDict"])
@pytest.mark.parametrize("mode", ["offload", True])
def test_reads_and_writes_beside_the_input_get_the_gradients_of_no_checkpointing(mode, mapping):
    torch.manual_seed(0)
    model = _SharingModel(mapping=mapping).train()
    x = torch.randn(2, 5, 8)
    grad = torch.randn(2, 5, 8)

    def gradients(checkpointing):
        enable_checkpointing(model.layers, checkpointing, cuda_graphs=False, keep_sums=False)
        model.zero_grad(set_to_none=True)
        model(x).backward(grad)
        return {name: p.grad.clone() for name, p in model.named_parameters()}

    expected, got = gradients(False), gradients(mode)
    assert set(got) == set(expected)  # every parameter, layer 0's k and the shared bias included
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-6, atol=1e-7, msg=name)
    # Layer 0's k feeds layers 2 and 3 too: a checkpointer that lost that part of its
    # gradient would be caught.
    for layer in model.layers[2:]:
        layer.cut = True
    lost = gradients(False)["layers.0.k.weight"]
    assert (lost - expected["layers.0.k.weight"]).abs().max() > 1e-3


def test_a_stored_tensor_that_no_layer_reads_costs_no_gradient():
    """The last layer stores what nobody reads (Gemma 4's producers store their keys and
    values for assistant models too): its checkpoint gets no gradient for it, and the
    layer's own gradients are those of no checkpointing."""
    torch.manual_seed(1)
    model = _SharingModel().train()
    model.layers[3] = _SharingLayer(8, stores=True, reuses=False)
    x = torch.randn(2, 5, 8)

    def gradients(checkpointing):
        enable_checkpointing(model.layers, checkpointing, cuda_graphs=False, keep_sums=False)
        model.zero_grad(set_to_none=True)
        model(x).sum().backward()
        return {name: p.grad.clone() for name, p in model.named_parameters()}

    expected, got = gradients(False), gradients("offload")
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-6, atol=1e-7, msg=name)


def test_a_forward_without_backward_leaves_nothing_behind():
    """The checkpoints hold copies of the mappings, not the mapping the layers write their
    outputs into (that would be a reference cycle through the graph's nodes, which only
    a backward, or nothing, would break): once the output is dropped the mapping and
    what it holds are freed at once, with the cyclic collector off."""
    import gc
    import weakref

    made = []

    class Watched(collections.UserDict):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    torch.manual_seed(2)
    model = _SharingModel(mapping=Watched).train()
    enable_checkpointing(model.layers, "offload", cuda_graphs=False, keep_sums=False)
    gc.disable()
    try:
        output = model(torch.randn(2, 5, 8))
        (mapping,) = made
        stored = weakref.ref(mapping["k"])
        assert stored().grad_fn is not None  # the checkpoint's output, not the no_grad tensor
        mapping, made = weakref.ref(mapping), None
        del output
        assert mapping() is None and stored() is None
    finally:
        gc.enable()
