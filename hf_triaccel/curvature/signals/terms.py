"""A module's Fisher ``F - damping`` as outer-product terms, and what the signals read
from it without materialising it: the mean of its entries and the share of its mass
held by its largest entries.

Every layout in :mod:`hf_triaccel.curvature.rules` -- weights stored (out, in) or (in,
out), biases and normalisation affines (one shared ``a`` entry) -- pairs each ``g`` entry
of its segment with each ``a`` entry of its segment equally often, so a parameter's
entries are ``mult`` copies of the outer product of two segments (:class:`FactorTerm`)
and their mean is exactly ``mean(g segment) * mean(a segment)``. A custom layout that is
not such a product is materialised for that parameter instead.

The top-entries share is computed on the factorisation, not on the vectors: the threshold
of the top entries is found by multi-section over the products ``g_i * a_j``, counting and
summing the products above a threshold with one ``searchsorted`` per ``g`` entry into the
sorted ``a`` segment (relative resolution ``16**-8``; factors are non-negative, being
min-max normalised statistics).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hf_triaccel._types import FactorLayout
from hf_triaccel.curvature.collection.layer import LayerFactors

# multi-section search for the top-entries threshold: WAYS candidates per round
_WAYS = 16
_ROUNDS = 8


@dataclass(frozen=True)
class FactorTerm:
    """``mult`` copies of the outer product ``g x a``: part of a module's ``F - damping``."""

    g: torch.Tensor
    a: torch.Tensor
    mult: int


def _digit_is_uniform(numel: int, div: int, mod: int) -> bool:
    return numel % (div * mod) == 0


