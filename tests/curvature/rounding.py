"""How far two float32 computations of the same Fisher statistics and factors may differ:
bounds derived from the arithmetic, for comparing a whole batch with its micro-batches,
or one process with several.

**A statistic.** Every entry of a statistic is a float32 computation from at most ``N``
input elements (``N`` the elements of the layer's input, or of its output gradient): a
sum of squares, a square of a sum, a sum of squared sums, each scaled once or twice. In
whatever order its terms are added, a sum of ``m`` terms is within ``m * u * S`` of the
exact sum, ``S`` the sum of the terms' magnitudes and ``u = 2**-24`` float32's unit
roundoff (the bound for recursive summation, which covers any order of pairwise or
blocked sums). Squaring a sum doubles its relative error and adds one rounding; the
scalings add one each. So the computed entry is within ``(2 N + 8) u M`` of the exact
one, where ``M`` is the same statistic taken from the magnitudes ``|x|``, ``|dy|``: for a
sum of squares the statistic itself, for a square of a sum ``(sum |dy|)^2 / n``, an
upper bound of the terms' magnitudes. Two computations differ by at most twice that
(:func:`statistic_bounds`).

**A fold.** min-max normalisation ``(X - lo) / (hi - lo + eps)`` moves by at most
``4 D / (R - 2 D)`` when every entry of ``X`` moves by at most ``D`` and ``R = hi - lo +
eps`` (numerator and denominator each move by at most ``2 D``), plus its own few roundings;
the EMA rules carry the errors of earlier folds forward, scaled by their decay
(:class:`FactorBound`).
"""

from __future__ import annotations

import torch
from torch import nn

from hf_triaccel.curvature.rules import FisherRule, a_statistic, g_statistic

EPS32 = 2.0**-24
GAMMA = 0.8  # AdaFisherConfig's default


def statistic_bounds(
    rule: FisherRule, module: nn.Module, x: torch.Tensor, dy: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per entry, how far two float32 computations of ``module``'s ``a`` (from its input
    ``x``) and ``g`` (from its output gradient ``dy``) may differ, over one batch."""
    magnitude_x = x if not x.is_floating_point() else x.abs()  # indices: counts, exact
    a_m = a_statistic(rule, module, magnitude_x).double().abs()
    g_m = g_statistic(rule, module, dy.abs()).double().abs()
    return 2 * (2 * x.numel() + 8) * EPS32 * a_m, 2 * (2 * dy.numel() + 8) * EPS32 * g_m


def normalised_error(stat: torch.Tensor, delta: float) -> float:
    """How far min-max normalisation of ``stat`` may move when each entry moves by at most
    ``delta`` (1 when the range does not exceed the moves: normalised entries lie in
    [0, 1])."""
    stat = stat.double()
    span = float(stat.max() - stat.min()) + 1e-6
    if span <= 2 * delta:
        return 1.0
    return 4 * delta / (span - 2 * delta) + 8 * EPS32


class FactorBound:
    """The bound, fold after fold, on how far one factor (``a`` or ``g`` of one layer) of two
    runs may differ, given each fold's statistic and its bound."""

    def __init__(self, ema: str, gamma: float = GAMMA) -> None:
        self.ema, self.gamma = ema, gamma
        self.error = 0.0  # reference: of the factor; paper: of the running EMA

    def fold(self, stat: torch.Tensor, delta: float, ema: torch.Tensor) -> float:
        """The bound after a fold of ``stat`` (off by at most ``delta`` per entry), given the
        running factor ``ema`` after it; returns the bound on the factor the update reads."""
        rounding = 4 * EPS32 * float(ema.abs().max())
        if self.ema == "reference":  # cur <- 0.1 gamma cur + 0.01 gamma normalise(X)
            step = normalised_error(stat, delta)
            self.error = 0.1 * self.gamma * self.error + 0.01 * self.gamma * step + rounding
            return self.error
        # cur <- gamma cur + (1 - gamma) X; the update reads normalise(cur)
        self.error = self.gamma * self.error + (1 - self.gamma) * delta + rounding
        return normalised_error(ema, self.error)


class Recorder:
    """The inputs and output gradients every layer of a collector sees while it records,
    and from them the bounds of :func:`statistic_bounds` over everything recorded.

    Example:
        >>> from hf_triaccel.curvature.collector import FisherCollector
        >>> lin = nn.Linear(2, 1)
        >>> recorder = Recorder(FisherCollector(lin))
        >>> lin(torch.ones(3, 2)).sum().backward()
        >>> [t.shape for t in recorder.seen[""]]
        [torch.Size([3, 2]), torch.Size([3, 1])]
    """

    def __init__(self, collector) -> None:
        self.layers = collector.layers
        self.inputs: dict[str, list[torch.Tensor]] = {name: [] for name in self.layers}
        self.grads: dict[str, list[torch.Tensor]] = {name: [] for name in self.layers}
        self.handles = []
        for name, layer in self.layers.items():
            self.handles.append(layer.module.register_forward_pre_hook(self._input_hook(name)))
            self.handles.append(layer.output_module.register_forward_hook(self._output_hook(name)))

    def _input_hook(self, name: str):
        def hook(module, args) -> None:
            self.inputs[name].append(args[0].detach().clone())

        return hook

    def _output_hook(self, name: str):
        def hook(module, args, out) -> None:
            out.register_hook(lambda g: self.grads[name].append(g.detach().clone()))

        return hook

    @property
    def seen(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, everything recorded since the last :meth:`clear`, concatenated."""
        return {
            name: (torch.cat(self.inputs[name]), torch.cat(self.grads[name]))
            for name in self.layers
            if self.grads[name]
        }

    def bounds(self) -> dict[str, tuple[float, float]]:
        """Per layer, the largest bound on its ``a`` and ``g`` entries over what was
        recorded (see :func:`statistic_bounds`), then forgets it."""
        out = {}
        for name, (x, dy) in self.seen.items():
            layer = self.layers[name]
            da, dg = statistic_bounds(layer.rule, layer.module, x, dy)
            out[name] = (float(da.max()), float(dg.max()))
        self.clear()
        return out

    def clear(self) -> None:
        for recorded in (*self.inputs.values(), *self.grads.values()):
            recorded.clear()

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
