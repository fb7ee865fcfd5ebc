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

Not captured (the layer then runs as before): CPU tensors; a layer with active dropout
(the graph would replay the same random mask); parameters with gradient hooks; a layer
FSDP2 shards (its gathered weights move between steps); layer
arguments other than tensors, None, numbers and strings (a KV cache); a layer whose
output is not one tensor; a layer that reads a tensor with grad besides its input or is
handed a mapping it may write into (the checkpointer runs those itself: their gradients
are more than the input's; ``checkpointing.layer_call``).  A signature is captured the second time it is seen (the first
run warms Triton's autotuner and cuBLAS); a model that keeps changing shape replays
nothing after ``max_signatures`` shapes.  Batches of more than ``max_tokens`` tokens run
eagerly: a layer's GPU time grows with the tokens while the host's does not, so long
sequences gain nothing, and the pool would hold a long sequence's recompute memory
beside the allocator's own.  A capture that fails turns graphs off for the model, with
one warning: training continues without them.

A layer call as a graph sees it, and which layers it may replay: ``layer_graph_calls``.
The static buffers the graphs read and write, and how gradients leave them:
``layer_graph_buffers``.
"""

from __future__ import annotations

import contextlib
import warnings

import torch

from slothkit.engine.layer_graph_buffers import _accumulate, _gradients_watched, _Statics
from slothkit.engine.layer_graph_calls import _Call, _has_active_dropout, _has_grad_hooks, _is_sharded
from slothkit.memory.sizes import SHORT_STEP_TOKENS


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

    def __getstate__(self) -> dict:
        """A copy of the model (copy.deepcopy, pickle) starts with no graphs: captured
        graphs and their memory pool belong to the original's layers and tensors, and
        neither copies nor pickles."""
        fresh = {"pool": None, "seen": {}, "graphs": {}, "statics": {}, "signatures": set()}
        return {**self.__dict__, **fresh, "eligible_layers": {}, "kept_names": {}}

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


def _autocast(device_type: str, dtype):
    # No cast cache: a cached cast would outlive the capture it was made in.
    if dtype is None:
        return torch.autocast(device_type, enabled=False)
    return torch.autocast(device_type, dtype=dtype, cache_enabled=False)
