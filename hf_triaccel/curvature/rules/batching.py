"""Statistics launched together: the reductions a refresh step's hooks queue.

On a step whose pace the host sets, every statistic launched on its own costs its launch's
host time. While a :class:`StatisticsBatch` is active (:func:`activate`), the built-in
rules' row sums are queued instead of launched (:func:`queue_or_launch`), with what must
follow them (a convolution's tap gather: :func:`gather_or_mm`, or any step: :func:`then`);
:meth:`StatisticsBatch.flush` launches every queued reduction of one input dtype and block
shape as one kernel (``hf_triaccel.kernels.grouped.launch_grouped``), then the gathers
(``launch_gathers``), then what follows, in order.

A collector keeps three of them
(:class:`~hf_triaccel.curvature.collection.hooks.RefreshBatches`), which say when each
is flushed.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import torch

# The batch the running hook queues into, per thread: the autograd engine may run the
# hooks of two devices' backwards at once.
_ACTIVE = threading.local()


class StatisticsBatch:
    """Reductions queued to be launched together, and what runs after them.

    Example:
        >>> batch = StatisticsBatch()
        >>> out = torch.zeros(1)
        >>> previous = activate(batch)
        >>> then(out.add_, 1.0)  # queued: runs at the flush
        >>> activate(previous) is batch
        True
        >>> out, len(batch)
        (tensor([0.]), 1)
        >>> batch.flush(); out
        tensor([1.])
    """

    __slots__ = ("entries", "gathers", "after", "outs", "nbytes", "budget")

    def __init__(self, budget: float = float("inf")) -> None:
        self.budget = budget  # bytes of inputs held; past it they are launched
        self.entries: list[tuple] = []
        self.gathers: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.after: list[tuple[Callable[..., Any], tuple]] = []
        self.outs: set[int] = set()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self.entries) + len(self.gathers) + len(self.after)

    def add(
        self, launch: Any, x: torch.Tensor, out: torch.Tensor, scale: float, accumulate: bool
    ) -> None:
        """Queues ``launch(x, out, scale, accumulate)``, or launches it now when no grouped
        kernel takes it or ``x`` alone is over the budget. A second reduction into the same
        output flushes the first."""
        size = x.nbytes
        key = None if size > self.budget and not self.entries else _grouped().group_key(launch, x)
        if key is None:
            launch(x, out, scale, accumulate)
            return
        ptr = out.data_ptr()
        if ptr in self.outs:
            self.flush()
        self.outs.add(ptr)
        self.entries.append((launch, x, out, scale, accumulate, key))
        self.nbytes += size

    def gather(self, sums: torch.Tensor, taps: torch.Tensor, out: torch.Tensor) -> None:
        """Queues ``torch.mm(sums, taps, out=out)`` (a convolution's tap gather), launched
        with the others after the reductions."""
        self.gathers.append((sums, taps, out))

    def then(self, fn: Callable[..., Any], args: tuple) -> None:
        """Runs ``fn(*args)`` at the flush, after the queued reductions."""
        self.after.append((fn, args))

    def flush(self) -> None:
        """Launches the queued reductions, grouped, then the gathers, then what follows."""
        entries, gathers, after = self.entries, self.gathers, self.after
        if not (entries or gathers or after):
            return
        self.clear()
        if entries:
            launch_grouped = _grouped().launch_grouped
            groups: dict[tuple, list[tuple]] = {}
            for entry in entries:
                groups.setdefault(entry[5], []).append(entry[:5])
            for key, group in groups.items():
                if len(group) == 1:  # its own launch needs no tables
                    launch, *args = group[0]
                    launch(*args)
                else:
                    launch_grouped(key, group)
        if gathers:
            grouped = _grouped()
            by_width: dict[int, list[tuple]] = {}
            for entry in gathers:
                by_width.setdefault(grouped.gather_key(entry[1]), []).append(entry)
            for width, group in by_width.items():
                grouped.launch_gathers(width, group)
        for fn, args in after:
            fn(*args)

    def clear(self) -> None:
        """Forgets what is queued."""
        self.entries, self.gathers, self.after, self.outs, self.nbytes = [], [], [], set(), 0


@functools.cache
def _grouped() -> Any:
    """The grouped kernels' module, imported when the first row sum is queued (only
    Triton launches are)."""
    from hf_triaccel.kernels import grouped

    return grouped


def activate(batch: StatisticsBatch | None) -> StatisticsBatch | None:
    """Makes ``batch`` the one the statistics queue into (``None``: launch at once);
    returns the one active before, to restore."""
    previous = getattr(_ACTIVE, "batch", None)
    _ACTIVE.batch = batch
    return previous


def queue_or_launch(
    launch: Any, x: torch.Tensor, out: torch.Tensor, scale: float = 1.0, accumulate: bool = False
) -> None:
    """``launch(x, out, scale, accumulate)``, queued in the active batch if there is one."""
    batch = getattr(_ACTIVE, "batch", None)
    if batch is None:
        launch(x, out, scale, accumulate)
    else:
        batch.add(launch, x, out, scale, accumulate)


def gather_or_mm(sums: torch.Tensor, taps: torch.Tensor, out: torch.Tensor) -> None:
    """``torch.mm(sums, taps, out=out)``, queued in the active batch if there is one (for
    statistics that Triton takes: the batch launches it with Triton)."""
    batch = getattr(_ACTIVE, "batch", None)
    if batch is None:
        torch.mm(sums, taps, out=out)
    else:
        batch.gather(sums, taps, out)


def then(fn: Callable[..., Any], *args: Any) -> None:
    """``fn(*args)`` after the active batch's reductions (now, without one): the step of a
    statistic that reads what a queued reduction writes."""
    batch = getattr(_ACTIVE, "batch", None)
    if batch is None:
        fn(*args)
    else:
        batch.then(fn, args)
