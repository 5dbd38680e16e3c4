"""Per-shape plans: what the built-in rules work out once per input shape and keep.

The statistics run on every hooked layer of every refresh step and are bound by host
time, so each built-in rule keeps, in the cache the collector holds for the module, one
plan per input shape and layout: the reduction worked out for it (with Triton, a kernel
launch with its workspace: :func:`~hf_triaccel.curvature.rules.reductions.reducer`), counts and
scales, scratch buffers and views of the caller's buffer. A plan is the one cache of its
statistic; once a layer has seen its input's shape and strides, a statistic costs its one
kernel launch (two for a convolution's activations).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from hf_triaccel.curvature.rules.reductions import Reducer, reducer

# Input shapes a module keeps plans for: an input shape that keeps changing (multi-scale
# images, dynamic sequence lengths) must not pile up buffers; past this the oldest goes.
MAX_PLANS_PER_MODULE = 16


class ViewOf:
    """A view of a caller's buffer, made again only when the buffer changes: making a
    view costs about as much host time as the launch it feeds.

    The view holds the buffer's storage, so an unchanged address means the same buffer.

    Example:
        >>> head = ViewOf(lambda out: out[:2])
        >>> buffer = torch.zeros(3)
        >>> head(buffer).fill_(1.0) is head(buffer), buffer
        (True, tensor([1., 1., 0.]))
    """

    __slots__ = ("make", "ptr", "view")

    def __init__(self, make: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.make = make
        self.ptr = -1
        self.view: torch.Tensor | None = None

    def __call__(self, out: torch.Tensor) -> torch.Tensor:
        ptr = out.data_ptr()
        if ptr != self.ptr:
            self.view = self.make(out)
            self.ptr = ptr
        return self.view


def as_view(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``t`` viewed as ``shape``, copied only when no view exists (``reshape`` costs a
    second dispatch even when it returns a view)."""
    try:
        return t.view(shape)
    except RuntimeError:
        return t.reshape(shape)


def remember(cache: dict[Any, Any], key: Any, plan: Any) -> Any:
    """Stores a new ``plan`` under ``key`` in a module's cache and returns it (the oldest
    plan goes past :data:`MAX_PLANS_PER_MODULE`). Callers look up first, on the hot path:
    ``cache.get(key) or remember(cache, key, make_plan(...))``."""
    if len(cache) >= MAX_PLANS_PER_MODULE:
        del cache[next(iter(cache))]
    cache[key] = plan
    return plan


@dataclass
class RowsPlan:
    """A statistic that is one reduction of its input (over the rows of a 2-D view, or
    per channel), and what its sums run over."""

    reduce: Reducer
    count: float  # what the sums run over, returned to the caller


def rows_plan(t: torch.Tensor, impl: str | None, square: bool) -> RowsPlan:
    """The plan of :func:`sum_square_rows` for inputs shaped and laid out as ``t``."""
    d = t.shape[-1] if t.dim() else 1
    rows = t.numel() // d if d else 0
    reduce = reducer(impl, t, lambda x: as_view(x, (rows, d)), square)
    return RowsPlan(reduce, float(rows))


def sum_square_rows(
    t: torch.Tensor,
    out: torch.Tensor,
    accumulate: bool,
    impl: str | None,
    cache: dict[Any, Any],
    key: str,
) -> float:
    """Sum over rows (every dim but the last) of ``t**2`` into the first ``t.shape[-1]``
    entries of ``out``; returns the number of rows.

    Example:
        >>> out = torch.zeros(3)
        >>> sum_square_rows(torch.full((2, 2), 3.0), out, False, None, {}, "a")
        2.0
        >>> out
        tensor([18., 18.,  0.])
    """
    plan_key = (key, t.shape, t.stride())
    plan = cache.get(plan_key) or remember(cache, plan_key, rows_plan(t, impl, True))
    plan.reduce(t, out, 1.0, accumulate)
    return plan.count


def channel_plan(t: torch.Tensor, unbatched_dim: int, impl: str | None, square: bool) -> RowsPlan:
    """The plan of :func:`channel_reduce` for inputs shaped and laid out as ``t``."""
    shape = (1, *t.shape) if t.dim() == unbatched_dim else tuple(t.shape)
    b, c = shape[:2]
    length = math.prod(shape[2:])
    reduce = reducer(impl, t, lambda x: as_view(x, (b, c, length)), square)
    return RowsPlan(reduce, float(b * length if square else b))


def channel_reduce(
    t: torch.Tensor,
    unbatched_dim: int,
    out: torch.Tensor,
    accumulate: bool,
    impl: str | None,
    cache: dict[Any, Any],
    square: bool,
) -> float:
    """Per-channel (dim 1) sums of ``t`` over every other dim into ``out``, of ``t**2``
    when ``square``; returns what they run over: the batch and positions with ``square``
    (the mean of ``t**2`` divides by it), the samples otherwise (the square of the sum is
    divided by it). A ``t`` with ``unbatched_dim`` dims is a batch of one.

    Example:
        >>> out = torch.zeros(3)
        >>> channel_reduce(torch.ones(2, 3, 4), 2, out, False, None, {}, square=False), out
        (2.0, tensor([8., 8., 8.]))
    """
    key = ("channel", t.shape, t.stride())
    plan = cache.get(key) or remember(cache, key, channel_plan(t, unbatched_dim, impl, square))
    plan.reduce(t, out, 1.0, accumulate)
    return plan.count
