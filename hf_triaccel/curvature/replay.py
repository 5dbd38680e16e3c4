"""A refresh's fixed pieces of device work, replayed as CUDA graphs.

A refresh ends with the finish of every layer's statistics and their fold into the
factors (:class:`~hf_triaccel.curvature.finish.FinishPlan`,
:class:`~hf_triaccel.curvature.fold.FactorFold`): a dozen batched operations over every
layer, whose launches cost more host time than their device work. They read and write
tensors that stay where they are, and their arguments (the step's counts, the decay and
the rules) rarely change, so on CUDA, once the same finish and fold has run eagerly on
two refreshes in a row, it is captured as a CUDA graph and later refreshes with the same
arguments replay it: one launch. Capturing runs nothing, so the refresh that captures
has already run eagerly. The statistics' launches in the backward replay the same way
(:mod:`~hf_triaccel.curvature.batching`).

A capture neither synchronises the device nor empties PyTorch's cache of device memory
(as ``torch.cuda.graph`` does): it comes in the middle of a training step, where either
would cost the step, and emptying the cache would move the next step's tensors, whose
addresses some of the graphs are keyed on.

Nothing is captured while another capture runs (a graph of the whole training step),
while ``torch.compile`` traces, or off CUDA.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch

# Keys remembered, and graphs kept, per replay: the usual step and, say, an epoch's last,
# smaller batch; or the few sets of addresses that the caching allocator gives a step's
# tensors in turn. A key seen among the last RECENT is captured; keys that never come
# back are never captured.
_MAX_GRAPHS = _RECENT = 4


def capturable(device: torch.device) -> bool:
    """Whether work on ``device`` may be captured as a CUDA graph now.

    Example:
        >>> capturable(torch.device("cpu"))
        False
    """
    if device.type != "cuda" or torch.compiler.is_compiling():
        return False
    return not torch.cuda.is_current_stream_capturing()


class Replay:
    """Runs a fixed piece of device work, eagerly or as a CUDA graph it captured.

    ``replay(key, run)`` runs ``run()``, whose device work may depend on ``key`` only
    (and on tensors that stay where they are). When ``key`` is one of the last few
    calls' and the device allows it, the work is captured after it ran; later calls with
    that key replay the graph instead of calling ``run``.

    Example:
        >>> replay = Replay(torch.device("cpu"))
        >>> out = torch.zeros(1)
        >>> for _ in range(3):
        ...     replay("add one", lambda: out.add_(1.0))
        >>> out  # off CUDA: run eagerly each time
        tensor([3.])
    """

    __slots__ = ("device", "graphs", "recent", "stream")

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.graphs: dict[Hashable, torch.cuda.CUDAGraph] = {}
        self.recent: tuple[Hashable, ...] = ()  # the last calls' keys, newest last
        self.stream: torch.cuda.Stream | None = None  # where captures run (not the default)

    def __call__(self, key: Hashable, run: Callable[[], object]) -> None:
        graph = self.graphs.get(key)
        if graph is not None and capturable(self.device):
            with torch.cuda.device(self.device):  # on the stream of the graph's device
                graph.replay()
            return
        run()
        if key in self.recent and capturable(self.device):
            if len(self.graphs) >= _MAX_GRAPHS:
                del self.graphs[next(iter(self.graphs))]
            self.graphs[key] = self._capture(run)
        self.recent = (*self.recent[1 - _RECENT :], key)

    def _capture(self, run: Callable[[], object]) -> torch.cuda.CUDAGraph:
        """``run``'s device work as a graph (recorded on a stream of its own, not run)."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.device(self.device):
            if self.stream is None:
                self.stream = torch.cuda.Stream()
            with torch.cuda.stream(self.stream):
                # thread_local: a data loader's thread may use CUDA meanwhile
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    run()
                finally:
                    graph.capture_end()
        return graph
