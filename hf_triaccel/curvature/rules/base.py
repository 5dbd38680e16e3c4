"""The rule API: what a module kind tells the collector about its Fisher factors.

A :class:`FisherRule` gives, for one kind of module, the lengths of its two factor vectors
(``a`` from the layer input, ``g`` from the gradient of its output), how each of the
module's parameters indexes them (:class:`~hf_triaccel._types.FactorLayout`), how one
micro-batch's sums are written into a buffer the caller owns, and how the step's sums
become the statistic (:mod:`~hf_triaccel.curvature.rules.finish`). That is the only way
statistics are taken: :func:`a_statistic` / :func:`g_statistic` call the same methods into
new tensors, for inspection and tests.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hf_triaccel._types import FactorLayout
from hf_triaccel.curvature.rules.finish import Finish, FinishPlan, Mean


def out_in_layout(d_out: int, d_in: int) -> FactorLayout:
    """Weight stored (d_out, d_in...): g over rows, a over columns.

    Example:
        >>> out_in_layout(2, 3)
        FactorLayout(g_div=3, g_mod=2, a_div=1, a_mod=3, a_off=0)
    """
    return FactorLayout(g_div=d_in, g_mod=d_out, a_div=1, a_mod=d_in)


def in_out_layout(d_in: int, d_out: int) -> FactorLayout:
    """Weight stored (d_in, d_out): a over rows, g over columns.

    Example:
        >>> in_out_layout(3, 2)
        FactorLayout(g_div=1, g_mod=2, a_div=2, a_mod=3, a_off=0)
    """
    return FactorLayout(g_div=1, g_mod=d_out, a_div=d_out, a_mod=d_in)


def per_entry_layout(n: int, a_entry: int) -> FactorLayout:
    """A vector parameter: g per entry, one shared ``a`` entry (bias or norm affine).

    Example:
        >>> per_entry_layout(4, a_entry=3)  # a Linear(3, 4)'s bias: a's last entry
        FactorLayout(g_div=1, g_mod=4, a_div=1, a_mod=1, a_off=3)
    """
    return FactorLayout(g_div=1, g_mod=n, a_div=1, a_mod=1, a_off=a_entry)


class FisherRule:
    """The Fisher factors of one module kind: their sizes, layouts and statistics.

    A statistic is taken in two parts. In the hooks, :meth:`a_write` / :meth:`g_write`
    write one micro-batch's *sums* over its samples (or rows) and return how many they
    summed: sums of several micro-batches and processes add up to those of the whole
    batch. Once per optimizer step, the finish that :meth:`a_finish` / :meth:`g_finish`
    name turns the step's sums and count into the statistic (a mean, the square of a
    sum...; :mod:`~hf_triaccel.curvature.rules.finish`), so that whatever is not linear in the
    samples is applied once, to the whole batch.

    A rule for a custom module class implements :meth:`sizes`, :meth:`layouts`,
    :meth:`a_write` and :meth:`g_write` (and :meth:`a_finish`, :meth:`g_finish`,
    :meth:`output_module` when the defaults do not fit), then is registered with
    :func:`~hf_triaccel.curvature.rules.register_fisher_rule`. The statistics run in the
    collector's hooks on every refresh step, on tensors detached from autograd; a rule that
    reads the module's parameters should detach them too.

    Example:
        >>> class ScaleRule(FisherRule):  # y = weight * x, one weight per feature
        ...     def sizes(self, module):
        ...         return 1, module.weight.numel()
        ...     def layouts(self, module):
        ...         return {"weight": per_entry_layout(module.weight.numel(), 0)}
        ...     def a_write(self, module, x, out, impl, cache):  # the mean of x^2
        ...         out[0] = x.float().square().sum()
        ...         return x.numel()
        ...     def g_write(self, module, grad, out, accumulate, impl, cache):
        ...         rows = grad.float().reshape(-1, out.numel())
        ...         stat = rows.square().sum(0)
        ...         out.add_(stat) if accumulate else out.copy_(stat)
        ...         return rows.shape[0]
        >>> class Scale(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.weight = nn.Parameter(torch.ones(3))
        ...     def forward(self, x):
        ...         return self.weight * x
        >>> a_statistic(ScaleRule(), Scale(), torch.full((2, 3), 2.0))
        tensor([4.])
    """

    def sizes(self, module: nn.Module) -> tuple[int, int]:
        """Lengths of the (a, g) factor vectors."""
        raise NotImplementedError

    def layouts(self, module: nn.Module) -> dict[str, FactorLayout]:
        """Layout of each direct parameter, by attribute name."""
        raise NotImplementedError

    def output_module(self, module: nn.Module) -> nn.Module:
        """The module whose output gradient :meth:`g_write` reads: ``module`` itself, unless
        its forward applies something (an activation) after the parameterised op."""
        return module

    def a_finish(self, module: nn.Module) -> Finish:
        """How the step's activation sums become ``a`` (default: their mean)."""
        return Mean()

    def g_finish(self, module: nn.Module) -> Finish:
        """How the step's gradient sums become ``g`` (default: their mean); it must keep
        the sums' length (:class:`~hf_triaccel.curvature.rules.finish.Mean` or
        :class:`~hf_triaccel.curvature.rules.finish.SquareMean`)."""
        return Mean()

    def input_saved(self, module: nn.Module) -> bool:
        """Whether ``module``'s forward keeps its input, as given, for the backward (with
        autograd on, and unless autocast casts it): then its activation statistic may wait
        for the backward to start at no memory cost
        (:mod:`~hf_triaccel.curvature.rules.batching`). Asked when the collector registers its
        hooks, not at every forward. Default: ``False``, taken at once."""
        return False

    def a_write(
        self,
        module: nn.Module,
        x: torch.Tensor,
        out: torch.Tensor,
        impl: str | None,
        cache: dict[Any, Any],
    ) -> float:
        """Writes the activation sums of one micro-batch into ``out``.

        Args:
            module: the module.
            x: its input, detached from autograd.
            out: contiguous float32 destination of the length
                ``a_finish(module).sums_length(sizes(module)[0])``. Entries the finish
                sets itself (a :class:`~hf_triaccel.curvature.rules.finish.Mean`'s ``last``)
                may be left as they are.
            impl: implementation (see :mod:`hf_triaccel.dispatch`).
            cache: a dict the caller keeps for this module (and empties when the module's
                buffers move), where the rule keeps what it can reuse from call to call.

        Returns:
            The number of samples (or rows) summed: the step's statistic divides the
            step's sums by the step's total of these.
        """
        raise NotImplementedError

    def g_write(
        self,
        module: nn.Module,
        grad: torch.Tensor,
        out: torch.Tensor,
        accumulate: bool,
        impl: str | None,
        cache: dict[Any, Any],
    ) -> float:
        """Writes the gradient sums of one micro-batch into ``out``, or adds them to
        ``out`` when ``accumulate``; returns the number of samples (or rows) summed.
        Arguments as for :meth:`a_write`; ``out`` has length ``sizes(module)[1]``."""
        raise NotImplementedError


def a_statistic(
    rule: FisherRule, module: nn.Module, x: torch.Tensor, impl: str | None = None
) -> torch.Tensor:
    """The activation statistic of ``module`` on the batch ``x``, finished, as a new
    float32 tensor.

    Example:
        >>> from hf_triaccel.curvature.rules import rule_for
        >>> layer = nn.Linear(2, 3)
        >>> a_statistic(rule_for(layer), layer, torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
        tensor([ 5., 10.,  1.])
    """
    finish = rule.a_finish(module)
    length = rule.sizes(module)[0]
    sums = torch.zeros(finish.sums_length(length), dtype=torch.float32, device=x.device)
    with torch.no_grad():
        n = rule.a_write(module, x.detach(), sums, impl, {})
    out = sums if finish.in_place else torch.zeros(length, device=x.device)
    FinishPlan([(finish, sums, out)])([n])
    return out


def g_statistic(
    rule: FisherRule, module: nn.Module, grad: torch.Tensor, impl: str | None = None
) -> torch.Tensor:
    """The gradient statistic of ``module`` from the gradient ``grad`` of its output on a
    batch, finished, as a new float32 tensor.

    Example:
        >>> from hf_triaccel.curvature.rules import rule_for
        >>> layer = nn.Linear(2, 3)
        >>> g_statistic(rule_for(layer), layer, torch.full((4, 3), 2.0))
        tensor([4., 4., 4.])
    """
    out = torch.zeros(rule.sizes(module)[1], dtype=torch.float32, device=grad.device)
    with torch.no_grad():
        n = rule.g_write(module, grad.detach(), out, False, impl, {})
    FinishPlan([(rule.g_finish(module), out, out)])([n])
    return out
