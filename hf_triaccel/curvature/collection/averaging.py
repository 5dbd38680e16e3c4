"""One optimizer step's sums, gathered over its micro-batches and the data-parallel
processes, finished and folded (:func:`fold_step`).

Each layer's activation sums wait in slots, one per confirmed micro-batch; they are
merged into the first slot, while the gradient sums already add up in ``g_stat``. When
``torch.distributed`` runs more than one process (DDP, FSDP2), every ready layer's sums
and counts on one device are added over the processes in one all-reduce. The sums are
then those of the global batch, and the finish (:mod:`~hf_triaccel.curvature.rules.finish`)
makes from them the statistics one process would take from the global batch whole.

Under data parallelism each process's loss is a mean over its own share of the batch, so
its output gradients are ``world_size`` times those of the global-batch loss: gradient
statistics, quadratic in the gradient (a mean of squares, a square of a sum), are divided
by ``world_size**2``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from hf_triaccel.curvature.collection.fold import FactorFold
from hf_triaccel.curvature.collection.graphs import Replay
from hf_triaccel.curvature.collection.layer import LayerFactors
from hf_triaccel.curvature.rules.finish import FinishPlan

# Sets of ready layers whose folds are kept: all layers, usually; a model whose layers
# take turns (a mixture of experts) must not pile up folds.
_MAX_FOLD_SETS = 8


class DevicePlan(NamedTuple):
    """One device's part of a refresh: its ready layers, the finish of their statistics
    and the fold of those into the factors, worked out once for a set of ready layers;
    ``replay`` runs the two together (:meth:`finish_and_fold`)."""

    layers: list[LayerFactors]
    finish: FinishPlan
    fold: FactorFold
    replay: Replay

    def counts(self) -> tuple[float, ...]:
        """This process's counts, ``a_n`` and ``g_n`` per layer in order, as the finish
        reads them."""
        return tuple(c for ly in self.layers for c in (ly.a_n, ly.g_n))

    def finish_and_fold(
        self, mode: str, gamma: float, normalise: str, counts: tuple[float, ...] | None = None
    ) -> None:
        """Finishes the layers' merged sums of one process and folds them, replayed as
        a CUDA graph where the same counts and fold repeat
        (:mod:`~hf_triaccel.curvature.collection.graphs`); ``counts`` as :meth:`counts` gives them
        (read from the layers when ``None``)."""
        if counts is None:
            counts = self.counts()

        def run() -> None:
            self.finish(counts)
            self.fold(mode, gamma, normalise)

        self.replay((counts, mode, gamma, normalise), run)


def device_plan(layers: list[LayerFactors], impl: str | None) -> DevicePlan:
    """The :class:`DevicePlan` of ``layers``, all on one device; the finish reads the
    counts in the order :func:`sum_over_processes` returns them."""
    items = []
    for ly in layers:
        items += [(ly.a_finish, ly.slots[0], ly.a_stat), (ly.g_finish, ly.g_stat, ly.g_stat)]
    emas = [t for ly in layers for t in (ly.a_ema, ly.g_ema)]
    news = [t for ly in layers for t in (ly.a_stat, ly.g_stat)]
    useds = [t for ly in layers for t in (ly.a, ly.g)]
    fold = FactorFold(emas, news, useds, impl=impl)
    return DevicePlan(layers, FinishPlan(items), fold, Replay(emas[0].device))


class FoldPlans:
    """The :class:`DevicePlan` objects of each set of ready layers (usually all of them),
    made on first use and kept until a tensor moves (``generation`` changes).

    Example:
        >>> from hf_triaccel.curvature.collector import FisherCollector
        >>> layers = list(FisherCollector(torch.nn.Linear(3, 2)).layers.values())
        >>> plans = FoldPlans(impl=None)
        >>> plans(layers, 0) is plans(layers, 0), plans(layers, 0) is plans(layers, 1)
        (True, False)
    """

    def __init__(self, impl: str | None) -> None:
        self.impl = impl
        self.generation = 0
        self.plans: dict[tuple[str, ...], list[DevicePlan]] = {}

    def __call__(self, ready: list[LayerFactors], generation: int) -> list[DevicePlan]:
        if generation != self.generation:
            self.generation, self.plans = generation, {}
        key = tuple(ly.name for ly in ready)
        plans = self.plans.get(key)
        if plans is None:
            by_device: dict[torch.device, list[LayerFactors]] = {}
            for ly in ready:
                by_device.setdefault(ly.a_ema.device, []).append(ly)
            if len(self.plans) >= _MAX_FOLD_SETS:
                del self.plans[next(iter(self.plans))]
            plans = [device_plan(layers, self.impl) for layers in by_device.values()]
            self.plans[key] = plans
        return plans


def fold_step(
    ready: list[LayerFactors],
    plans: list[DevicePlan],
    mode: str,
    gamma: float,
    normalise: str,
    loss_scale: torch.Tensor | None = None,
) -> None:
    """Turns the ``ready`` layers' sums into the step's statistics (``a_stat``, ``g_stat``):
    merged over micro-batches, added over processes, finished, the gradient statistics
    divided by ``world_size**2`` and by the square of a GradScaler's ``loss_scale``; then
    folds them into the factors (EMA rule ``mode``, decay ``gamma``, ``normalise``). In one
    process without a loss scale nothing comes between the finish and the fold, and each
    device runs them together (:meth:`DevicePlan.finish_and_fold`).

    Every process must call it with the same layers, in the same order.
    """
    merge_slots(ready)
    world = world_size()
    if world == 1 and loss_scale is None:
        for plan in plans:
            plan.finish_and_fold(mode, gamma, normalise)
        return
    for plan in plans:
        if world > 1:
            plan.finish(sum_over_processes(plan.layers))
        else:
            plan.finish(plan.counts())
    g_scale: torch.Tensor | float = float(world) ** 2
    if loss_scale is not None:
        g_scale = g_scale * loss_scale.double().square().float()
    if not isinstance(g_scale, float) or g_scale != 1.0:
        torch._foreach_div_([ly.g_stat for ly in ready], g_scale)
    for plan in plans:
        plan.fold(mode, gamma, normalise)


def world_size() -> int:
    """The number of processes ``torch.distributed`` runs (1 when it runs none)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


