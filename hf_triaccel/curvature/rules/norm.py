"""Normalisation layers: BatchNorm and GroupNorm (per channel), LayerNorm and RMSNorm (over
the trailing dims), and their subclasses in other libraries.

Their ``a`` is a 2-vector: entry 0 serves the weight, entry 1 the bias. Without affine
parameters a layer has nothing to precondition and gets no factors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hf_triaccel.curvature.rules.base import FisherRule, per_entry_layout
from hf_triaccel.curvature.rules.batching import then
from hf_triaccel.curvature.rules.finish import NormActivation, SquareMean, inverse
from hf_triaccel.curvature.rules.plans import (
    RowsPlan,
    ViewOf,
    as_view,
    channel_reduce,
    remember,
)
from hf_triaccel.curvature.rules.reductions import Reducer, reducer
from hf_triaccel.curvature.rules.thirdparty import declared_channels_first, norm_output_module

# Per-position sums kept for the ``a`` of a layer that normalises trailing dims: one per
# position along dim 1 (the tokens of a (B, T, D) input), whose count the module does not
# fix. A fixed number keeps every process's sums the same length for the one all-reduce
# per refresh; positions past it wrap around (t and t + POSITIONS share an entry).
POSITIONS = 8192


@dataclass
class NormPlan:
    """The activation sums of a normalisation layer for one input shape and layout."""

    reduce: Reducer  # writes the sums, then (unless wrapped) zeros and the size entry
    scale: float  # 1 / R^2
    count: float
    positions: int  # the entries of dim 1 the sums keep
    # when C > positions: the reduction's scratch, its (-1, positions) view and what
    # follows the wrapped sums in ``out`` (the size entry)
    wrapped: torch.Tensor | None = None
    sums: ViewOf | None = None
    tail: ViewOf | None = None
    tail_values: torch.Tensor | None = None


def norm_plan(x: torch.Tensor, impl: str | None, positions: int) -> NormPlan:
    """The plan of :func:`norm_a_write` for inputs shaped and laid out as ``x``."""
    shape = (1, *x.shape) if x.dim() == 1 else tuple(x.shape)
    b, c = shape[:2]
    length = math.prod(shape[2:])
    view = lambda t: as_view(t, (b, c, length))  # noqa: E731
    scale, size = inverse(float(length) ** 2), float(b * c)  # size: dim 1's, summed
    if c <= positions:
        reduce = reducer(impl, x, view, False, tail=(positions - c + 1, size))
        return NormPlan(reduce, scale, float(b), positions)
    return NormPlan(
        reducer(impl, x, view, False),
        scale,
        float(b),
        positions,
        wrapped=torch.zeros(-(-c // positions) * positions, device=x.device),
        sums=ViewOf(lambda out: out[:positions]),
        tail=ViewOf(lambda out: out[positions:]),
        tail_values=torch.full((1,), size, device=x.device),
    )


def norm_a_write(
    x: torch.Tensor, out: torch.Tensor, impl: str | None, cache: dict[Any, Any], positions: int
) -> float:
    """Normalisation layers' activation sums (published reference mode), finished by
    :class:`~hf_triaccel.curvature.rules.finish.NormActivation`.

    The statistic: reduce over every dim except dim 1; u_j = sum / R^2, R the product of
    the reduced dims other than dim 0; a = [sum_j u_j^2, size of dim 1] / B^2. Squares of
    sums over the batch, so the hook writes the sums: ``out[:positions]`` gets
    ``sum / R^2`` per entry j of dim 1 (zeros past its size; entries past ``positions``
    wrap around) and ``out[positions]`` the size of dim 1 times B. Returns B.

    Example:
        >>> out = torch.zeros(5)
        >>> norm_a_write(torch.ones(2, 3, 4), out, None, {}, positions=4), out  # 8 / 16
        (2.0, tensor([0.5000, 0.5000, 0.5000, 0.0000, 6.0000]))
    """
    key = ("a", x.shape, x.stride())
    plan = cache.get(key) or remember(cache, key, norm_plan(x, impl, positions))
    return write_norm_sums(plan, x, out)


def write_norm_sums(plan: NormPlan, x: torch.Tensor, out: torch.Tensor) -> float:
    """:func:`norm_a_write` with its plan looked up; returns B."""
    if plan.wrapped is None:
        plan.reduce(x, out, plan.scale)
        return plan.count
    plan.reduce(x, plan.wrapped, plan.scale)
    then(_wrap, plan, out)  # after the reduction, if it is queued
    return plan.count


def _wrap(plan: NormPlan, out: torch.Tensor) -> None:
    """Adds the wrapped sums of a layer wider than the positions kept into ``out``."""
    torch.sum(plan.wrapped.view(-1, plan.positions), 0, out=plan.sums(out))
    plan.tail(out).copy_(plan.tail_values)


def affine_numel(module: nn.Module) -> int:
    """Number of affine elements of a normalisation layer, whether or not it has them.

    Example:
        >>> affine_numel(nn.LayerNorm((2, 3))), affine_numel(nn.GroupNorm(2, 4))
        (6, 4)
    """
    shape = getattr(module, "normalized_shape", None)
    if shape is not None:
        return math.prod(shape)
    for attr in ("num_features", "num_channels"):
        n = getattr(module, attr, None)
        if isinstance(n, int):
            return n
    p = module.weight if getattr(module, "weight", None) is not None else module.bias
    return p.numel()


def channels_first(module: nn.Module, shape: torch.Size) -> bool:
    """Whether a LayerNorm-like module normalises dim 1 (affine per channel of (B, C, ...))
    rather than the trailing dims: as it declares (see
    :func:`~hf_triaccel.curvature.rules.thirdparty.declared_channels_first`), else when
    the input's trailing dims do not fit while dim 1 does.

    Example:
        >>> channels_first(nn.LayerNorm(3), torch.Size((2, 3, 5, 5)))
        True
    """
    declared = declared_channels_first(module)
    if declared is not None:
        return declared
    ns = tuple(module.normalized_shape)
    return len(ns) == 1 and len(shape) >= 3 and tuple(shape[-1:]) != ns and shape[1] == ns[0]


class NormRule(FisherRule):
    """What every normalisation layer shares: sizes, layouts, the ``a`` statistic
    (:func:`norm_a_write`), the finishes and where the output gradient is taken;
    subclasses give ``g``'s sums (over the batch, squared once per step: ``SquareMean``)
    and how many entries of dim 1 the ``a`` sums keep."""

    def sizes(self, module):
        return 2, affine_numel(module)

    def layouts(self, module):
        n = affine_numel(module)
        return {"weight": per_entry_layout(n, 0), "bias": per_entry_layout(n, 1)}

    def positions(self, module: nn.Module) -> int:
        """Entries of dim 1 the ``a`` sums keep: the channels."""
        return affine_numel(module)

    def a_finish(self, module):
        return NormActivation(self.positions(module))

    def g_finish(self, module):
        return SquareMean()

    def a_write(self, module, x, out, impl, cache):
        # the positions are asked only for a new plan: reading a module's attributes costs
        # more host time than a hook can spare
        plan = cache.get(("a", x.shape, x.stride()))
        if plan is None:
            return norm_a_write(x, out, impl, cache, self.positions(module))
        return write_norm_sums(plan, x, out)

    def output_module(self, module):
        return norm_output_module(module)


class ChannelNormRule(NormRule):
    """BatchNorm (1d/2d/3d, and subclasses such as timm's BatchNormAct2d) and GroupNorm.

    a: see :func:`norm_a_write`; g_c = (sum over all dims but 1 of the output gradient)^2 / B.

    Example:
        >>> from hf_triaccel.curvature.rules import g_statistic
        >>> g_statistic(ChannelNormRule(), nn.BatchNorm1d(2), torch.ones(4, 2))  # 4^2 / 4
        tensor([4., 4.])
    """

    def input_saved(self, module):
        # BatchNorm keeps its input as given; GroupNorm under autocast keeps a float32 copy
        return isinstance(module, nn.modules.batchnorm._BatchNorm)

    def g_write(self, module, grad, out, accumulate, impl, cache):
        return channel_reduce(grad, 1, out, accumulate, impl, cache, False)


# LastDimNormRule's plan for channels-first layers: g per channel, as ChannelNormRule's
_PER_CHANNEL = object()


class LastDimNormRule(NormRule):
    """LayerNorm and RMSNorm (affine over the trailing ``normalized_shape`` dims).

    a: see :func:`norm_a_write`; g = (sum over the leading, non-normalised dims of the
    output gradient)^2 / B, one entry per affine element. Channels-first layers (see
    :func:`channels_first`), which normalise dim 1 of (B, C, ...) inputs, take g per
    channel as :class:`ChannelNormRule`.

    Example:
        >>> from hf_triaccel.curvature.rules import g_statistic
        >>> g_statistic(LastDimNormRule(), nn.LayerNorm(2), torch.ones(4, 3, 2))  # 12^2 / 4
        tensor([36., 36.])
    """

    def positions(self, module):
        # declared channels-first: one entry per channel; else up to POSITIONS tokens
        if declared_channels_first(module):
            return affine_numel(module)
        return max(affine_numel(module), POSITIONS)

    def g_write(self, module, grad, out, accumulate, impl, cache):
        key = ("g", grad.shape, grad.stride())
        plan = cache.get(key) or remember(cache, key, self._g_plan(module, grad, impl))
        if plan is _PER_CHANNEL:
            return channel_reduce(grad, 1, out, accumulate, impl, cache, False)
        plan.reduce(grad, out, 1.0, accumulate)
        return plan.count

    @staticmethod
    def _g_plan(module: nn.Module, grad: torch.Tensor, impl: str | None) -> RowsPlan | object:
        if channels_first(module, grad.shape):
            return _PER_CHANNEL
        ns = tuple(module.normalized_shape)
        if tuple(grad.shape[grad.dim() - len(ns) :]) != ns:
            raise ValueError(
                f"{type(module).__name__} with normalized_shape {ns} got an output of shape "
                f"{tuple(grad.shape)}, whose trailing dims do not match"
            )
        n = math.prod(ns)
        rows = grad.numel() // n if n else 0
        batch = grad.shape[0] if grad.dim() > len(ns) else 1
        view = lambda t: as_view(t, (rows, n))  # noqa: E731
        return RowsPlan(reducer(impl, grad, view, False), float(batch))
