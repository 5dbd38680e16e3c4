"""Reductions that Fisher statistics are built from, with their dispatch.

Each function takes activations or output gradients in any float dtype and returns
float32 sums. The reference versions here are plain PyTorch; the Triton versions
(``hf_triaccel.kernels.reductions``) read the native dtype once and accumulate in float32.
Both are selected through :func:`hf_triaccel.dispatch.resolve_impl`.

Both take the same epilogue: the sums may be scaled (``scale``) and written into, or added
to (``accumulate``), a caller's float32 buffer (``out``). The Triton versions do this
inside the kernel, so that a statistic hook accumulating into a preallocated buffer,
through a :func:`reducer` worked out once for its input's layout, costs one launch and
nothing else. (What is not linear in the samples, such as the square of a sum, waits for
the step's sums: :mod:`hf_triaccel.curvature.rules.finish`.)
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from hf_triaccel._types import check_statistic_out
from hf_triaccel.curvature.rules.batching import queue_or_launch
from hf_triaccel.dispatch import resolve_impl

Reduction = Callable[..., torch.Tensor]


def _reference_sums(
    x: torch.Tensor,
    dims: int | tuple[int, ...],
    square: bool,
    out: torch.Tensor | None,
    scale: float,
    accumulate: bool,
) -> torch.Tensor:
    """Sums of ``x`` (of ``x * x`` when ``square``) over ``dims`` in float32, through the
    shared epilogue."""
    x = x.float()
    sums = (x * x).sum(dims) if square else x.sum(dims)
    if out is None:
        if accumulate:
            raise ValueError("accumulate=True needs an out tensor to add to")
        return sums if scale == 1.0 else sums.mul_(scale)
    check_statistic_out(out, sums.numel(), x.device)
    if accumulate:
        return out.add_(sums, alpha=scale)
    return torch.mul(sums, scale, out=out)


def sum_rows_reference(
    x: torch.Tensor,
    square: bool,
    *,
    out: torch.Tensor | None = None,
    scale: float = 1.0,
    accumulate: bool = False,
) -> torch.Tensor:
    """Sum over rows of a 2-D tensor (x^2 if ``square``): (N, D) -> (D,) float32.

    The keyword arguments are those of :func:`sum_rows`.
    """
    return _reference_sums(x, 0, square, out, scale, accumulate)


def channel_sum_reference(
    x: torch.Tensor,
    square: bool,
    *,
    out: torch.Tensor | None = None,
    scale: float = 1.0,
    accumulate: bool = False,
) -> torch.Tensor:
    """Sum over dims 0 and 2 of a 3-D tensor (x^2 if ``square``): (B, C, L) -> (C,) float32.

    The keyword arguments are those of :func:`sum_rows`.
    """
    return _reference_sums(x, (0, 2), square, out, scale, accumulate)


def reductions_for(impl: str | None, device: torch.device) -> tuple[Reduction, Reduction]:
    """The ``(sum_rows, channel_sum)`` implementations :func:`sum_rows` and
    :func:`channel_sum` would run on ``device``, for callers that resolve once and call
    many times (the statistics hooks). They take the arguments of those two functions
    but ``impl``, and check less: inputs must already be 2-D / 3-D.

    Example:
        >>> rows, _ = reductions_for("reference", torch.device("cpu"))
        >>> rows(torch.ones(4, 3), True, scale=0.25)
        tensor([1., 1., 1.])
    """
    if resolve_impl(impl, device) == "triton":
        from hf_triaccel.kernels.reductions import channel_sum_triton, sum_rows_triton

        return sum_rows_triton, channel_sum_triton
    return sum_rows_reference, channel_sum_reference


Reducer = Callable[..., None]


def reducer(
    impl: str | None,
    example: torch.Tensor,
    view: Callable[[torch.Tensor], torch.Tensor],
    square: bool,
    tail: tuple[int, float] | None = None,
) -> Reducer:
    """One statistic's reduction, worked out once for inputs laid out as ``example``.

    ``view`` maps such an input to the 2-D tensor whose rows are summed, or the 3-D one
    summed over dims 0 and 2. The result is called as ``reduce(x, out, scale=1.0,
    accumulate=False)`` with inputs of ``example``'s shape and strides: it writes the
    scaled sums into the first entries of the float32 buffer ``out`` (or adds them) and,
    with ``tail=(length, value)``, ``length`` more entries after them: zeros, ``value``
    last. With Triton, whenever a kernel reads the view in place, that is one kernel
    launch (:class:`~hf_triaccel.kernels.reductions.ReductionLaunch`) and no other
    operation, queued while a statistics batch is active when it sums rows
    (:mod:`~hf_triaccel.curvature.rules.batching`); otherwise the view is copied first.

    Example:
        >>> x = torch.ones(2, 3, 4)
        >>> reduce = reducer("reference", x, lambda t: t, square=False, tail=(2, 6.0))
        >>> out = torch.zeros(5)
        >>> reduce(x, out, scale=0.5); out
        tensor([4., 4., 4., 0., 6.])
    """
    v = view(example)
    shape = v.shape
    n = shape[1] if len(shape) > 1 else 1
    if resolve_impl(impl, example.device) == "triton" and example.numel():
        from hf_triaccel.kernels.reductions import reduction_launch

        if v.data_ptr() == example.data_ptr():  # a view, not a copy
            launch = reduction_launch(v, square, tail)
            if launch is not None:
                # reads each input where it is; a row sum can wait in the active batch
                # (hf_triaccel.curvature.rules.batching), which launches the others at once
                return functools.partial(queue_or_launch, launch)
        launch = reduction_launch(v.contiguous(), square, tail)

        def copied(x: torch.Tensor, out: torch.Tensor, scale=1.0, accumulate=False) -> None:
            queue_or_launch(launch, view(x).contiguous(), out, scale, accumulate)

        return copied
    dims = 0 if len(shape) == 2 else (0, 2)

    def reference(x: torch.Tensor, out: torch.Tensor, scale=1.0, accumulate=False) -> None:
        _reference_sums(view(x.detach()), dims, square, out[:n], scale, accumulate)
        if tail is not None:
            out[n : n + tail[0]].zero_()
            out[n + tail[0] - 1] = tail[1]

    return reference


def sum_rows(
    x: torch.Tensor,
    square: bool,
    impl: str | None = None,
    *,
    out: torch.Tensor | None = None,
    scale: float = 1.0,
    accumulate: bool = False,
) -> torch.Tensor:
    """Column sums of ``x`` (N, D), of its squares when ``square``, in float32.

    Args:
        x: (N, D) input in any float dtype.
        square: sum ``x * x`` instead of ``x``.
        impl: implementation (see :mod:`hf_triaccel.dispatch`).
        out: contiguous float32 (D,) destination; a new tensor when ``None``.
        scale: factor applied to the sums.
        accumulate: add into ``out`` instead of overwriting it.

    Returns:
        ``out`` or the new tensor: ``scale * sums``, plus the previous ``out`` when
        ``accumulate``.

    Example:
        >>> sum_rows(torch.ones(4, 3), square=True, impl="reference")
        tensor([4., 4., 4.])
    """
    if x.dim() != 2:
        raise ValueError(f"sum_rows expects a 2-D tensor, got shape {tuple(x.shape)}")
    rows, _ = reductions_for(impl, x.device)
    return rows(x, square, out=out, scale=scale, accumulate=accumulate)


def channel_sum(
    x: torch.Tensor,
    square: bool,
    impl: str | None = None,
    *,
    out: torch.Tensor | None = None,
    scale: float = 1.0,
    accumulate: bool = False,
) -> torch.Tensor:
    """Per-channel sums of ``x`` (B, C, L) over batch and positions, in float32.

    The keyword arguments are those of :func:`sum_rows`, with ``out`` of shape (C,).

    Example:
        >>> channel_sum(torch.ones(2, 3, 5), square=False, impl="reference")
        tensor([10., 10., 10.])
    """
    if x.dim() != 3:
        raise ValueError(f"channel_sum expects a 3-D tensor, got shape {tuple(x.shape)}")
    _, channels = reductions_for(impl, x.device)
    return channels(x, square, out=out, scale=scale, accumulate=accumulate)