def merge_slots(ready: list[LayerFactors]) -> None:
    """Gathers each layer's confirmed activation sums into slot 0: in place when the first
    micro-batch used it, by a copy otherwise, then one batched addition per further
    micro-batch."""
    copies: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
    adds: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []
    for ly in ready:
        order = list(ly.confirmed)
        if order == [0]:
            continue
        if 0 in order:
            order.remove(0)
        else:
            copies[0].append(ly.slots[0])
            copies[1].append(ly.slots[order.pop(0)])
        for k, slot in enumerate(order):
            if k == len(adds):
                adds.append(([], []))
            adds[k][0].append(ly.slots[0])
            adds[k][1].append(ly.slots[slot])
    if copies[0]:
        torch._foreach_copy_(*copies)
    for dst, src in adds:
        torch._foreach_add_(dst, src)


def sum_over_processes(layers: list[LayerFactors]) -> torch.Tensor:
    """Adds the merged sums and the counts of ``layers`` (all on one device) over the
    processes, in one all-reduce; returns the counts, ``a_n`` and ``g_n`` per layer in
    order, as a float32 vector on that device (no host sync).

    Every process must call it with the same layers, in the same order.
    """
    device = layers[0].a_stat.device
    counts = torch.tensor([c for ly in layers for c in (ly.a_n, ly.g_n)], dtype=torch.float32)
    if device.type == "cuda":  # a pinned source keeps the copy asynchronous
        counts = counts.pin_memory()
    counts = counts.to(device, non_blocking=True)
    all_reduce_sum([t for ly in layers for t in (ly.slots[0], ly.g_stat)] + [counts])
    return counts


def all_reduce_sum(tensors: list[torch.Tensor]) -> None:
    """Sums ``tensors`` (on one device) over processes in place, in one bucketed call."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    torch._foreach_copy_(tensors, list(flat.split([t.numel() for t in tensors])))
