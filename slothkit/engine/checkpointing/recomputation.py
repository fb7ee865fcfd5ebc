"""What the modules inside a checkpointed layer's re-run see of it.

In backward, ``offload_checkpoint``'s checkpointers re-run each checkpointed layer with
grad enabled, to rebuild its graph.

The re-run's output is never read (only its graph is), so modules may skip work
whose result feeds only the layer output: ``recomputing()`` says when they are
inside the re-run of one decoder layer (the checkpointers ``enable_checkpointing``
installs; a function checkpointed through ``offload_checkpoint`` may be anything,
and is not marked).  The fused MLP uses it to skip its down projection, and the
decoder layer its last residual sum (``unread_sum``).  A forward hook on the layer
(or a global one) could read that output, so with one the re-run is not marked
either and runs in full.

Kept intermediates.  A layer may also hand an intermediate of its forward to the
re-run, so as not to compute it twice: ``keep(name, tensor)`` in the forward, and
``kept(name)`` in the marked re-run, which returns it (None everywhere else).  The
decoder layer keeps the residual sum after attention, so its re-run skips the output
projection; a mixture-of-experts layer's fused experts keep their whole forward
(``keep_group``/``take_kept_group``), so its re-run runs none of their products.  A kept tensor travels like the layer input (to pinned host memory and
back, prefetched one layer ahead), so it costs host memory and copy bandwidth; a
checkpointer collects them only when built with ``keeps=True``.
"""

from __future__ import annotations

import contextlib
import threading

import torch

_state = threading.local()  # backward may run on autograd's device threads


def recomputing() -> bool:
    """True while a checkpointed layer is re-run in backward to rebuild its graph."""
    return getattr(_state, "depth", 0) > 0


@contextlib.contextmanager
def _recomputation(marked: bool, kept_tensors: dict | None = None):
    depth, previous = getattr(_state, "depth", 0), getattr(_state, "kept", None)
    _state.depth = depth + int(marked)
    _state.kept = kept_tensors if marked else None
    try:
        yield
    finally:
        _state.depth, _state.kept = depth, previous


@contextlib.contextmanager
def _collecting(collector: dict | None):
    previous = getattr(_state, "collector", None)
    _state.collector = collector
    try:
        yield
    finally:
        _state.collector = previous


def keep(name: str, tensor: torch.Tensor) -> None:
    """Offer an intermediate of a checkpointed layer's forward to its re-run (module
    docstring).  Does nothing unless a checkpointer that keeps is running the layer."""
    collector = getattr(_state, "collector", None)
    if collector is not None:
        collector[name] = tensor.detach()


def kept(name: str) -> torch.Tensor | None:
    """In a marked re-run, the tensor the forward offered under ``name``; else None."""
    kept_tensors = getattr(_state, "kept", None)
    return None if kept_tensors is None else kept_tensors.get(name)


def keeping() -> bool:
    """Whether a checkpointer that keeps is running a layer's forward now, so that what
    ``keep`` is offered reaches the re-run."""
    return getattr(_state, "collector", None) is not None


def keep_group(prefix: str, tensors: dict[str, torch.Tensor]) -> bool:
    """keep() each tensor under ``prefix + name``, unless this layer's forward kept a group
    under ``prefix`` already (a second module of the kind in one layer then recomputes);
    whether they were kept."""
    collector = getattr(_state, "collector", None)
    if collector is None or any(name.startswith(prefix) for name in collector):
        return False
    for name, tensor in tensors.items():
        collector[prefix + name] = tensor.detach()
    return True


def take_kept_group(prefix: str) -> dict[str, torch.Tensor] | None:
    """In a marked re-run, the tensors ``keep_group(prefix, ...)`` kept, by their own
    names; they are taken, so a second call finds none (as ``keep_group`` kept one group
    per layer).  None where nothing was kept."""
    kept_tensors = getattr(_state, "kept", None)
    if not kept_tensors:
        return None
    names = [name for name in kept_tensors if name.startswith(prefix)]
    return {name[len(prefix) :]: kept_tensors.pop(name) for name in names} or None


class _UnreadSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.shapes = a.shape, b.shape
        shape = torch.broadcast_shapes(a.shape, b.shape)
        # One uninitialised element, broadcast: the value is never read.
        return a.new_empty((), dtype=torch.result_type(a, b)).expand(shape)

    @staticmethod
    def backward(ctx, grad):
        return tuple(grad.sum_to_size(shape) if grad.shape != shape else grad for shape in ctx.shapes)


def unread_sum(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a + b as the autograd graph sees it, for a marked re-run's layer output, which is
    never read: backward passes the gradient to both, but no add runs and no output
    buffer is filled (its values are undefined)."""
    return _UnreadSum.apply(a, b)


def _output_may_be_read(run_function) -> bool:
    """Whether a forward hook may see the re-run's output: a global one, or one on the
    layer that transformers' checkpoint call re-runs (``partial(forward, layer)``, or
    ``partial(layer.__call__)`` in older versions, which runs the layer's hooks)."""
    if torch.nn.modules.module._global_forward_hooks:
        return True
    func = getattr(run_function, "func", run_function)
    layer = getattr(func, "__self__", None)
    if layer is None and getattr(run_function, "args", None):
        layer = run_function.args[0]
    return isinstance(layer, torch.nn.Module) and bool(layer._forward_hooks)
