"""One checkpointed layer's saved tensors on their way to pinned host memory and back:
copied out on a side stream during forward, copied back one layer ahead during backward
(``offload_checkpoint``).
"""

from __future__ import annotations

import torch

from slothkit.engine.checkpointing.pinned_pieces import PinnedPieces


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
