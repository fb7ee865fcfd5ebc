"""A decoder layer's call as a CUDA graph sees it (``layer_graphs``): the layer, the
tensors it reads besides its input and the signature a graph is captured for; and the
layers a graph would not replay faithfully (active dropout, gradient hooks, FSDP2).
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

_PLAIN = (type(None), bool, int, float, str, torch.dtype, torch.device)


class _Call:
    """A layer call split into what a graph can replay: the layer, the tensors it reads
    besides its input (``leaves``), and how to rebuild the call around static copies."""

    def __init__(self, run_function, args):
        self.layer = None
        self.func = None
        self.bound = ()
        keywords = {}
        if isinstance(run_function, functools.partial):
            self.func, self.bound, keywords = run_function.func, run_function.args, run_function.keywords
            if self.bound and isinstance(self.bound[0], nn.Module):  # partial(forward, layer, ...)
                self.layer = self.bound[0]
            elif isinstance(getattr(self.func, "__self__", None), nn.Module):  # partial(layer.__call__, ...)
                self.layer = self.func.__self__
        self.leaves, self.spec = tree_flatten((args, keywords))

    def replayable(self) -> bool:
        return self.layer is not None and all(
            isinstance(leaf, (torch.Tensor, *_PLAIN)) for leaf in self.leaves
        )

    def signature(self, hidden: torch.Tensor, autocast_dtype) -> tuple:
        described = tuple(
            ("tensor", tuple(leaf.shape), leaf.dtype, leaf.requires_grad)
            if isinstance(leaf, torch.Tensor)
            else ("value", leaf)
            for leaf in self.leaves
        )
        return tuple(hidden.shape), hidden.dtype, autocast_dtype, described

    def __call__(self, hidden: torch.Tensor, leaves: list):
        args, keywords = tree_unflatten(leaves, self.spec)
        return self.func(*self.bound, hidden, *args, **keywords)


def _has_active_dropout(layer: nn.Module) -> bool:
    for module in layer.modules():
        if isinstance(module, nn.Dropout) and module.p > 0 and module.training:
            return True
        if getattr(module, "attention_dropout", 0.0) and module.training:
            return True
    return False


def _is_sharded(layer: nn.Module) -> bool:
    """Whether FSDP2 (``fully_shard``) manages the layer: it gathers the layer's weights
    into memory it frees after each forward and backward and allocates again for the
    next, so the addresses a graph baked in need not hold them at the next replay."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2
        return False
    return isinstance(layer, FSDPModule)


def _has_grad_hooks(param: torch.Tensor) -> bool:
    return bool(getattr(param, "_backward_hooks", None)) or bool(
        getattr(param, "_post_accumulate_grad_hooks", None)
    )
