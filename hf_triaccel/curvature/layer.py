"""The factors of one hooked module and the statistics it gathers between two folds.

The activation statistic of a forward waits in a *slot* until the gradient of that
forward's output arrives (a forward that no backward follows must leave no trace); the
first slot is the layer's ``a_sum`` itself, so with one micro-batch per optimizer step
nothing is copied. :class:`~hf_triaccel.curvature.collector.FisherCollector` owns the
layers and their hooks.

A layer copies and pickles with its factors and the statistics gathered so far; what
belongs to live forwards (their pending records, the owners of the slots) and the rule's
cached plans (views of the old storage) are left out and rebuilt.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from hf_triaccel._types import FactorLayout
from hf_triaccel.curvature.rules import FisherRule


class PendingStatistic:
    """One forward's activation statistic, from the forward until its gradient arrives.

    The layer keeps only a weak reference: once the autograd graph that would have
    delivered the gradient is gone, so is this record, and its slot is free again.
    """

    __slots__ = ("slot", "last", "__weakref__")

    def __init__(self, slot: int, last: float | None) -> None:
        self.slot = slot
        self.last = last  # the value of a's last entry, left to the fold (None: none)


@dataclass
class LayerFactors:
    """Factors of one module.

    ``a`` and ``g`` are what the preconditioner reads; ``a_ema`` / ``g_ema`` the
    running averages (the same tensors in ``ema="reference"`` mode). ``a_sum`` /
    ``g_sum`` are where the statistics of the current optimizer step are gathered over
    its micro-batches; complete only inside the collector's fold (read
    :meth:`accumulated` in between). ``a_count`` / ``g_count`` count the micro-batches.
    ``output_module`` is where the output gradient is taken (the module itself, or a
    submodule before a fused activation); ``pending_a`` holds the records of forwards
    whose output hook has not run yet.

    Example:
        >>> from hf_triaccel.curvature.collector import FisherCollector
        >>> layer = FisherCollector(nn.Linear(3, 2)).layers[""]
        >>> layer.a.shape, layer.g.shape, list(layer.layouts)
        (torch.Size([4]), torch.Size([2]), ['weight', 'bias'])
    """

    name: str
    module: nn.Module
    rule: FisherRule
    layouts: dict[str, FactorLayout]
    a_ema: torch.Tensor
    g_ema: torch.Tensor
    a: torch.Tensor
    g: torch.Tensor
    a_sum: torch.Tensor
    g_sum: torch.Tensor
    output_module: nn.Module | None = None
    a_count: int = 0
    g_count: int = 0
    pending_a: list[PendingStatistic] = field(default_factory=list)
    handles: list[RemovableHandle] = field(default_factory=list)
    # Activation statistics of forwards: slot 0 is a_sum itself, more are allocated when
    # several forwards await their gradient, or several micro-batches are gathered.
    slots: list[torch.Tensor] = field(default_factory=list)
    owners: list[weakref.ref | None] = field(default_factory=list)
    confirmed: list[int] = field(default_factory=list)  # slots whose gradient arrived
    last_sum: float = 0.0  # sum over confirmed micro-batches of a's last entry
    has_last: bool = False  # the rule leaves a's last entry to the fold
    last_written: float | None = None  # the value a_sum's last entry holds now
    anchor: str = ""  # an owned parameter's name: where it is, the factors must be
    cache: dict[Any, Any] = field(default_factory=dict)  # the rule's per-shape plans

    @property
    def device(self) -> torch.device:
        return next(self.module.parameters()).device

    def tensors(self) -> list[torch.Tensor]:
        return [self.a_ema, self.g_ema, self.a, self.g, self.a_sum, self.g_sum]

    def follow(self, device: torch.device) -> bool:
        """Moves the layer's tensors to ``device`` (where its module now computes), in
        place so that every view and reference follows; returns whether they moved."""
        if self.a_sum.device == device:
            return False
        for t in {id(t): t for t in self.tensors() + self.slots[1:]}.values():
            t.data = t.data.to(device)
        self.cache.clear()  # cached views and scratch buffers belong to the old storage
        return True

    def take_activation(self, module: nn.Module, x: torch.Tensor, impl: str | None) -> None:
        """Writes the activation statistic of input ``x`` into a free slot, pending until
        the gradient of this forward's output confirms it."""
        slot = self.free_slot()
        last = self.rule.a_write(module, x, self.slots[slot], impl, self.cache)
        pending = PendingStatistic(slot, last)
        self.owners[slot] = weakref.ref(pending)
        self.pending_a.append(pending)

    def free_slot(self) -> int:
        """A slot that no confirmed statistic and no live forward holds."""
        for i, owner in enumerate(self.owners):
            if (owner is None or owner() is None) and i not in self.confirmed:
                return i
        self.slots.append(torch.zeros_like(self.a_sum))
        self.owners.append(None)
        return len(self.slots) - 1

    def confirm(self, pending: PendingStatistic) -> None:
        """Counts a forward whose output gradient arrived."""
        self.confirmed.append(pending.slot)
        if pending.last is not None:
            self.last_sum += pending.last
            self.has_last = True
        self.a_count += 1

    def accumulated(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Sums over the micro-batches since the last fold of the ``a`` and ``g``
        statistics (new tensors; zeros before any). For inspection: the fold does not
        need them materialised."""
        a = torch.zeros_like(self.a_sum)
        for i in self.confirmed:
            a += self.slots[i]
        if self.has_last:
            a[-1] = self.last_sum
        g = self.g_sum.clone() if self.g_count else torch.zeros_like(self.g_sum)
        return a, g

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.update(cache={}, pending_a=[], owners=[None] * len(self.slots))
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def reset(self) -> None:
        """Forgets the statistics gathered since the last fold (slots of forwards still
        waiting for their gradient stay reserved)."""
        self.a_count = self.g_count = 0
        self.confirmed.clear()
        self.last_sum = 0.0
        self.has_last = False
        self.pending_a.clear()