def kronecker_term(
    layout: FactorLayout, numel: int, g: torch.Tensor, a: torch.Tensor
) -> FactorTerm | None:
    """The parameter's entries as ``mult`` copies of an outer product, when they are one.

    Element ``k`` reads ``g[(k // g_div) % g_mod]`` and ``a[(k // a_div) % a_mod + a_off]``:
    two digits of ``k``. Every (g, a) pair occurs equally often when one digit is constant
    (``mod == 1``) and the other cycles whole periods, or when the faster digit completes
    whole periods inside one step of the slower one.

    Example:
        >>> g, a = torch.arange(2.0), torch.arange(4.0)
        >>> kronecker_term(FactorLayout(g_div=3, g_mod=2, a_div=1, a_mod=3), 6, g, a).a
        tensor([0., 1., 2.])
    """
    (d1, m1), (d2, m2) = sorted([(layout.g_div, layout.g_mod), (layout.a_div, layout.a_mod)])
    if m1 == 1 or m2 == 1:
        div, mod = (d2, m2) if m1 == 1 else (d1, m1)
        uniform = mod == 1 or _digit_is_uniform(numel, div, mod)
    else:
        uniform = d2 % (d1 * m1) == 0 and _digit_is_uniform(numel, d2, m2)
    if not uniform:
        return None
    g_seg = g[: layout.g_mod]
    a_seg = a[layout.a_off : layout.a_off + layout.a_mod]
    return FactorTerm(g_seg, a_seg, numel // (layout.g_mod * layout.a_mod))


def factor_terms(layer: LayerFactors) -> tuple[list[FactorTerm], int]:
    """The module's ``F - damping`` entries as outer-product terms, and their count."""
    g, a = layer.g.detach().float(), layer.a.detach().float()
    terms, total = [], 0
    for attr, layout in layer.layouts.items():
        numel = getattr(layer.module, attr).numel()
        total += numel
        term = kronecker_term(layout, numel, g, a)
        if term is None:  # a custom layout: materialise this parameter's entries
            gi, ai = layout.indices(numel, g.device)
            term = FactorTerm(g.new_ones(1), g[gi] * a[ai], 1)
        terms.append(term)
    return terms, total


def mean_entry(terms: list[FactorTerm], total: int) -> torch.Tensor:
    """Mean of the ``total`` entries the terms describe (a 0-d tensor on the factors'
    device): the curvature signal.

    Example:
        >>> term = FactorTerm(torch.tensor([1.0, 3.0]), torch.tensor([2.0, 4.0]), mult=2)
        >>> mean_entry([term], 8)  # the mean of g times the mean of a
        tensor(6.)
    """
    return sum(t.mult * t.g.sum() * t.a.sum() for t in terms) / total


def top_share(terms: list[FactorTerm], total: int, fraction: float) -> torch.Tensor:
    """Share of the entries' sum held by the largest ``ceil(fraction * total)`` entries.

    One module's :func:`top_shares`.

    Example:
        >>> g, a = torch.tensor([1.0, 0.0]), torch.tensor([1.0, 1.0, 1.0, 1.0, 6.0])
        >>> round(top_share([FactorTerm(g, a, 1)], 10, 0.1).item(), 6)  # 6 of 10
        0.6
    """
    return top_shares([(terms, total)], fraction)[0]


@dataclass
class _TermChunk:
    """Terms of similar size, padded to one shape (float64, on the factors' device).

    ``outer`` (T, O) is zero-padded (a zero entry never reaches a positive threshold);
    ``inner`` (T, I) is sorted with ``+inf`` padding; ``suffix`` (T, I + 1) holds the sums
    of each row's real entries from each position on (zero past them).
    """

    owner: torch.Tensor  # (T,) index of the module each term belongs to
    mult: torch.Tensor  # (T,) int64
    length: torch.Tensor  # (T,) int64, real entries of each inner row
    outer: torch.Tensor
    inner: torch.Tensor
    suffix: torch.Tensor


# elements of one (terms, thresholds, outer entries) block of the search: bounds its memory
SEARCH_BLOCK = 1 << 20


def _term_chunks(pairs: list[tuple[int, FactorTerm]]) -> list[_TermChunk]:
    """The terms as few padded chunks, each within :data:`SEARCH_BLOCK` per round."""
    rows = []
    for owner, t in pairs:
        outer, inner = (t.g, t.a) if t.g.numel() <= t.a.numel() else (t.a, t.g)
        rows.append((owner, t.mult, outer.double().clamp_min(0.0), inner.double().clamp_min(0.0)))
    # similar outer sizes together, so that little of a chunk is padding
    rows.sort(key=lambda r: (r[2].numel(), r[3].numel()))
    chunks, start = [], 0
    while start < len(rows):
        stop = start + 1
        while stop < len(rows) and (stop + 1 - start) * _WAYS * rows[stop][2].numel() <= (
            SEARCH_BLOCK
        ):
            stop += 1
        part = rows[start:stop]
        device = part[0][2].device
        inner = torch.nn.utils.rnn.pad_sequence(
            [r[3].sort().values for r in part], batch_first=True, padding_value=math.inf
        )
        real = torch.nan_to_num(inner, posinf=0.0)
        suffix = torch.cat([real.flip(1).cumsum(1).flip(1), real.new_zeros(len(part), 1)], 1)
        chunks.append(
            _TermChunk(
                owner=torch.tensor([r[0] for r in part], device=device),
                mult=torch.tensor([r[1] for r in part], device=device),
                length=torch.tensor([r[3].numel() for r in part], device=device),
                outer=torch.nn.utils.rnn.pad_sequence([r[2] for r in part], batch_first=True),
                inner=inner,
                suffix=suffix,
            )
        )
        start = stop
    return chunks


def top_shares(modules: list[tuple[list[FactorTerm], int]], fraction: float) -> torch.Tensor:
    """For each module (its terms and entry count): the share of its entries' sum held by
    its largest ``ceil(fraction * count)`` entries, as one float64 tensor.

    Computed on the factorisations in float64, for all modules at once and without a host
    sync: a multi-section search over each module's threshold ``t`` keeps
    ``count(v >= lo) >= k > count(v >= hi)``; at the end the top-k sum is the sum above
    ``hi`` plus the missing entries valued at ``lo``. Counting the entries of ``g x a``
    at or above ``t`` is one batched ``searchsorted`` of ``t / outer`` in the sorted inner
    factor, so the operations per round do not grow with the number of modules.

    Example:
        >>> term = FactorTerm(torch.tensor([1.0, 1.0]), torch.tensor([1.0, 3.0]), 1)
        >>> [round(v, 6) for v in top_shares([([term], 4), ([term], 4)], 0.5).tolist()]
        [0.75, 0.75]
    """
    n = len(modules)
    pairs = [(i, t) for i, (terms, _) in enumerate(modules) for t in terms]
    chunks = _term_chunks(pairs)
    device = chunks[0].outer.device
    totals = torch.tensor([total for _, total in modules], dtype=torch.float64, device=device)
    k = (fraction * totals).ceil().clamp_min(1.0)
    mass = totals.new_zeros(n)
    hi = totals.new_zeros(n)
    for c in chunks:
        real_inner = c.suffix[:, 0]
        mass.index_add_(0, c.owner, c.mult * c.outer.sum(1) * real_inner)
        peak = c.outer.max(1).values * torch.nan_to_num(c.inner, posinf=0.0).max(1).values
        hi.scatter_reduce_(0, c.owner, peak, reduce="amax")
    hi = hi * (1.0 + 1e-9) + 1e-300  # strictly above every entry: count(v >= hi) = 0
    lo = torch.zeros_like(hi)

    def count_and_sum(thresholds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # thresholds (n, w) -> entries at or above each, and their sum, per module
        count = torch.zeros(thresholds.shape, dtype=torch.int64, device=device)
        above = torch.zeros_like(thresholds)
        for c in chunks:
            t = thresholds[c.owner]  # (T, w)
            # first position of inner >= t / outer_i: entries g_i * a_j >= t (t / 0 = inf)
            q = t[:, :, None] / c.outer[:, None, :]  # (T, w, O)
            idx = torch.searchsorted(c.inner, q.flatten(1)).view(q.shape)
            per_term = (c.length[:, None, None] - idx).sum(2) * c.mult[:, None]
            sums = c.suffix.gather(1, idx.flatten(1)).view(q.shape)
            count.index_add_(0, c.owner, per_term)
            above.index_add_(0, c.owner, (c.outer[:, None, :] * sums).sum(2) * c.mult[:, None])
        return count, above

    ways = torch.arange(1, _WAYS + 1, device=device, dtype=torch.float64) / _WAYS
    for _ in range(_ROUNDS):
        width = hi - lo
        count, _ = count_and_sum(lo[:, None] + width[:, None] * ways)
        passed = (count >= k[:, None]).sum(1).to(torch.float64)  # count falls with t
        lo, hi = lo + width * passed / _WAYS, lo + width * (passed + 1) / _WAYS
    count_hi, above_hi = count_and_sum(hi[:, None])
    top = above_hi[:, 0] + (k - count_hi[:, 0]) * lo
    return torch.where(mass > 0, top / mass.clamp_min(1e-300), k / totals)
