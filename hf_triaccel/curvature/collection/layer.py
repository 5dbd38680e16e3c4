"""The factors of one hooked module and the statistics it gathers between two folds.

Statistics are gathered as sums over samples (see :mod:`~hf_triaccel.curvature.rules.finish`).
The activation sums of a forward wait in a *slot* until the gradient of that forward's
output arrives (a forward that no backward follows must leave no trace); for a rule whose
sums become the statistic in place, the first slot is the layer's ``a_stat`` itself, so
with one micro-batch per optimizer step nothing is copied. The gradient sums add up in
``g_stat``. :class:`~hf_triaccel.curvature.collector.FisherCollector` owns the layers and
their hooks.

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
from hf_triaccel.curvature.rules.finish import Finish, FinishPlan


class PendingStatistic:
    """One forward's activation sums, from the forward until its gradient arrives.

    The layer keeps only a weak reference: once the autograd graph that would have
    delivered the gradient is gone, so is this record, and its slot is free again. A
    record whose step was folded first has ``slot`` -1 (:meth:`LayerFactors.reset`).
    """

    __slots__ = ("slot", "count", "__weakref__")

    def __init__(self, slot: int, count: float) -> None:
        self.slot = slot
        self.count = count  # the samples (or rows) the sums ran over


@dataclass
class LayerFactors:
    """Factors of one module.

    ``a`` and ``g`` are what the preconditioner reads; ``a_ema`` / ``g_ema`` the
    running averages (the same tensors in ``ema="reference"`` mode). ``a_stat`` /
    ``g_stat`` hold the current optimizer step's statistics, finished inside the
    collector's fold from the sums gathered over its micro-batches (read
    :meth:`statistics` in between); ``a_finish`` / ``g_finish`` say how. ``a_count`` /
    ``g_count`` count the micro-batches, ``a_n`` / ``g_n`` the samples (or rows) their
    sums ran over. ``output_module`` is where the output gradient is taken (the module
    itself, or a submodule before a fused activation); ``pending_a`` holds the records of
    forwards whose output hook, when that is another module's, has not run yet.

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
    a_stat: torch.Tensor
    g_stat: torch.Tensor
    a_finish: Finish
    g_finish: Finish
    output_module: nn.Module | None = None
    a_count: int = 0
    g_count: int = 0
    a_n: float = 0.0
    g_n: float = 0.0
    pending_a: list[PendingStatistic] = field(default_factory=list)
    handles: list[RemovableHandle] = field(default_factory=list)
    # Activation sums of forwards: slot 0 is where they are merged (a_stat itself when the
    # finish is in place); more are allocated when several forwards await their gradient,
    # or several micro-batches are gathered.
    slots: list[torch.Tensor] = field(default_factory=list)
    owners: list[weakref.ref | None] = field(default_factory=list)
    confirmed: list[int] = field(default_factory=list)  # slots whose gradient arrived
    anchor: str = ""  # an owned parameter's name: where it is, the factors must be
    cache: dict[Any, Any] = field(default_factory=dict)  # the rule's per-shape plans

    @classmethod
    def create(
        cls,
        name: str,
        module: nn.Module,
        rule: FisherRule,
        layouts: dict[str, FactorLayout],
        paper: bool,
        zeros: bool,
    ) -> LayerFactors:
        """The factors of ``module`` for the parameters of ``layouts``, where its first
        one is, with the running factors of ``ema="paper"`` when ``paper``, seeded with
        zeros when ``zeros`` (else ones)."""
        anchor = next(iter(layouts))
        device = getattr(module, anchor).device
        a_len, g_len = rule.sizes(module)
        # In paper mode only the normalised EMA is ever read, and min-max normalisation
        # removes any constant, so the collector seeds it with zeros: the same result as
        # ones, without float32 cancellation when the statistics are tiny next to 1.
        seed = torch.zeros if zeros else torch.ones
        a_ema, g_ema = seed(a_len, device=device), seed(g_len, device=device)
        a_finish, g_finish = rule.a_finish(module), rule.g_finish(module)
        if not g_finish.in_place:
            raise ValueError(f"{type(rule).__name__}.g_finish must keep the sums' length")
        a_stat = torch.zeros(a_len, device=device)
        sums = a_stat
        if not a_finish.in_place:
            sums = torch.zeros(a_finish.sums_length(a_len), device=device)
        return cls(
            name=name,
            module=module,
            rule=rule,
            layouts=layouts,
            a_ema=a_ema,
            g_ema=g_ema,
            a=torch.ones_like(a_ema) if paper else a_ema,
            g=torch.ones_like(g_ema) if paper else g_ema,
            a_stat=a_stat,
            g_stat=torch.zeros(g_len, device=device),
            a_finish=a_finish,
            g_finish=g_finish,
            output_module=rule.output_module(module),
            slots=[sums],
            owners=[None],
            anchor=anchor,
        )

    @property
    def device(self) -> torch.device:
        return next(self.module.parameters()).device

    def tensors(self) -> list[torch.Tensor]:
        return [self.a_ema, self.g_ema, self.a, self.g, self.a_stat, self.g_stat]

    def follow(self, device: torch.device) -> bool:
        """Moves the layer's tensors to ``device`` (where its module now computes), in
        place so that every view and reference follows; returns whether they moved."""
        if self.a_stat.device == device:
            return False
        for t in {id(t): t for t in self.tensors() + self.slots}.values():
            t.data = t.data.to(device)
        self.cache.clear()  # cached views and scratch buffers belong to the old storage
        return True

    def take_activation(
        self, module: nn.Module, x: torch.Tensor, impl: str | None
    ) -> PendingStatistic:
        """Writes the activation sums of input ``x`` into a free slot, pending until the
        gradient of this forward's output confirms them (:meth:`confirm`). The layer
        keeps the returned record weakly: whoever waits for that gradient holds it."""
        slot = self.free_slot()
        count = self.rule.a_write(module, x, self.slots[slot], impl, self.cache)
        pending = PendingStatistic(slot, count)
        self.owners[slot] = weakref.ref(pending)
        return pending

    def free_slot(self) -> int:
        """A slot that no confirmed statistic and no live forward holds."""
        for i, owner in enumerate(self.owners):
            if (owner is None or owner() is None) and i not in self.confirmed:
                return i
        self.slots.append(torch.zeros_like(self.slots[0]))
        self.owners.append(None)
        return len(self.slots) - 1

    def confirm(self, pending: PendingStatistic) -> None:
        """Counts a forward whose output gradient arrived."""
        self.confirmed.append(pending.slot)
        self.a_count += 1
        self.a_n += pending.count

    def take_gradient(self, grad: torch.Tensor, impl: str | None) -> float:
        """Adds the gradient sums of one output gradient to ``g_stat``; returns what they
        ran over."""
        accumulate = self.g_count > 0
        count = self.rule.g_write(self.module, grad, self.g_stat, accumulate, impl, self.cache)
        self.g_n += count
        self.g_count += 1
        return count

    def statistics(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``a`` and ``g`` statistics of the micro-batches gathered since the last
        fold, finished as a fold in this process would finish them (new tensors; zeros
        before any). For inspection: the fold does not need them materialised.

        Example:
            >>> from hf_triaccel.curvature.collector import FisherCollector
            >>> lin = nn.Linear(1, 1, bias=False)
            >>> layer = FisherCollector(lin).layers[""]
            >>> for x in ([[1.0]], [[2.0], [3.0]]):  # two micro-batches: 1 and 2 samples
            ...     lin(torch.tensor(x)).sum().backward()
            >>> layer.statistics()  # a = (1 + 4 + 9) / 3, g = 1
            (tensor([4.6667]), tensor([1.]))
        """
        sums = torch.zeros_like(self.slots[0])
        for i in self.confirmed:
            sums += self.slots[i]
        g = self.g_stat.clone() if self.g_count else torch.zeros_like(self.g_stat)
        a = sums if self.a_finish.in_place else torch.zeros_like(self.a_stat)
        if not self.a_count:
            return a, g
        FinishPlan([(self.a_finish, sums, a), (self.g_finish, g, g)])([self.a_n, self.g_n])
        return a, g

    def factor_state(self) -> dict[str, torch.Tensor]:
        """Copies of the running factors (``a``, ``g``) and of those the preconditioner
        reads (``a_used``, ``g_used``)."""
        return {
            "a": self.a_ema.clone(),
            "g": self.g_ema.clone(),
            "a_used": self.a.clone(),
            "g_used": self.g.clone(),
        }

    def load_factor_state(self, state: dict[str, torch.Tensor]) -> None:
        """Copies :meth:`factor_state`'s tensors into the factors."""
        for key, dst in (
            ("a", self.a_ema),
            ("g", self.g_ema),
            ("a_used", self.a),
            ("g_used", self.g),
        ):
            src = state[key]
            if src.shape != dst.shape:
                raise ValueError(
                    f"factor {key!r} of layer {self.name!r} has shape {tuple(src.shape)}, "
                    f"expected {tuple(dst.shape)}"
                )
            dst.copy_(src)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.update(cache={}, pending_a=[], owners=[None] * len(self.slots))
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def reset(self) -> None:
        """Forgets the statistics gathered since the last fold. A forward still waiting
        for its gradient is forgotten too: a statistic counts in the step (from one fold
        to the next) that saw both its forward and its gradient, so every slot is free
        again."""
        self.a_count = self.g_count = 0
        self.a_n = self.g_n = 0.0
        self.confirmed.clear()
        self.pending_a.clear()
        if any(self.owners):
            for i, owner in enumerate(self.owners):
                pending = None if owner is None else owner()
                if pending is not None:
                    pending.slot = -1  # its gradient, if it still comes, is not taken
                self.owners[i] = None
