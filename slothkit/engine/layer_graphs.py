"""CUDA graphs for checkpointed decoder layers.

On a fast GPU the host needs about as long to issue one checkpointed layer's work
(some 150 kernel launches per training step, and the Python around them) as the GPU
needs to run it, so the GPU waits on the host for part of every step
(docs/performance.md, "Where the time goes").  A CUDA graph captured once
replays all of a layer's kernels with one call.  Two graphs per layer and input
signature:

- forward: the layer under ``no_grad``, as the checkpointed forward runs it;
- backward: the layer re-run with grad (the recompute) and ``torch.autograd.grad`` of
  its output with respect to its input and its trainable parameters.

``phases=("forward",)`` replays the forward only, for models whose backward keeps the
GPU busy on its own (16-bit LoRA): the backward then runs eagerly, and the graphs need
no gradient buffers.

Memory: every graph of a model shares one memory pool, and all layers share the same
static buffers (a layer's graph copies its results into them before its own
intermediates are released back to the pool), so the graphs together hold about what
one layer's recompute holds, not one layer's worth per layer.  The buffers are as few
as the graphs allow: one for the layer's input, which the forward graph overwrites with
the layer's output and the backward graph reads again; one for the incoming gradient,
which the backward graph overwrites with the input's gradient; and the parameters'
gradients.  After a capture the eager allocator's cached blocks are released: the
recompute that used them now runs in the pool.  In backward the checkpointer's fetched
copies of the layer's input and kept tensors are freed as soon as they are copied into
the buffers, before the next layer's prefetch is allocated (docs/performance.md,
"Where the memory goes": 64 MB off Mistral-7B QLoRA's peak).

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
- tensors the layer keeps for its re-run (``offload_checkpoint.keep``) are copied into
  static buffers by the forward graph and handed out as copies after the replay; the
  backward graph's re-run reads them from the same buffers, copied in before the replay.
  A graph with kept tensors is a different graph from one without.

Not captured (the layer then runs as before): CPU tensors; a layer with active dropout
(the graph would replay the same random mask); parameters with gradient hooks; a layer
FSDP2 shards (its gathered weights move between steps); layer
arguments other than tensors, None, numbers and strings (a KV cache); a layer whose
output is not one tensor.  A signature is captured the second time it is seen (the first
run warms Triton's autotuner and cuBLAS); a model that keeps changing shape replays
nothing after ``max_signatures`` shapes.  Batches of more than ``max_tokens`` tokens run
eagerly: a layer's GPU time grows with the tokens while the host's does not, so long
sequences gain nothing, and the pool would hold a long sequence's recompute memory
beside the allocator's own.  A capture that fails turns graphs off for the model, with
one warning: training continues without them.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
import weakref

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from slothkit.engine.sizes import SHORT_STEP_TOKENS

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


class LayerGraphs:
    """The graphs of one model's checkpointed layers (see the module docstring)."""

    def __init__(
        self,
        max_signatures: int = 4,
        max_tokens: int = SHORT_STEP_TOKENS,
        phases: tuple[str, ...] = ("forward", "backward"),
    ):
        self.enabled = True
        # Which of a layer's two calls are replayed: both, or only the checkpointed
        # forward (the phase where the host lags the GPU when the backward does not).
        self.phases = phases
        self.max_signatures = max_signatures
        self.max_tokens = max_tokens
        self.pool = None
        self.seen: dict[tuple, int] = {}
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.statics: dict[tuple, _Statics] = {}
        self.signatures: set[tuple] = set()
        self.eligible_layers: dict[int, bool] = {}
        self.kept_names: dict[tuple, tuple] = {}  # forward graph key -> names it keeps

    # -- the CUDA calls (a test replaces them to check the plumbing on a CPU) ----------

    def _device_ok(self, hidden: torch.Tensor) -> bool:
        """On a GPU, and not inside someone else's capture already."""
        return hidden.is_cuda and not torch.cuda.is_current_stream_capturing()

    def _new_graph(self):
        return torch.cuda.CUDAGraph()

    def _sync(self) -> None:
        torch.cuda.synchronize()

    def _release_cached(self) -> None:
        torch.cuda.empty_cache()

    def _record(self, graph, body) -> None:
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        # thread_local: the backward capture runs on autograd's device thread, and
        # only this thread's calls must stay out of the graph.
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            body()

    # -- when a graph may be used ---------------------------------------------------

    def _usable(self, call: _Call, hidden: torch.Tensor) -> bool:
        if not (self.enabled and call.replayable() and self._device_ok(hidden)):
            return False
        if hidden.numel() // max(hidden.shape[-1], 1) > self.max_tokens:
            return False
        key = id(call.layer)
        if key not in self.eligible_layers:  # dropout, hooks and sharding are settled once per layer
            params = [p for p in call.layer.parameters() if p.requires_grad]
            self.eligible_layers[key] = (
                not _has_active_dropout(call.layer)
                and not any(_has_grad_hooks(p) for p in params)
                and not _is_sharded(call.layer)
            )
        return self.eligible_layers[key]

    def _ready(self, kind: str, call: _Call, signature: tuple) -> bool:
        """True once this layer and signature have run eagerly before (capture now or replay)."""
        key = (kind, id(call.layer), signature)
        if key in self.graphs:
            return True
        if signature not in self.signatures and len(self.signatures) >= self.max_signatures:
            return False
        self.seen[key] = self.seen.get(key, 0) + 1
        return self.seen[key] >= 2

    def _fail(self, error: Exception) -> None:
        self.enabled = False
        self.graphs.clear()
        self.statics.clear()
        warnings.warn(
            f"slothkit: CUDA graphs for the decoder layers are off for this model "
            f"({type(error).__name__}: {error}); training goes on without them, "
            f"at the slower eager speed",
            stacklevel=3,
        )

    def _capture(self, key, body, on_failure=None):
        graph = self._new_graph()
        self._sync()
        try:
            self._record(graph, body)
        except Exception as error:  # noqa: BLE001 - anything the capture refused
            try:
                self._sync()
            except RuntimeError:
                pass  # the capture's own error is the one worth reporting
            if on_failure is not None:
                on_failure()  # before _fail drops the static buffers
            self._fail(error)
            return None
        self.graphs[key] = graph
        self.signatures.add(key[2])
        # The eager runs before this capture left their intermediates cached; this
        # layer's work now runs in the pool, so give those blocks back to the device.
        self._release_cached()
        return graph

    def _statics_for(self, signature: tuple, hidden: torch.Tensor, leaves: list) -> _Statics:
        statics = self.statics.get(signature)
        if statics is None:
            statics = self.statics[signature] = _Statics(hidden, leaves)
        return statics

    # -- forward ----------------------------------------------------------------------

    def forward(
        self,
        run_function,
        hidden: torch.Tensor,
        args,
        autocast_dtype,
        collector: dict | None = None,
        collecting=None,
    ):
        """The layer's output under no_grad, replayed from a graph; None when the caller
        must run the layer itself.  With a ``collector`` (a dict, and ``collecting(d)``
        the context in which the layer's keep() calls fill d), what the layer keeps is
        added to it as fresh copies."""
        if "forward" not in self.phases:
            return None
        call = _Call(run_function, args)
        if not self._usable(call, hidden):
            return None
        signature = call.signature(hidden, autocast_dtype)
        if not self._ready("forward", call, signature):
            return None
        keeps = collector is not None
        key = ("forward", id(call.layer), signature, keeps)
        statics = self._statics_for(signature, hidden, call.leaves)
        statics.load(hidden, call.leaves)
        graph = self.graphs.get(key)
        if graph is None:

            def body():
                kept = {}
                with (
                    torch.no_grad(),
                    _autocast(hidden.device.type, autocast_dtype),
                    collecting(kept) if keeps else contextlib.nullcontext(),
                ):
                    output = call(statics.hidden, statics.leaves)
                if (
                    not isinstance(output, torch.Tensor)
                    or output.shape != statics.hidden.shape
                    or output.dtype != statics.hidden.dtype
                ):
                    raise TypeError("the layer's output is not one tensor shaped like its input")
                statics.store_kept(kept)
                self.kept_names[key] = tuple(kept)
                # The input is read by now (stream order): the output takes its place.
                statics.hidden.copy_(output)

            graph = self._capture(key, body)
            if graph is None:
                return None
        graph.replay()
        if keeps:
            # Copies: the next layer's replay overwrites the buffers while these are
            # still being offloaded.
            collector.update((name, statics.kept[name].clone()) for name in self.kept_names[key])
        return statics.hidden_out()

    # -- recompute and backward -------------------------------------------------------

    def backward(
        self,
        run_function,
        saved: list,
        args,
        autocast_dtype,
        grad_output,
        recompute_context=lambda kept: contextlib.nullcontext(),
        kept_names: tuple | None = None,
        before_replay=None,
    ):
        """The gradient of the layer's input, with its parameters' gradients added to
        their ``.grad``, replayed from a graph; None when the caller must do it itself.

        ``saved`` is the caller's list of the layer's input followed by what the layer
        kept in its forward; with ``kept_names`` (their names) the re-run reads them,
        from the static buffers, inside ``recompute_context(kept)`` (the checkpointer's
        marker that lets modules skip work whose output nobody reads). Once they are
        copied into the static buffers the list is emptied, so the caller's copies are
        freed before ``before_replay()`` runs (the checkpointer prefetches the next
        layer's there) and before the replay; when None is returned the list is as
        given (a capture that fails refills it from the buffers: the input and the named
        kept tensors)."""
        if "backward" not in self.phases:
            return None
        hidden = saved[0]
        call = _Call(run_function, args)
        if not self._usable(call, hidden) or not isinstance(grad_output, torch.Tensor):
            return None
        signature = call.signature(hidden, autocast_dtype)
        if not self._ready("backward", call, signature):
            return None
        params = [p for p in call.layer.parameters() if p.requires_grad]
        shapes = tuple((tuple(p.shape), p.dtype) for p in params)
        kept_names = tuple(kept_names or ())
        kept = dict(zip(kept_names, saved[1:]))
        key = ("backward", id(call.layer), signature, tuple(sorted(kept_names)))
        statics = self._statics_for(signature, hidden, call.leaves)
        if statics.grad_output is None:
            statics.grad_output = torch.empty_like(grad_output)
        if shapes not in statics.grads:
            statics.grads[shapes] = [torch.empty_like(p) for p in params]
        param_grads = statics.grads[shapes]
        statics.load(hidden, call.leaves)
        statics.load_grad_output(grad_output)
        statics.store_kept(kept)
        del hidden, kept
        saved.clear()  # the caller's device copies, no longer needed: freed here
        if before_replay is not None:
            before_replay()

        def refill():  # from the buffers, which a failed capture has not run on
            saved.extend([statics.hidden.clone(), *(statics.kept[name].clone() for name in kept_names)])

        graph = self.graphs.get(key)
        if graph is None:

            def body():
                layer_input = statics.hidden.detach().requires_grad_(True)
                with (
                    torch.enable_grad(),
                    _autocast(statics.hidden.device.type, autocast_dtype),
                    recompute_context({name: statics.kept[name] for name in kept_names}),
                ):
                    output = call(layer_input, statics.leaves)
                if (
                    not isinstance(output, torch.Tensor)
                    or output.shape != statics.grad_output.shape
                    or output.dtype != statics.hidden.dtype
                ):
                    raise TypeError("the layer's output is not one tensor shaped like its input")
                grads = torch.autograd.grad(
                    output, [layer_input, *params], statics.grad_output, allow_unused=True
                )
                for buffer, grad in zip(param_grads, grads[1:]):
                    if grad is None:
                        buffer.zero_()
                    else:
                        buffer.copy_(grad)
                # Backward has read the incoming gradient by now (stream order): the
                # input's gradient takes its place.
                statics.grad_output.copy_(grads[0])

            graph = self._capture(key, body, on_failure=refill)
            if graph is None:
                return None
        graph.replay()
        _accumulate(params, param_grads, through_autograd=_gradients_watched())
        return statics.grad_output_out()


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


def _autocast(device_type: str, dtype):
    # No cast cache: a cached cast would outlive the capture it was made in.
    if dtype is None:
        return torch.autocast(device_type, enabled=False)
    return torch.autocast(device_type, dtype=dtype, cache_enabled=False)
