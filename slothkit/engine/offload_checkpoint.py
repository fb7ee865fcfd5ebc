"""Gradient checkpointing that keeps each decoder layer's input in host memory.

Plain checkpointing keeps one activation per layer on the GPU (the layer's
input, B x T x H) and recomputes the rest in backward, so activation memory
still grows with depth: 32 layers x 2 x 2048 x 4096 x 2 bytes = 1 GiB for
Llama-3-8B at batch 2, and far more at long context.  Here that input is copied
to pinned host memory on a side stream during forward, and copied back on a side
stream one layer ahead during backward (while the layer above is being
recomputed), so the GPU holds only the few layers in flight.

Autograd: the layer runs under no_grad in forward; in backward its input is
brought back, the layer is re-run with grad enabled under the same RNG and
autocast state, and ``torch.autograd.backward`` sends the incoming gradient
through it.  Parameter gradients (the LoRA matrices) accumulate during that
inner backward, as in reentrant checkpointing, so the model's inputs must
require grad (``model.enable_input_require_grads()``; FastModel does this).

The re-run's output is never read (only its graph is), so modules may skip work
whose result feeds only the layer output: ``recomputing()`` says when they are
inside the re-run of one decoder layer (the checkpointers ``enable_checkpointing``
installs; a function checkpointed through ``offload_checkpoint`` may be anything,
and is not marked).  The fused MLP uses it to skip its down projection, and the
decoder layer its last residual sum (``unread_sum``).  A forward hook on the layer
(or a global one) could read that output, so with one the re-run is not marked
either and runs in full.

Where host memory is short, ``DeviceCheckpointer`` (``OffloadedCheckpointer.on_device``)
checkpoints a layer the same way but leaves its input on the GPU, as plain checkpointing
does; use_gradient_checkpointing="auto" gives it to the layers the host cannot take.

Kept intermediates.  A layer may also hand an intermediate of its forward to the
re-run, so as not to compute it twice: ``keep(name, tensor)`` in the forward, and
``kept(name)`` in the marked re-run, which returns it (None everywhere else).  The
decoder layer keeps the residual sum after attention, so its re-run skips the output
projection.  A kept tensor travels like the layer input (to pinned host memory and
back, prefetched one layer ahead), so it costs host memory and copy bandwidth; a
checkpointer collects them only when built with ``keeps=True``.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import warnings
import weakref

import torch

from slothkit.engine.layer_graphs import LayerGraphs
from slothkit.engine.pinned_pieces import PinnedPieces
from slothkit.engine.sizes import SHORT_STEP_TOKENS, pinned_bytes

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


class _OffloadedActivation:
    """One layer's saved tensors (its input, then what it kept): their host copies, and
    the device copies once prefetched."""

    def __init__(
        self, tensors: list[torch.Tensor], stream: torch.cuda.Stream, nbytes: int = 0, on_release=None
    ):
        self.device = tensors[0].device
        self.stream = stream
        self.on_release = None  # set once the copies are under way (below)
        self.nbytes = nbytes  # of the tensors, handed to on_release
        # Power-of-two pieces: whole pinned blocks rounded up to one would cost up to 2x.
        sources = [t.contiguous() for t in tensors]
        self.host = [PinnedPieces(t) for t in sources]
        self.previous = None  # weakref to the activation of the layer run before this one
        self.prefetched = None
        self.ready = torch.cuda.Event()
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for host, source in zip(self.host, sources):
                host.copy_from(source)
            self.ready.record(stream)
        # The caching allocator must not hand these blocks to anyone else until the copies are done.
        for source in sources:
            source.record_stream(stream)
        # Called with the pinned bytes once the host copies are let go (or never read).
        self.on_release = on_release

    def prefetch(self) -> None:
        """Start the host-to-device copies on the side stream, if not started yet.

        The device copies are allocated on the compute stream, which reads and frees
        them: the caching allocator reuses a freed block only for allocations on the
        stream that made it, so blocks made on the side stream would sit cached where
        the next forward cannot use them (1.4 GiB of Llama-3-8B's reserved peak at 2 x
        2048).  The side stream first waits for the compute stream's queued work, the
        blocks' earlier users, then writes them; record_stream keeps a block from being
        handed out again before that copy is done, should it be freed unread.
        """
        if self.prefetched is not None or self.host is None:
            return
        current = torch.cuda.current_stream(self.device)
        self.prefetched = [torch.empty(h.shape, dtype=h.dtype, device=self.device) for h in self.host]
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(self.ready)
            for device_copy, host in zip(self.prefetched, self.host):
                host.copy_to(device_copy)
                device_copy.record_stream(self.stream)
            self.ready = torch.cuda.Event()
            self.ready.record(self.stream)

    def fetch(self) -> list[torch.Tensor]:
        self.prefetch()
        current = torch.cuda.current_stream(self.device)
        current.wait_event(self.ready)
        tensors = self.prefetched
        self.prefetched = None
        self._release_host()  # the pinned buffers, once consumed
        return tensors

    def _release_host(self) -> None:
        if getattr(self, "host", None) is not None:  # also for an __init__ that failed
            self.host = None
            if self.on_release is not None:
                self.on_release(self.nbytes)

    def __del__(self):  # a forward whose backward never ran
        self._release_host()


class _Checkpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, checkpointer, run_function, hidden_states, *args):
        ctx.run_function = run_function
        ctx.marks_recompute = checkpointer.marks_recompute
        ctx.args = args
        ctx.autocast = _autocast_state(hidden_states.device.type)
        ctx.cpu_rng = torch.get_rng_state()
        ctx.cuda_rng = torch.cuda.get_rng_state(hidden_states.device) if hidden_states.is_cuda else None
        ctx.graphs = checkpointer.graphs
        # Kept tensors are for a marked re-run only.
        collector = (
            {} if checkpointer.keeps_for(hidden_states) and not _output_may_be_read(run_function) else None
        )
        output = None
        if ctx.graphs is not None:
            output = ctx.graphs.forward(
                run_function, hidden_states, args, ctx.autocast, collector, _collecting
            )
        if output is None:
            with torch.no_grad(), _collecting(collector):
                output = run_function(hidden_states, *args)
        ctx.kept_names = list(collector or ())
        kept_tensors = [collector[name] for name in ctx.kept_names]
        if hidden_states.is_cuda and checkpointer.to_host:
            ctx.offloaded = checkpointer.offload(hidden_states, *kept_tensors)
            ctx.saved = None
            if ctx.offloaded is None:  # the host budget is spent: kept on the GPU
                ctx.saved = [hidden_states.detach(), *kept_tensors]
        else:  # nothing to offload to, or kept on the GPU: keep them where they are
            ctx.offloaded = None
            ctx.saved = [hidden_states.detach(), *kept_tensors]
        ctx.input_requires_grad = hidden_states.requires_grad
        return output

    @staticmethod
    def backward(ctx, *grad_outputs):
        previous = None
        if ctx.offloaded is not None:
            previous = ctx.offloaded.previous() if ctx.offloaded.previous is not None else None
            saved = ctx.offloaded.fetch()  # [input, *kept]
        else:
            # Handed over, so that the layer graphs' backward can free them as it would
            # fetched copies (it empties the list once they are in its buffers).
            saved, ctx.saved = list(ctx.saved), None
        # The next layer's copy overlaps this layer's recompute; a replayed layer frees
        # its fetched tensors (copied into the graph's buffers) before it is allocated.
        prefetch = previous.prefetch if previous is not None else None
        marked = ctx.marks_recompute and not _output_may_be_read(ctx.run_function)
        if ctx.graphs is not None and len(grad_outputs) == 1:
            grad_input = ctx.graphs.backward(
                ctx.run_function,
                saved,
                ctx.args,
                ctx.autocast,
                grad_outputs[0],
                lambda kept: _recomputation(marked, kept),
                ctx.kept_names if marked else None,
                before_replay=prefetch,
            )
            if grad_input is not None:
                return (None, None, grad_input if ctx.input_requires_grad else None) + (None,) * len(ctx.args)
        if prefetch is not None:
            prefetch()  # a second call does nothing
        hidden_states, *kept_values = saved
        del saved
        kept_tensors = dict(zip(ctx.kept_names, kept_values))
        hidden_states = hidden_states.detach().requires_grad_(ctx.input_requires_grad)
        devices = [hidden_states.device] if ctx.cuda_rng is not None else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(ctx.cpu_rng)
            if ctx.cuda_rng is not None:
                torch.cuda.set_rng_state(ctx.cuda_rng, hidden_states.device)
            with (
                torch.enable_grad(),
                _autocast(hidden_states.device.type, ctx.autocast),
                _recomputation(marked, kept_tensors),
            ):
                outputs = ctx.run_function(hidden_states, *ctx.args)
        if isinstance(outputs, torch.Tensor):
            outputs = (outputs,)
        pairs = [
            (out, grad)
            for out, grad in zip(outputs, grad_outputs)
            if isinstance(out, torch.Tensor) and out.requires_grad and grad is not None
        ]
        if pairs:
            torch.autograd.backward([p[0] for p in pairs], [p[1] for p in pairs])
        grad_input = hidden_states.grad if ctx.input_requires_grad else None
        return (None, None, grad_input) + (None,) * len(ctx.args)


def _autocast_state(device_type: str):
    if not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def _autocast(device_type: str, dtype):
    if dtype is None:
        return torch.autocast(device_type, enabled=False)
    return torch.autocast(device_type, dtype=dtype)


class OffloadedCheckpointer:
    """A ``_gradient_checkpointing_func`` for transformers' decoder layers.

    One instance per model: it owns the side stream and links each layer's
    offloaded input to the previous layer's, so backward can prefetch one ahead.
    marks_recompute: each call runs one decoder layer, so its re-run in backward is
    marked (``recomputing()``) for the modules inside it.
    """

    to_host = True  # a layer's input goes to pinned host memory (on a GPU)

    def __init__(
        self,
        marks_recompute: bool = False,
        cuda_graphs: bool | str = False,
        keeps: bool = False,
        keep_max_tokens: int = SHORT_STEP_TOKENS,
        host_limit_bytes: float | None = None,
    ):
        self.on_device = DeviceCheckpointer(self)
        # Pinned host memory the offloaded inputs may hold at once (None: no limit); past
        # it a layer keeps its input on the GPU, said once, rather than the host running
        # out (which kills the process).  use_gradient_checkpointing="auto" plans within it.
        self.host_limit_bytes = host_limit_bytes
        self.pinned_bytes = 0
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._last = None
        self.marks_recompute = marks_recompute
        # Collect what the layers offer with keep() for their re-runs (marked ones only),
        # for batches of up to keep_max_tokens tokens: in longer ones attention dominates
        # the re-run, while the kept tensors' host memory and in-flight device copies grow
        # with the tokens (and would shorten the longest sequence that fits).
        self.keeps = keeps
        self.keep_max_tokens = keep_max_tokens
        # Replay each layer's forward and backward (cuda_graphs="forward": the forward
        # only) from CUDA graphs where it can (slothkit.engine.layer_graphs); elsewhere, and on
        # the CPU, the layers run as before.
        if cuda_graphs == "forward":
            self.graphs = LayerGraphs(phases=("forward",))
        else:
            self.graphs = LayerGraphs() if cuda_graphs else None

    def keeps_for(self, hidden_states: torch.Tensor) -> bool:
        tokens = hidden_states.numel() // max(hidden_states.shape[-1], 1)
        return self.keeps and self.marks_recompute and tokens <= self.keep_max_tokens

    def offload(self, tensor: torch.Tensor, *kept_tensors: torch.Tensor) -> _OffloadedActivation | None:
        """Copy a layer's input and kept tensors to pinned host memory; None where that
        would pass ``host_limit_bytes`` (the caller keeps them on the GPU)."""
        nbytes = sum(pinned_bytes(t.numel() * t.element_size()) for t in (tensor, *kept_tensors))
        if self.host_limit_bytes is not None and self.pinned_bytes + nbytes > self.host_limit_bytes:
            _notice_host_memory_spent(self.host_limit_bytes)
            return None
        stream = self._streams.get(tensor.device)
        if stream is None:
            stream = self._streams[tensor.device] = torch.cuda.Stream(tensor.device)
        activation = _OffloadedActivation([tensor, *kept_tensors], stream, nbytes, on_release=self._released)
        self.pinned_bytes += nbytes
        last = self._last() if self._last is not None else None
        if last is not None and last.host is not None:
            activation.previous = weakref.ref(last)
        self._last = weakref.ref(activation)
        return activation

    def _released(self, nbytes: int) -> None:
        self.pinned_bytes -= nbytes

    def __call__(self, run_function, hidden_states, *args):
        return _Checkpoint.apply(self, run_function, hidden_states, *args)


@functools.cache
def _notice_host_memory_spent(limit_bytes: float) -> None:
    warnings.warn(
        f"slothkit: the pinned host memory for offloaded layer inputs is spent "
        f"({limit_bytes / 2**30:.1f} GiB: the available memory less 10 %, or max_host_memory=): "
        f"the next layers keep their inputs on the GPU (use_gradient_checkpointing='auto' "
        f"plans for this; docs/planner.md)",
        stacklevel=5,
    )


class DeviceCheckpointer:
    """The same checkpointing for layers whose input (and kept tensors) stay on the GPU:
    ``use_gradient_checkpointing="auto"`` gives it to the layers that the host memory
    budget cannot take.  It shares the offloading checkpointer's marking, kept sums and
    layer graphs (``OffloadedCheckpointer.on_device``)."""

    to_host = False

    def __init__(self, offloading: OffloadedCheckpointer):
        self.offloading = offloading

    @property
    def marks_recompute(self) -> bool:
        return self.offloading.marks_recompute

    @property
    def keeps(self) -> bool:
        return self.offloading.keeps

    @property
    def keep_max_tokens(self) -> int:
        return self.offloading.keep_max_tokens

    @property
    def graphs(self):
        return self.offloading.graphs

    @graphs.setter
    def graphs(self, graphs) -> None:
        self.offloading.graphs = graphs

    def keeps_for(self, hidden_states: torch.Tensor) -> bool:
        return self.offloading.keeps_for(hidden_states)

    def __call__(self, run_function, hidden_states, *args):
        return _Checkpoint.apply(self, run_function, hidden_states, *args)


def offload_checkpoint(run_function, hidden_states, *args):
    """Functional form for a single call (no cross-layer prefetch)."""
    return OffloadedCheckpointer()(run_function, hidden_states, *args)


def uses_offloaded_checkpoint(layers) -> bool:
    """Whether any of ``layers`` is checkpointed through an ``OffloadedCheckpointer``, whose
    backward runs the layer's backward inside its own (as reentrant checkpointing does).

    Args:
        layers: the decoder layers, or any modules (``model.modules()``): those without
            transformers' checkpointing attributes count as not checkpointed.
    """
    return any(
        getattr(layer, "gradient_checkpointing", False)
        and isinstance(
            getattr(layer, "_gradient_checkpointing_func", None), (OffloadedCheckpointer, DeviceCheckpointer)
        )
        for layer in layers
    )


CUDA_GRAPHS_CHOICES = (None, True, False, "forward")
KEEP_SUMS_CHOICES = (None, True, False)


def enable_checkpointing(
    layers,
    mode,
    cuda_graphs: bool | str | None = None,
    quantized: bool = False,
    keep_sums: bool | None = None,
    host_limit_bytes: float | None = None,
) -> None:
    """Turn on checkpointing for transformers decoder layers (GradientCheckpointingLayer).

    Measured for the automatic choices, on an H200 (Llama-3-8B and Mistral-7B, 2 x 2048
    tokens, same-run A/Bs): QLoRA 11,306 tokens/s with both graphs against 10,285
    without, since every NF4 weight adds dequantisation launches and the host could not
    keep up in either phase.  16-bit LoRA: both graphs 11,858 against 12,021 without (its
    backward is bound by the GPU's kernels); the forward graphs alone remove the
    forward's host-bound idle time (29 -> 8 ms per step in the Mistral-7B profile) but
    gain only 0.4% (Llama) and 1.3% (Mistral), for 64 MB more allocated and 1 GiB more
    reserved by the graphs' pool, so they are there to ask for, not the default
    (docs/performance.md).  T4/V100-class GPUs run a layer far slower than the host
    issues it, and their memory is tight.

    Args:
        layers: the decoder layers (each with transformers' ``gradient_checkpointing``
            hooks).
        mode: "offload" (this module; "unsloth" is read as "offload"), True (torch's
            non-reentrant checkpoint) or False (off).
        cuda_graphs: offload only. Replay the layers from CUDA graphs where possible
            (slothkit.engine.layer_graphs): True for both the checkpointed forward and
            the recompute with backward, "forward" for the forward only, False for
            neither. None (default): both for 4-bit (``quantized``) models on GPUs of
            compute capability 8.0 and up; none for 16-bit models, older GPUs and the
            CPU.
        quantized: whether the model holds 4-bit weights (for the cuda_graphs default).
        keep_sums: offload only. Let the layers keep the residual sum after attention
            for their re-runs, which then skip o_proj (one more B x T x hidden tensor per
            layer in pinned host memory, copied each way). None (default): on for GPUs
            of compute capability 8.0 and up; off for older ones (whose hosts, Colab's
            and Kaggle's, have little memory to pin) and the CPU.
        host_limit_bytes: offload only. The pinned host memory the offloaded inputs may
            hold at once; past it a layer keeps its input on the GPU (said once).  None:
            no limit.

    Raises:
        ValueError: ``mode``, ``cuda_graphs`` or ``keep_sums`` is not one of the
            accepted values.
    """
    if cuda_graphs not in CUDA_GRAPHS_CHOICES:
        raise ValueError(f"cuda_graphs={cuda_graphs!r}; accepted: None (automatic), True, False, 'forward'")
    if keep_sums not in KEEP_SUMS_CHOICES:
        raise ValueError(f"keep_sums={keep_sums!r}; accepted: None (automatic), True, False")
    fast_gpu = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0)
    if keep_sums is None:
        keep_sums = fast_gpu
    if cuda_graphs is None:
        cuda_graphs = fast_gpu and bool(quantized)
    if mode not in (True, False, "offload", "unsloth"):
        raise ValueError(f"use_gradient_checkpointing={mode!r}; accepted: 'offload', True, False")
    if mode is False:
        for layer in layers:
            layer.gradient_checkpointing = False
        return
    if mode in ("offload", "unsloth"):
        func = OffloadedCheckpointer(
            marks_recompute=True, cuda_graphs=cuda_graphs, keeps=keep_sums, host_limit_bytes=host_limit_bytes
        )
    else:
        from functools import partial

        from torch.utils.checkpoint import checkpoint

        func = partial(checkpoint, use_reentrant=False)
    for layer in layers:
        if not hasattr(layer, "_gradient_checkpointing_func") and not hasattr(
            type(layer), "gradient_checkpointing"
        ):
            raise TypeError(
                f"{type(layer).__name__} does not support transformers' gradient checkpointing hooks"
            )
        layer.gradient_checkpointing = True
        layer._gradient_checkpointing_func = func
