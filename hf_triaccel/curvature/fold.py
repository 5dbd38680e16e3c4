"""Folding a new Fisher statistic into its running factor (docs/design.md, "AdaFisher").

``ema="reference"`` (the published AdaFisher rule, refreshed every ``update_every`` steps)::

    cur <- 0.1 * gamma * cur + 0.01 * gamma * normalise(X)

``ema="paper"`` (the rule as the paper writes it, every step; normalised after the EMA)::

    cur <- gamma * cur + (1 - gamma) * X;   used = normalise(cur)

(the collector starts ``cur`` at zeros instead of ones in paper mode: normalisation
removes the constant the ones seed adds, and float32 keeps its precision).

``normalise`` is min-max scaling, (X - min X) / (max X - min X + 1e-6), over the finite
entries, with +inf -> 1 and -inf / NaN -> 0; it never leaves the device.
"""

from __future__ import annotations

import torch

from hf_triaccel._types import EMA_MODES, NORMALISE_EPS
from hf_triaccel.dispatch import resolve_impl


def minmax_normalise(x: torch.Tensor) -> torch.Tensor:
    """Min-max normalisation of a float tensor without a host sync.

    Example:
        >>> minmax_normalise(torch.tensor([1.0, 3.0, float("inf")]))
        tensor([0.0000, 1.0000, 1.0000])
    """
    finite = torch.isfinite(x)
    lo = torch.where(finite, x, float("inf")).amin()
    hi = torch.where(finite, x, float("-inf")).amax()
    out = (x - lo) / (hi - lo + NORMALISE_EPS)
    out = torch.where(finite, out, torch.zeros_like(out))
    return torch.where(x == float("inf"), torch.ones_like(out), out)


def fold_reference(
    ema: torch.Tensor, new: torch.Tensor, used: torch.Tensor, mode: str, gamma: float
) -> None:
    """Folds one statistic ``new`` into ``ema`` in place and refreshes ``used``.

    In reference mode ``used`` is ``ema`` itself; in paper mode it receives the
    normalised EMA.
    """
    if mode == "reference":
        ema.mul_(0.1 * gamma).add_(minmax_normalise(new), alpha=0.01 * gamma)
        if used is not ema:
            used.copy_(ema)
    elif mode == "paper":
        ema.mul_(gamma).add_(new, alpha=1.0 - gamma)
        used.copy_(minmax_normalise(ema))
    else:
        raise ValueError(f"ema={mode!r} is not one of {EMA_MODES}")


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
            from hf_triaccel.kernels.stats import fold_table

            self.table = fold_table(emas, news, useds)

    def __call__(self, mode: str, gamma: float) -> None:
        """Folds every statistic into its factor with the EMA rule ``mode``."""
        if mode not in EMA_MODES:
            raise ValueError(f"ema={mode!r} is not one of {EMA_MODES}")
        if self.table is not None:
            from hf_triaccel.kernels.stats import fold_triton

            fold_triton(self.table, mode, gamma)
            return
        for ema, new, used in self.factors:
            fold_reference(ema, new, used, mode, gamma)


def fold_factors(
    emas: list[torch.Tensor],
    news: list[torch.Tensor],
    useds: list[torch.Tensor],
    mode: str,
    gamma: float,
    impl: str | None = None,
) -> None:
    """Folds each ``news[i]`` into ``emas[i]`` (and ``useds[i]``), all on one device, once
    (see :class:`FactorFold` for a fold that repeats). The Triton path does every factor in
    one launch; the others loop.

    Example:
        >>> ema, new, used = torch.zeros(2), torch.tensor([2.0, 4.0]), torch.zeros(2)
        >>> fold_factors([ema], [new], [used], "paper", gamma=0.5, impl="reference")
        >>> ema, used
        (tensor([1., 2.]), tensor([0.0000, 1.0000]))
    """
    if mode not in EMA_MODES:
        raise ValueError(f"ema={mode!r} is not one of {EMA_MODES}")
    FactorFold(emas, news, useds, impl)(mode, gamma)
