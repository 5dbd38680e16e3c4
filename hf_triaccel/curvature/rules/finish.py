"""A step's Fisher statistics from their sums: the part that is not linear in the samples,
applied once per optimizer step (docs/design.md, "AdaFisher as implemented").

A rule writes, for each forward (micro-batch), sums over its samples or rows and returns
how many it summed. Sums add: over the micro-batches of a step and, under data
parallelism, over the processes, so the step's sums are those of its whole batch however
it was split. At the fold each statistic is finished once, from its sums ``s`` and the
step's count ``n``:

* :class:`Mean` ``(scale, last)``: ``X = s * scale / n``, the last entry then set to
  ``last`` when given (a bias column's constant). Linear, Conv, Embedding, and the ``g``
  of every rule but the normalisation layers'.
* :class:`SquareMean`: ``X = s**2 / n``, the square of a batch sum: the normalisation
  layers' ``g``.
* :class:`NormActivation` ``(positions)``: ``s`` holds ``positions`` per-position sums
  and then the samples' dim-1 sizes summed; ``X = [sum_t (s_t / n)**2, s_last / n**3]``:
  the normalisation layers' ``a``.

Squaring once, after every sum is in, is what makes ``k`` micro-batches or ``N``
processes give the whole batch's statistic; squaring each piece's sum would drop the
cross terms between pieces, and dividing by the number of pieces rather than of samples
would weight uneven pieces wrongly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


class Finish:
    """How a statistic is made from its step's sums (see the subclasses)."""

    in_place = True  # the sums have the statistic's length and become it where they are

    def sums_length(self, length: int) -> int:
        """Entries of the sums behind a statistic of ``length`` entries."""
        return length


@dataclass(frozen=True)
class Mean(Finish):
    """``X = s * scale / n``; then ``X[-1] = last`` when ``last`` is given.

    Example:
        >>> s = torch.tensor([2.0, 6.0, 0.0])
        >>> FinishPlan([(Mean(last=1.0), s, s)])([4.0]); s
        tensor([0.5000, 1.5000, 1.0000])
    """

    scale: float = 1.0
    last: float | None = None


@dataclass(frozen=True)
class SquareMean(Finish):
    """``X = s**2 / n``: the square of a sum over the batch, divided by its size.

    Example:
        >>> s = torch.tensor([2.0, -4.0])
        >>> FinishPlan([(SquareMean(), s, s)])([2.0]); s
        tensor([2., 8.])
    """


@dataclass(frozen=True)
class NormActivation(Finish):
    """``X = [sum_t (s_t / n)**2, s[positions] / n**3]`` from ``positions + 1`` sums.

    Example:
        >>> s, out = torch.tensor([2.0, 4.0, 0.0, 12.0]), torch.zeros(2)
        >>> FinishPlan([(NormActivation(3), s, out)])([2.0]); out  # [1 + 4, 12 / 8]
        tensor([5.0000, 1.5000])
    """

    positions: int
    in_place = False

    def sums_length(self, length: int) -> int:
        return self.positions + 1


def inverse(n: float) -> float:
    """1 / n, NaN for nothing summed (the mean over nothing)."""
    return 1.0 / n if n else float("nan")


class FinishPlan:
    """Finishes a fixed list of statistics on one device, in a few batched operations.

    Made once for tensors that stay where they are (the collector keeps one per set of
    ready layers, as it keeps the fold): the views and the groups are worked out here.
    Calling it with the step's counts, one per statistic, finishes every statistic: the
    squares (one launch), every scaling by ``scale / n**power`` (one launch), the norm
    layers' sums of squares (one launch for all) and the constant entries.

    Args:
        items: ``(finish, sums, out)`` per statistic: ``out`` is ``sums`` itself when the
            finish is in place, else a tensor of the statistic's length.

    Example:
        >>> a, g = torch.tensor([3.0, 9.0, 0.0]), torch.tensor([3.0])
        >>> plan = FinishPlan([(Mean(last=1.0), a, a), (SquareMean(), g, g)])
        >>> plan([3.0, 3.0]); a, g
        (tensor([1., 3., 1.]), tensor([3.]))
    """

    def __init__(self, items: Sequence[tuple[Finish, torch.Tensor, torch.Tensor]]) -> None:
        self.squares: list[torch.Tensor] = []
        self.scaled: list[torch.Tensor] = []
        # per scaled tensor: (index of its statistic, scale, power of 1 / n)
        self.terms: list[tuple[int, float, int]] = []
        self.ends: list[torch.Tensor] = []
        self.constants: list[float] = []
        # the norm layers' sums whose sum of squares goes to an entry of their statistic
        self.square_sums: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        self.copies: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        for i, (finish, sums, out) in enumerate(items):
            if finish.in_place and out is not sums:
                raise ValueError(f"{type(finish).__name__} finishes its sums in place")
            if isinstance(finish, SquareMean):
                self.squares.append(sums)
                self._scale(i, sums, 1.0, 1)
            elif isinstance(finish, Mean):
                self._scale(i, sums, finish.scale, 1)
                if finish.last is not None:
                    self.ends.append(out[-1:])
                    self.constants.append(finish.last)
            elif isinstance(finish, NormActivation):
                k = finish.positions
                self._scale(i, sums[:k], 1.0, 1)
                self._scale(i, sums[k:], 1.0, 3)
                self.square_sums[0].append(sums[:k])
                self.square_sums[1].append(out[0])
                self.copies[0].append(out[1:])
                self.copies[1].append(sums[k:])
            else:
                raise TypeError(f"no batched finish for {type(finish).__name__}")
        self.device_terms: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        # the last host counts and their multipliers: a step that counts what the one
        # before it counted (every step of a steady run) reuses them
        self.host_terms: tuple[tuple[float, ...], list[float]] = ((), [])

    def _scale(self, index: int, t: torch.Tensor, scale: float, power: int) -> None:
        self.scaled.append(t)
        self.terms.append((index, scale, power))

    def multipliers(self, counts: Sequence[float] | torch.Tensor) -> list:
        """``scale / n**power`` per scaled tensor: Python floats from host counts, or 0-dim
        tensors computed on the device from a device vector of counts (no host sync)."""
        if not isinstance(counts, torch.Tensor):
            counts = tuple(counts)
            if counts != self.host_terms[0]:
                terms = self.terms
                self.host_terms = (counts, [s * inverse(counts[i]) ** p for i, s, p in terms])
            return self.host_terms[1]
        if self.device_terms is None:
            index, scales, powers = zip(*self.terms, strict=True)
            device = counts.device
            self.device_terms = (
                torch.tensor(index, device=device),
                torch.tensor(scales, dtype=counts.dtype, device=device),
                torch.tensor(powers, dtype=counts.dtype, device=device),
            )
        index, scales, powers = self.device_terms
        return list(counts.index_select(0, index).pow(-powers).mul_(scales).unbind())

    def __call__(self, counts: Sequence[float] | torch.Tensor) -> None:
        """Finishes every statistic; ``counts[i]`` is the step's count of statistic ``i``."""
        if self.squares:
            torch._foreach_mul_(self.squares, self.squares)
        if self.scaled:
            torch._foreach_mul_(self.scaled, self.multipliers(counts))
        if self.square_sums[0]:
            # one launch for all layers, rather than a product each
            norms = torch._foreach_norm(self.square_sums[0])
            torch._foreach_mul_(norms, norms)
            torch._foreach_copy_(self.square_sums[1], norms)
        if self.copies[0]:
            torch._foreach_copy_(*self.copies)
        if self.ends:
            torch._foreach_zero_(self.ends)
            torch._foreach_add_(self.ends, self.constants)
