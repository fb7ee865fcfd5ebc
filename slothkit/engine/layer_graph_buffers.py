"""The static buffers the layer graphs (``layer_graphs``) read and write, and how the
parameters' gradients leave them.

A graph bakes in the addresses it read and wrote at capture, so:
- the layer's weights and adapters must stay where they are (optimizers update them in
  place);
- everything else the layer reads (hidden states, cos/sin tables, masks) is copied into
  static buffers before each replay;
- parameter gradients come out of the graph in static buffers and are added to
  ``param.grad`` afterwards (so ``zero_grad(set_to_none=True)`` keeps working); under a
  process group through autograd's accumulator nodes, whose hooks DistributedDataParallel
  needs to all-reduce them;
- a layer's input is usually the previous layer's output, cloned out of the same input
  buffer, and its incoming gradient the later layer's input gradient, cloned out of the
  same gradient buffer: while that tensor is unchanged (same object, same version
  counter, which every in-place write bumps) the buffer still holds its values and the
  copy back in is skipped.  Two copies of the hidden states per layer and step (on
  Llama-3-8B, 2 x 33.5 MB each) that the graphs would otherwise add;
- tensors the layer keeps for its re-run (``recomputation.keep``) are copied into
  static buffers by the forward graph and handed out as copies after the replay; the
  backward graph's re-run reads them from the same buffers, copied in before the replay.
  A graph with kept tensors is a different graph from one without.
"""

from __future__ import annotations

import weakref

import torch


class _Statics:
    """Buffers shared by every layer's forward and backward graphs of one signature
    (the two never replay at the same time)."""

    def __init__(self, hidden: torch.Tensor, leaves: list):
        # The layer's input; the forward graph leaves the layer's output in it.
        self.hidden = torch.empty_like(hidden)
        self.leaves = [torch.empty_like(leaf) if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        self.sources = [None] * len(leaves)  # the tensors last copied in, to skip repeats
        # The backward graph's incoming gradient, overwritten by the input's gradient.
        self.grad_output = None
        self.grads: dict[tuple, list[torch.Tensor]] = {}  # parameters' gradients, by their shapes
        # What the layers keep for their re-runs, by name: written by the forward graphs,
        # read by the backward graphs (created in the first capture that keeps it).
        self.kept: dict[str, torch.Tensor] = {}
        # Which tensor's values hidden and grad_output hold now (see _holding).
        self.hidden_holds = None
        self.grad_output_holds = None

    def load_grad_output(self, grad_output: torch.Tensor) -> None:
        if not _holds(self.grad_output_holds, grad_output):
            self.grad_output.copy_(grad_output)
            self.grad_output_holds = _holding(grad_output)

    def hidden_out(self) -> torch.Tensor:
        """A copy of what the forward graph left in hidden (the layer's output)."""
        output = self.hidden.clone()
        self.hidden_holds = _holding(output)
        return output

    def grad_output_out(self) -> torch.Tensor:
        """A copy of what the backward graph left in grad_output (the input's gradient)."""
        grad_input = self.grad_output.clone()
        self.grad_output_holds = _holding(grad_input)
        return grad_input

    def store_kept(self, tensors: dict) -> None:
        for name, tensor in tensors.items():
            buffer = self.kept.get(name)
            if buffer is None:
                buffer = self.kept[name] = torch.empty_like(tensor)
            elif buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
                raise TypeError(f"the layers keep {name!r} in different shapes or dtypes")
            buffer.copy_(tensor)

    def load(self, hidden: torch.Tensor, leaves: list) -> None:
        if not _holds(self.hidden_holds, hidden):
            self.hidden.copy_(hidden)
            self.hidden_holds = _holding(hidden)
        for i, leaf in enumerate(leaves):
            # The same cos/sin tables reach every layer of a step: copy them once.
            if isinstance(leaf, torch.Tensor) and self.sources[i] is not leaf:
                self.leaves[i].copy_(leaf)
                self.sources[i] = leaf


def _holding(tensor: torch.Tensor) -> tuple | None:
    """A record that a static buffer holds ``tensor``'s values: a weak reference (the
    record must not keep a layer's output alive) and its version counter.  None for an
    inference-mode tensor, which has no version counter: its copy is never skipped."""
    if tensor.is_inference():
        return None
    return weakref.ref(tensor), tensor._version


def _holds(record: tuple | None, tensor: torch.Tensor) -> bool:
    """Whether the buffer behind ``record`` still holds ``tensor``'s values: the same
    object, not written in place since (a write through a view bumps the same counter)."""
    return record is not None and record[0]() is tensor and record[1] == tensor._version


def _gradients_watched() -> bool:
    """Whether something may wait on autograd's gradient accumulation: under a process
    group, DistributedDataParallel's reducer learns that a parameter's gradient is ready
    from a hook on its accumulator node (one Python cannot see), and all-reduces the
    gradient's bucket then; a gradient written into ``.grad`` directly is never reduced,
    and the processes' adapters drift apart without an error."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _accumulate(
    params: list[torch.Tensor], grads: list[torch.Tensor], through_autograd: bool = False
) -> None:
    """param.grad += grad, as autograd's accumulation would (a new tensor where None),
    in one multi-tensor launch each rather than one per parameter; with
    ``through_autograd``, by autograd's own accumulator nodes (one add per parameter),
    so that their hooks run (``_gradients_watched``).  Either way ``.grad`` never aliases
    ``grads``, the static buffers the next replay overwrites."""
    if through_autograd:
        # The leaves' gradient edges are their AccumulateGrad nodes: this runs only them.
        # They copy a gradient another tensor still holds (the static buffer) rather than
        # adopt it.
        torch.autograd.backward(params, grads)
        return
    existing = [(p.grad, g) for p, g in zip(params, grads) if p.grad is not None]
    if existing:
        torch._foreach_add_([e[0] for e in existing], [e[1] for e in existing])
    missing = [(p, g) for p, g in zip(params, grads) if p.grad is None]
    if missing:
        # x * 1.0 is x exactly: fresh copies of the static buffers, which the next replay reuses.
        for (p, _), copy in zip(missing, torch._foreach_mul([g for _, g in missing], 1.0)):
            p.grad = copy
