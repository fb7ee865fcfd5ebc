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

A layer may read tensors that require grad besides its input (Gemma 4's per-layer
input) and write tensors into a mapping it was given for the layers after it (Gemma 4's
shared keys and values): those are the checkpoint's further inputs and outputs, so their
gradients are those of the plain model (``layer_call``).

Where host memory is short, ``DeviceCheckpointer`` (``OffloadedCheckpointer.on_device``)
checkpoints a layer the same way but leaves its input on the GPU, as plain checkpointing
does; use_gradient_checkpointing="auto" gives it to the layers the host cannot take.

What the modules inside the re-run see of it (``recomputing()``, ``keep`` and ``kept``,
``unread_sum``) is in ``recomputation``; the host copies of one layer's saved tensors in
``offloaded_activation``; which checkpointer each decoder layer gets in ``checkpointing``.
"""

from __future__ import annotations

import functools
import warnings
import weakref

import torch

from slothkit.engine.checkpointing.layer_call import LayerCall
from slothkit.engine.checkpointing.offloaded_activation import _OffloadedActivation
from slothkit.engine.checkpointing.recomputation import _collecting, _output_may_be_read, _recomputation
from slothkit.engine.layer_graphs import LayerGraphs
from slothkit.memory.sizes import SHORT_STEP_TOKENS, pinned_bytes


class _Checkpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, checkpointer, call, hidden_states, *reads):
        run_function = call.run_function
        ctx.call = call
        ctx.marks_recompute = checkpointer.marks_recompute
        ctx.set_materialize_grads(False)  # a written tensor nobody read has no gradient
        ctx.autocast = _autocast_state(hidden_states.device.type)
        ctx.cpu_rng = torch.get_rng_state()
        ctx.cuda_rng = torch.cuda.get_rng_state(hidden_states.device) if hidden_states.is_cuda else None
        # Kept tensors are for a marked re-run only.
        collector = (
            {} if checkpointer.keeps_for(hidden_states) and not _output_may_be_read(run_function) else None
        )
        output = None
        # The layer graphs replay a layer whose gradient is its input's alone.
        ctx.graphs = checkpointer.graphs if call.plain else None
        if ctx.graphs is not None:
            output = ctx.graphs.forward(
                run_function, hidden_states, call.args, ctx.autocast, collector, _collecting
            )
        if output is None:
            with torch.no_grad(), _collecting(collector):
                output = call.run(hidden_states)
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
        if not call.written:
            return output
        call.output_is_tensor = isinstance(output, torch.Tensor)
        outputs = (output,) if call.output_is_tensor else tuple(output)
        return (*outputs, *call.written)

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
        call = ctx.call
        marked = ctx.marks_recompute and not _output_may_be_read(call.run_function)
        if ctx.graphs is not None and len(grad_outputs) == 1:
            grad_input = ctx.graphs.backward(
                call.run_function,
                saved,
                call.args,
                ctx.autocast,
                grad_outputs[0],
                lambda kept: _recomputation(marked, kept),
                ctx.kept_names if marked else None,
                before_replay=prefetch,
            )
            if grad_input is not None:
                return None, None, grad_input if ctx.input_requires_grad else None
        if prefetch is not None:
            prefetch()  # a second call does nothing
        hidden_states, *kept_values = saved
        del saved
        kept_tensors = dict(zip(ctx.kept_names, kept_values))
        hidden_states = hidden_states.detach().requires_grad_(ctx.input_requires_grad)
        reads = [tensor.detach().requires_grad_(True) for tensor in call.reads]
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
                outputs, written = call.rerun(hidden_states, reads)
        if isinstance(outputs, torch.Tensor):
            outputs = (outputs,)
        # The output's gradients come first, then the written tensors' (forward's order).
        pairs = [
            (out, grad)
            for out, grad in zip((*outputs, *written), grad_outputs)
            if isinstance(out, torch.Tensor) and out.requires_grad and grad is not None
        ]
        if pairs:
            torch.autograd.backward([p[0] for p in pairs], [p[1] for p in pairs])
        grad_input = hidden_states.grad if ctx.input_requires_grad else None
        return None, None, grad_input, *(read.grad for read in reads)


def _checkpointed(checkpointer, run_function, hidden_states, args):
    """``run_function(hidden_states, *args)`` through ``_Checkpoint``, with the tensors the
    layer reads with grad as its inputs and those it writes into its mappings as its
    outputs, handed over to the mappings (``layer_call``)."""
    call = LayerCall(run_function, args)
    result = _Checkpoint.apply(checkpointer, call, hidden_states, *call.reads)
    if not call.written:
        call.hand_over(())
        return result
    outputs = result[: len(result) - len(call.written)]
    call.hand_over(result[len(outputs) :])
    return outputs[0] if call.output_is_tensor else outputs


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

    def __getstate__(self) -> dict:
        """A copy of the model (copy.deepcopy: TRL's reference models, a test's merged
        copy; or a pickle) gets a checkpointer with no streams and no activation in
        flight: a CUDA stream neither copies nor pickles, and the copy makes its own at
        its first offload."""
        return {**self.__dict__, "_streams": {}, "_last": None, "pinned_bytes": 0}

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
        return _checkpointed(self, run_function, hidden_states, args)


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
        return _checkpointed(self, run_function, hidden_states, args)


def offload_checkpoint(run_function, hidden_states, *args):
    """Functional form for a single call (no cross-layer prefetch)."""
    return OffloadedCheckpointer()(run_function, hidden_states, *args)
