"""Folding a new Fisher statistic into its running factor (docs/design.md, "AdaFisher").

``ema="reference"`` (the published AdaFisher rule, refreshed every ``update_every`` steps)::

    cur <- 0.1 * gamma * cur + 0.01 * gamma * normalise(X)

``ema="paper"`` (the rule as the paper writes it, every step; normalised after the EMA)::

    cur <- gamma * cur + (1 - gamma) * X;   used = normalise(cur)

(the collector starts ``cur`` at zeros instead of ones in paper mode: normalisation
removes the constant the ones seed adds, and float32 keeps its precision).

``normalise`` is min-max scaling over the finite entries, with +inf -> 1 and -inf / NaN
-> 0, and never leaves the device. ``normalise="absolute"`` is the published one::

    normalise(X) = (X - min X) / (max X - min X + 1e-6)

which leaves a statistic of range far below 1e-6 (squared gradients of a mean loss over
a large batch) far below 1, so the preconditioner stays near its damping.
``normalise="relative"``, this project's variant, is scale-free: the statistic spans
[0, 1) whatever its scale (``tiny``, the smallest normal float32, turns a constant
statistic into zeros)::

    normalise(X) = (X - min X) / ((max X - min X) * (1 + 1e-6) + tiny)
"""

from __future__ import annotations

import torch

from hf_triaccel._types import EMA_MODES, NORMALISE_EPS, NORMALISE_MODES, NORMALISE_TINY
from hf_triaccel.dispatch import resolve_impl


def check_fold_modes(mode: str, normalise: str) -> None:
    """Raises ``ValueError`` unless ``mode`` is an EMA rule and ``normalise`` a
    normalisation.

    Example:
        >>> check_fold_modes("paper", "scaled")
        Traceback (most recent call last):
        ...
        ValueError: normalise='scaled' is not one of ('absolute', 'relative')
    """
    if mode not in EMA_MODES:
        raise ValueError(f"ema={mode!r} is not one of {EMA_MODES}")
    if normalise not in NORMALISE_MODES:
        raise ValueError(f"normalise={normalise!r} is not one of {NORMALISE_MODES}")


def minmax_normalise(x: torch.Tensor, normalise: str = "absolute") -> torch.Tensor:
    """Min-max normalisation of a float tensor without a host sync.

    Args:
        x: the statistic.
        normalise: ``"absolute"`` (the published rule) or ``"relative"`` (scale-free).

    Example:
        >>> minmax_normalise(torch.tensor([1.0, 3.0, float("inf")]))
        tensor([0.0000, 1.0000, 1.0000])
        >>> minmax_normalise(torch.tensor([0.0, 1e-9, 2e-9]))
        tensor([0.0000, 0.0010, 0.0020])
        >>> minmax_normalise(torch.tensor([0.0, 1e-9, 2e-9]), "relative")
        tensor([0.0000, 0.5000, 1.0000])
    """
    finite = torch.isfinite(x)
    lo = torch.where(finite, x, float("inf")).amin()
    hi = torch.where(finite, x, float("-inf")).amax()
    if normalise == "absolute":
        out = (x - lo) / (hi - lo + NORMALISE_EPS)
    elif normalise == "relative":
        out = (x - lo) / ((hi - lo) * (1.0 + NORMALISE_EPS) + NORMALISE_TINY)
    else:
        raise ValueError(f"normalise={normalise!r} is not one of {NORMALISE_MODES}")
    out = torch.where(finite, out, torch.zeros_like(out))
    return torch.where(x == float("inf"), torch.ones_like(out), out)


def fold_reference(
    ema: torch.Tensor,
    new: torch.Tensor,
    used: torch.Tensor,
    mode: str,
    gamma: float,
    normalise: str = "absolute",
) -> None:
    """Folds one statistic ``new`` into ``ema`` in place and refreshes ``used``.

    In reference mode ``used`` is ``ema`` itself; in paper mode it receives the
    normalised EMA. ``normalise`` chooses the normalisation (:func:`minmax_normalise`).
    """
    check_fold_modes(mode, normalise)
    if mode == "reference":
        ema.mul_(0.1 * gamma).add_(minmax_normalise(new, normalise), alpha=0.01 * gamma)
        if used is not ema:
            used.copy_(ema)
    else:
        ema.mul_(gamma).add_(new, alpha=1.0 - gamma)
        used.copy_(minmax_normalise(ema, normalise))


class FactorFold:
    """Folds a fixed list of statistics into their factors, all on one device.

    Made once for tensors that stay where they are (the collector's factors and
    accumulators) and called at every refresh: the implementation is resolved, and for the
    Triton kernel its table of the tensors' addresses built and checked, only here. This
    object is the fold's one cache; it holds the tensors, so their addresses stay valid.

    Args:
        emas: running factors (contiguous 1-D float32), updated in place.
        news: new statistics, one per factor, same lengths.
        useds: where the factors used by the update go (``useds[i]`` may be ``emas[i]``).
        impl: implementation (see :mod:`hf_triaccel.dispatch`).

    Example:
        >>> ema, new = torch.zeros(3), torch.tensor([1.0, 2.0, 3.0])
        >>> fold = FactorFold([ema], [new], [ema], impl="reference")
        >>> fold("reference", gamma=1.0)
        >>> ema
        tensor([0.0000, 0.0050, 0.0100])
    """

    def __init__(
        self,
        emas: list[torch.Tensor],
        news: list[torch.Tensor],
        useds: list[torch.Tensor],
        impl: str | None = None,
    ) -> None:
        if not (len(emas) == len(news) == len(useds)):
            raise ValueError(
                f"emas, news and useds differ in length: {len(emas)}, {len(news)}, {len(useds)}"
            )
        self.factors = list(zip(emas, news, useds, strict=True))
        self.table: torch.Tensor | None = None
        if emas and resolve_impl(impl, emas[0].device) == "triton":
            from hf_triaccel.kernels.fold import fold_table

            self.table = fold_table(emas, news, useds)

    def __call__(self, mode: str, gamma: float, normalise: str = "absolute") -> None:
        """Folds every statistic into its factor with the EMA rule ``mode`` and the
        normalisation ``normalise``."""
        check_fold_modes(mode, normalise)
        if self.table is not None:
            from hf_triaccel.kernels.fold import fold_triton

            fold_triton(self.table, mode, gamma, normalise)
            return
        for ema, new, used in self.factors:
            fold_reference(ema, new, used, mode, gamma, normalise)


def fold_factors(
    emas: list[torch.Tensor],
    news: list[torch.Tensor],
    useds: list[torch.Tensor],
    mode: str,
    gamma: float,
    impl: str | None = None,
    *,
    normalise: str = "absolute",
) -> None:
    """Folds each ``news[i]`` into ``emas[i]`` (and ``useds[i]``), all on one device, once
    (see :class:`FactorFold` for a fold that repeats). The Triton path does every factor in
    one launch; the others loop. ``normalise`` as for :func:`minmax_normalise`.

    Example:
        >>> ema, new, used = torch.zeros(2), torch.tensor([2.0, 4.0]), torch.zeros(2)
        >>> fold_factors([ema], [new], [used], "paper", gamma=0.5, impl="reference")
        >>> ema, used
        (tensor([1., 2.]), tensor([0.0000, 1.0000]))
    """
    check_fold_modes(mode, normalise)
    FactorFold(emas, news, useds, impl)(mode, gamma, normalise)
