"""A refresh's finish and fold, replayed as one CUDA graph.

A refresh ends with the finish of every layer's statistics and their fold into the
factors (:class:`~hf_triaccel.curvature.rules.finish.FinishPlan`,
:class:`~hf_triaccel.curvature.collection.fold.FactorFold`): a dozen batched operations over every
layer, whose launches cost more host time than their device work. They read and write
tensors that stay where they are, and their arguments (the step's counts, the decay and
the rules) rarely change, so on CUDA, once the same finish and fold has run eagerly on
two refreshes in a row, it is captured as a CUDA graph and later refreshes with the same
arguments replay it: one launch. Capturing runs nothing, so the refresh that captures
has already run eagerly.

Nothing is captured while another capture runs (a graph of the whole training step),
while ``torch.compile`` traces, or off CUDA.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch

# graphs kept per plan: the usual step and, say, an epoch's last, smaller batch
_MAX_GRAPHS = 2


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
    (and on tensors that stay where they are). When ``key`` is the one of the previous
    call and the device allows it, the work is captured after it ran; later calls with
    that key replay the graph instead of calling ``run``.

    Example:
        >>> replay = Replay(torch.device("cpu"))
        >>> out = torch.zeros(1)
        >>> for _ in range(3):
        ...     replay("add one", lambda: out.add_(1.0))
        >>> out  # off CUDA: run eagerly each time
        tensor([3.])
    """

    __slots__ = ("device", "graphs", "previous")

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.graphs: dict[Hashable, torch.cuda.CUDAGraph] = {}
        self.previous: Hashable = None

    def __call__(self, key: Hashable, run: Callable[[], object]) -> None:
        graph = self.graphs.get(key)
        if graph is not None and capturable(self.device):
            with torch.cuda.device(self.device):  # on the stream of the graph's device
                graph.replay()
            return
        run()
        if key == self.previous and capturable(self.device):
            if len(self.graphs) >= _MAX_GRAPHS:
                del self.graphs[next(iter(self.graphs))]
            graph = torch.cuda.CUDAGraph()
            # thread_local: a data loader's thread may use CUDA meanwhile
            capture = torch.cuda.graph(graph, capture_error_mode="thread_local")
            with torch.cuda.device(self.device), capture:
                run()
            self.graphs[key] = graph
        self.previous = key
