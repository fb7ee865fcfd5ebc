"""LayerGraphs with its CUDA calls replaced, to check its plumbing on a CPU: the static
buffers, the arguments copied in, the gradients copied out and added to ``.grad`` (and,
under a process group, all-reduced by DDP).  A "capture" records the graph's body and
runs nothing; a "replay" runs the body again.

    checkpointer.graphs = GraphsOnCPU(phases=("forward", "backward"))
"""

from __future__ import annotations

from slothkit.engine.layer_graphs import LayerGraphs


class RecordedBody:
    """A stand-in for a CUDA graph: replay runs the captured body again."""

    def __init__(self, log: list):
        self.body, self.log = None, log

    def replay(self) -> None:
        self.log.append("replay")
        self.body()


class GraphsOnCPU(LayerGraphs):
    """LayerGraphs whose graphs are ``RecordedBody``s; ``log`` lists each capture, replay
    and release of the allocator's cache, in order.

    Args:
        **kwargs: as ``LayerGraphs``.
    """

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.log = []

    def _device_ok(self, hidden):
        return True

    def _new_graph(self):
        return RecordedBody(self.log)

    def _sync(self):
        pass

    def _release_cached(self):
        self.log.append("release")

    def _record(self, graph, body):
        self.log.append("capture")
        graph.body = body  # a capture runs nothing; the replay that follows does
