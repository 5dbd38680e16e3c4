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

from hf_triaccel.curvature.reductions import Reduction, reductions_for
from hf_triaccel.curvature.rules.base import FisherRule, per_entry_layout
from hf_triaccel.curvature.rules.plans import (
    RowsPlan,
    ViewOf,
    as_view,
    channel_reduce,
    inverse,
    remember,
)
from hf_triaccel.curvature.rules.thirdparty import declared_channels_first, norm_output_module


@dataclass
class NormPlan:
    """The a statistic of a normalisation layer for one input shape."""

    reduce: Reduction
    shape: tuple[int, int, int]
    scale: float
    sums: torch.Tensor  # scratch: the scaled per-channel sums u
    row: torch.Tensor  # u as (1, C)
    column: torch.Tensor  # u as (C, 1)
    first: ViewOf
    size_entry: float


def norm_plan(x: torch.Tensor, impl: str | None) -> NormPlan:
    """The plan of :func:`norm_a_write` for inputs shaped as ``x``."""
    shape = (1, *x.shape) if x.dim() == 1 else tuple(x.shape)
    b, c = shape[:2]
    length = math.prod(shape[2:])
    sums = torch.empty(c, dtype=torch.float32, device=x.device)
    return NormPlan(
        reduce=reductions_for(impl, x.device)[1],
        shape=(b, c, length),
        scale=inverse(float(length) ** 2 * b),
        sums=sums,
        row=sums.view(1, c),
        column=sums.view(c, 1),
        first=ViewOf(lambda out: out[:1].view(1, 1)),
        size_entry=c / float(b) ** 2 if b else math.nan,
    )


def norm_a_write(
    x: torch.Tensor, out: torch.Tensor, impl: str | None, cache: dict[Any, Any]
) -> float:
    """Normalisation layers' a (published reference mode): a 2-vector.

    Reduce over every dim except dim 1: u_j = sum / R^2, R the product of the reduced
    dims other than dim 0; a = [sum_j u_j^2, size of dim 1] / B^2. Writes entry 0 (the
    reduction, scaled by 1 / (R^2 B), then the sum of squares) and returns entry 1.

    Example:
        >>> out = torch.zeros(2)
        >>> norm_a_write(torch.ones(2, 3, 4), out, None, {}), out  # u_j = 8 / 16
        (0.75, tensor([0.1875, 0.0000]))
    """
    key = ("a", x.shape)
    plan = cache.get(key) or remember(cache, key, norm_plan(x, impl))
    plan.reduce(as_view(x, plan.shape), False, out=plan.sums, scale=plan.scale)
    # a (1, C) x (C, 1) product: one dispatch, where dot with out= takes two and a copy
    # (and with out=, a float32 product under autocast too)
    torch.mm(plan.row, plan.column, out=plan.first(out))
    return plan.size_entry


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
    (:func:`norm_a_write`) and where the output gradient is taken; subclasses give ``g``."""

    def sizes(self, module):
        return 2, affine_numel(module)

    def layouts(self, module):
        n = affine_numel(module)
        return {"weight": per_entry_layout(n, 0), "bias": per_entry_layout(n, 1)}

    def a_write(self, module, x, out, impl, cache):
        return norm_a_write(x, out, impl, cache)

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

    def g_write(self, module, grad, out, accumulate, impl, cache):
        channel_reduce(grad, 1, out, accumulate, impl, cache, False)


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

    def g_write(self, module, grad, out, accumulate, impl, cache):
        key = ("g", grad.shape)
        plan = cache.get(key) or remember(cache, key, self._g_plan(module, grad, impl))
        if plan is _PER_CHANNEL:
            channel_reduce(grad, 1, out, accumulate, impl, cache, False)
            return
        plan.reduce(
            as_view(grad, (plan.rows, plan.d)),
            False,
            out=out,
            scale=plan.scale,
            accumulate=accumulate,
            square_result=True,
        )

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
        batch = grad.shape[0] if grad.dim() > len(ns) else 1
        reduce, _ = reductions_for(impl, grad.device)
        return RowsPlan(reduce, grad.numel() // n if n else 0, n, inverse(batch))
