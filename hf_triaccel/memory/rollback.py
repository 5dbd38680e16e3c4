"""State that a forward pass changes besides gradients, restored when the pass is repeated.

Two places run a forward twice over the same samples: the elastic controller re-runs a
step after an out-of-memory error, and activation checkpointing recomputes a block's
forward in the backward. BatchNorm layers update their running statistics in every
training forward, so both restore them with :class:`RunningStatsRollback`: each sample
updates them once, as in a run that neither failed nor recomputed.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase


class StepRollback(Protocol):
    """State that a step changes besides gradients, restored before a re-run.

    :meth:`save` is called before the first piece of every step, :meth:`restore`
    before each re-run of the step after an out-of-memory error.
    """

    def save(self) -> None: ...

    def restore(self) -> None: ...


def tracks_running_stats(module: nn.Module) -> bool:
    """Whether ``module`` is a BatchNorm-style layer that updates running statistics.

    Example:
        >>> tracks_running_stats(nn.BatchNorm2d(4)), tracks_running_stats(nn.LayerNorm(4))
        (True, False)
    """
    return isinstance(module, _NormBase) and module.track_running_stats


class RunningStatsRollback:
    """Saves and restores the running statistics of every BatchNorm layer in ``model``.

    A :class:`StepRollback`, and a context manager that saves on entry and restores on
    exit (the recompute context of activation checkpointing). The saved copies are
    allocated once and refilled in one ``_foreach_copy_``.

    Example:
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
        >>> rollback = RunningStatsRollback(model)
        >>> rollback.save(); _ = model(torch.randn(8, 4)); rollback.restore()
        >>> model[1].num_batches_tracked.item()
        0
        >>> with rollback:
        ...     _ = model(torch.randn(8, 4))
        >>> model[1].num_batches_tracked.item()
        0
    """

    def __init__(self, model: nn.Module) -> None:
        self._norms = [m for m in model.modules() if tracks_running_stats(m)]
        self._saved: list[torch.Tensor] = []

    def _buffers(self) -> list[torch.Tensor]:
        # read at each call: model.to() replaces buffer tensors
        return [
            b
            for m in self._norms
            for b in (m.running_mean, m.running_var, m.num_batches_tracked)
            if b is not None
        ]

    def save(self) -> None:
        buffers = self._buffers()
        if not buffers:
            return
        if [(s.shape, s.dtype, s.device) for s in self._saved] != [
            (b.shape, b.dtype, b.device) for b in buffers
        ]:
            self._saved = [torch.empty_like(b) for b in buffers]
        with torch.no_grad():
            torch._foreach_copy_(self._saved, buffers)

    def restore(self) -> None:
        buffers = self._buffers()
        if buffers and self._saved:
            with torch.no_grad():
                torch._foreach_copy_(buffers, self._saved)

    def __enter__(self) -> None:
        self.save()

    def __exit__(self, *exc: object) -> None:
        self.restore()
