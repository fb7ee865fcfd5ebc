"""What a checkpointed layer reads and writes besides its input.

A decoder layer may be handed more than its hidden states (transformers binds the keyword
arguments into the ``run_function`` it checkpoints, a ``functools.partial``):

- tensors that require grad, as positional arguments or at any depth of the dicts, lists
  and tuples among its keyword arguments.  Gemma 4 hands each layer its per-layer input,
  a slice of embeddings computed once before the layers;
- a mapping that the layer writes tensors into, for the layers after it.  Gemma 4's
  ``shared_kv_states``: the last layer of each attention type that computes keys and
  values stores them there, and the layers after the sharing point attend to them instead
  of computing their own.

``_Checkpoint`` runs the layer under no_grad and again, with grad, in backward; for its
gradients to be those of the plain model, autograd must see both:

- read: each tensor that requires grad is an input of the checkpoint.  The re-run reads a
  detached copy that requires grad, and the copy's gradient is returned for the original,
  so the graph outside the layer is walked once, by the outer backward (the re-run would
  otherwise backpropagate into it, once per layer that reads it).
- written: each tensor the layer puts into a mapping it was given is an output of the
  checkpoint, and the mapping holds that output in its place, so a later layer reading it
  (an input of that layer's checkpoint) sends its gradient back into this layer's backward,
  which sends it through the re-run's copy of the tensor together with the output's.

The re-run sees the mappings as they were when the layer was called, in shallow copies:
what it writes goes into the copies, and the mapping that the later layers read keeps the
checkpoint's outputs.  Mappings are the only containers followed for writes (a layer that
appends to a list it was given is not seen to write).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import MutableMapping

import torch


class LayerCall:
    """One checkpointed call ``run_function(hidden_states, *args)``: the tensors it reads
    that require grad (``reads``), and, once it has run, the tensors it wrote into the
    mappings among its arguments (``written``, until ``hand_over``)."""

    def __init__(self, run_function, args: tuple):
        self.run_function = run_function
        self.args = args
        keywords = run_function.keywords if isinstance(run_function, functools.partial) else {}
        # The arguments' values (the partial's own keyword dict is not the layer's to write).
        structure = self._forward_arguments = (args, tuple(keywords.values()))
        self._mappings = list(_mappings(structure))  # the forward's, until hand_over
        self._before = [dict(m.items()) for m in self._mappings]
        self.has_mappings = bool(self._mappings)
        reads = {}
        for tensor in _tensors(structure):
            if tensor.requires_grad:
                reads.setdefault(id(tensor), tensor)
        self.reads = list(reads.values())
        self.written: list[torch.Tensor] = []
        self._write_slots: list[tuple[int, object]] = []  # (mapping position, key)
        # What the re-run starts from: the arguments with each mapping copied as it is
        # now.  The backward holds these, never the mappings the layer writes into, whose
        # entries would hold the checkpoint's own outputs (a reference cycle through its
        # graph node that Python's collector cannot see).
        copies = {}
        self._names = tuple(keywords)
        self._template = _rebuilt(structure, {}, copies)
        self._template_mappings = [copies[id(m)] for m in self._mappings]
        if isinstance(run_function, functools.partial):
            self._func, self._bound = run_function.func, run_function.args
        else:
            self._func, self._bound = run_function, ()
        if self.has_mappings:
            template_args, values = self._template
            self.args = template_args
            self.run_function = functools.partial(self._func, *self._bound, **dict(zip(self._names, values)))

    @property
    def plain(self) -> bool:
        """Nothing to read with grad and nowhere to write: the layer's gradient is its
        input's alone (what the layer graphs replay)."""
        return not self.reads and not self.has_mappings

    def run(self, hidden_states: torch.Tensor):
        """The forward: the layer on its own arguments; afterwards ``written`` holds what it
        put into its mappings (new keys, or keys given another value)."""
        args, values = self._forward_arguments
        output = self._func(*self._bound, hidden_states, *args, **dict(zip(self._names, values)))
        written = {}
        for position, (mapping, before) in enumerate(zip(self._mappings, self._before)):
            for key, value in mapping.items():
                if key not in before or before[key] is not value:
                    self._write_slots.append((position, key))
                    for tensor in _tensors(value):
                        written.setdefault(id(tensor), tensor)
        self.written = list(written.values())
        return output

    def hand_over(self, written_outputs) -> None:
        """Put the checkpoint's outputs for the written tensors into the mappings, in place
        of the tensors the no_grad forward wrote, and let go of the mappings."""
        swap = {id(t): out for t, out in zip(self.written, written_outputs)}
        for position, key in self._write_slots:
            mapping = self._mappings[position]
            mapping[key] = _rebuilt(mapping[key], swap, {})
        self.written, self._mappings, self._before, self._forward_arguments = [], None, None, None

    def rerun(self, hidden_states: torch.Tensor, reads: list[torch.Tensor]):
        """The layer on ``hidden_states`` with ``reads`` in place of the tensors it read
        (same order), on copies of its mappings as they were at the call.  Returns the
        output and the tensors the re-run wrote, in the forward's order."""
        swap = {id(t): r for t, r in zip(self.reads, reads)}
        copies = {}
        args, values = _rebuilt(self._template, swap, copies)
        output = self._func(*self._bound, hidden_states, *args, **dict(zip(self._names, values)))
        written = {}
        for position, key in self._write_slots:
            for tensor in _tensors(copies[id(self._template_mappings[position])][key]):
                written.setdefault(id(tensor), tensor)
        return output, list(written.values())


def _mappings(obj):
    """The mutable mappings in ``obj``, depth first (those inside them included)."""
    if isinstance(obj, MutableMapping):
        yield obj
        for value in obj.values():
            yield from _mappings(value)
    elif isinstance(obj, (tuple, list)):
        for value in obj:
            yield from _mappings(value)


def _tensors(obj):
    """The tensors in ``obj``, depth first."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, MutableMapping):
        for value in obj.values():
            yield from _tensors(value)
    elif isinstance(obj, (tuple, list)):
        for value in obj:
            yield from _tensors(value)


def _rebuilt(obj, swap: dict, copies: dict):
    """``obj`` with each tensor whose id is in ``swap`` replaced, and mappings (copied:
    ``copies`` maps each original's id to its copy), tuples and lists rebuilt around them."""
    if isinstance(obj, torch.Tensor):
        return swap.get(id(obj), obj)
    if isinstance(obj, MutableMapping):
        new = copies[id(obj)] = copy.copy(obj)
        new.clear()
        for key, value in obj.items():
            new[key] = _rebuilt(value, swap, copies)
        return new
    if isinstance(obj, tuple):
        values = [_rebuilt(value, swap, copies) for value in obj]
        return type(obj)(*values) if hasattr(obj, "_fields") else type(obj)(values)
    if isinstance(obj, list):
        return [_rebuilt(value, swap, copies) for value in obj]
    return obj
