"""Per-module second-order signals from state the optimizer already holds.

:class:`SignalTracker` computes, every ``every`` optimizer steps (default 200), one row of
signals per module of a :class:`~hf_triaccel.curvature.collector.FisherCollector`, with no
extra forward or backward pass:

curvature ``c``
    The mean over the module's preconditioned entries of ``F - damping = g_i * a_j``
    (so ``c`` does not depend on the damping). Every layout in
    :mod:`hf_triaccel.curvature.rules` -- weights stored (out, in) or (in, out), biases and
    normalisation affines (one shared ``a`` entry) -- pairs each ``g`` entry of its segment
    with each ``a`` entry of its segment equally often, so the mean of that parameter's
    entries is exactly ``mean(g segment) * mean(a segment)`` (for a Linear weight: the mean of
    ``g`` times the mean of ``a`` over the weight's columns, without the bias entry). The
    module's ``c`` is the element-weighted mean over its parameters. A custom layout that
    is not such a product is materialised for that parameter instead.
concentration
    The share of the module's factor mass ``sum(F - damping)`` held by its largest 10%
    entries (``ceil(0.1 * N)`` of its ``N`` entries), computed on the factorisation, not on
    the vectors: the threshold of the top entries is found by multi-section over the
    products ``g_i * a_j``, counting and summing the products above a threshold with one
    ``searchsorted`` per ``g`` entry into the sorted ``a`` segment (relative resolution
    ``16**-8``; factors are non-negative, being min-max normalised statistics). A flat
    Fisher gives 0.1, a Fisher held by few entries values near 1.
gradient noise ratio ``v``
    ``mean(E[g^2] - E[g]^2) / mean(E[g^2])`` over the module's gradient elements, the
    expectations being exponential moving averages over optimizer steps. Elementwise EMAs
    would cost two buffers the size of every parameter; instead each parameter gets a fixed
    random subset of ``noise_samples`` elements (all of them when it is smaller), chosen once
    with a seeded generator, and EMAs of ``g`` and ``g^2`` are kept for those elements only
    (O(1) memory per tensor). They are updated by an optimizer step pre-hook every
    ``noise_every`` steps, from the unscaled gradient about to be applied. At read time the
    EMAs are bias-corrected and the variance is made unbiased for the EMA's effective sample
    size (reliability weights: divided by ``1 - sum(w^2) / sum(w)^2``); per parameter the
    subset means estimate the means over all its elements, and a module's ratio weights its
    parameters by their sizes; the ratio is clipped to [0, 1], where the true value lies.
    ``nan`` until two samples were taken. Drift of the mean gradient within the EMA window
    counts as noise.
sensitivity ``s = c * ||W||^2 * v``
    ``||W||^2`` being the squared norm of the module's preconditioned parameters. A
    HAWQ-like score: ``c * ||W||^2`` approximates the loss change from a relative
    perturbation of the module's weights (as low-precision rounding causes), weighted by
    the gradient noise ratio.

Example:
    >>> from torch import nn
    >>> from hf_triaccel import AdaFisherW
    >>> model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    >>> optimizer = AdaFisherW.from_model(model, lr=1e-3)
    >>> tracker = SignalTracker(optimizer.collector, optimizer, every=2)
    >>> for _ in range(2):
    ...     model(torch.randn(4, 8)).square().mean().backward()
    ...     optimizer.step()
    ...     optimizer.zero_grad()
    >>> sorted(tracker.signals)
    ['0', '2']
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from hf_triaccel.curvature.collector import FisherCollector, LayerFactors
from hf_triaccel.curvature.rules import FactorLayout

# multi-section search for the top-entries threshold: WAYS candidates per round
_WAYS = 16
_ROUNDS = 8

Listener = Callable[[int, "dict[str, ModuleSignals] | None"], None]


@dataclass(frozen=True)
class ModuleSignals:
    """The signals of one module at one evaluation (see the module docstring)."""

    name: str
    kind: str
    params: int
    curvature: float
    concentration: float
    noise: float
    weight_norm_sq: float
    sensitivity: float


@dataclass(frozen=True)
class _Term:
    """``mult`` copies of the outer product ``g x a``: part of a module's ``F - damping``."""

    g: torch.Tensor
    a: torch.Tensor
    mult: int


def _digit_is_uniform(numel: int, div: int, mod: int) -> bool:
    return numel % (div * mod) == 0


def _kronecker_term(
    layout: FactorLayout, numel: int, g: torch.Tensor, a: torch.Tensor
) -> _Term | None:
    """The parameter's entries as ``mult`` copies of an outer product, when they are one.

    Element ``k`` reads ``g[(k // g_div) % g_mod]`` and ``a[(k // a_div) % a_mod + a_off]``:
    two digits of ``k``. Every (g, a) pair occurs equally often when one digit is constant
    (``mod == 1``) and the other cycles whole periods, or when the faster digit completes
    whole periods inside one step of the slower one.
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
    return _Term(g_seg, a_seg, numel // (layout.g_mod * layout.a_mod))


def factor_terms(layer: LayerFactors) -> tuple[list[_Term], int]:
    """The module's ``F - damping`` entries as outer-product terms, and their count."""
    g, a = layer.g.detach().float(), layer.a.detach().float()
    terms, total = [], 0
    for attr, layout in layer.layouts.items():
        numel = getattr(layer.module, attr).numel()
        total += numel
        term = _kronecker_term(layout, numel, g, a)
        if term is None:  # a custom layout: materialise this parameter's entries
            gi, ai = layout.indices(numel, g.device)
            term = _Term(g.new_ones(1), g[gi] * a[ai], 1)
        terms.append(term)
    return terms, total


def curvature(terms: list[_Term], total: int) -> torch.Tensor:
    """Mean of the entries the terms describe (a 0-d tensor on the factors' device)."""
    return sum(t.mult * t.g.sum() * t.a.sum() for t in terms) / total


def top_share(terms: list[_Term], total: int, fraction: float) -> torch.Tensor:
    """Share of the entries' sum held by the largest ``ceil(fraction * total)`` entries.

    One module's :func:`top_shares`.

    Example:
        >>> term = _Term(torch.tensor([1.0, 0.0]), torch.tensor([1.0, 1.0, 1.0, 1.0, 6.0]), 1)
        >>> round(top_share([term], 10, 0.1).item(), 6)
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
_SEARCH_BLOCK = 1 << 20


def _term_chunks(pairs: list[tuple[int, _Term]]) -> list[_TermChunk]:
    """The terms as few padded chunks, each within :data:`_SEARCH_BLOCK` per round."""
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
            _SEARCH_BLOCK
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


def top_shares(modules: list[tuple[list[_Term], int]], fraction: float) -> torch.Tensor:
    """For each module (its terms and entry count): the share of its entries' sum held by
    its largest ``ceil(fraction * count)`` entries, as one float64 tensor.

    Computed on the factorisations in float64, for all modules at once and without a host
    sync: a multi-section search over each module's threshold ``t`` keeps
    ``count(v >= lo) >= k > count(v >= hi)``; at the end the top-k sum is the sum above
    ``hi`` plus the missing entries valued at ``lo``. Counting the entries of ``g x a``
    at or above ``t`` is one batched ``searchsorted`` of ``t / outer`` in the sorted inner
    factor, so the operations per round do not grow with the number of modules.

    Example:
        >>> term = _Term(torch.tensor([1.0, 1.0]), torch.tensor([1.0, 3.0]), 1)
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


class _NoiseProbe:
    """EMAs of ``g`` and ``g^2`` at a fixed subset (``index``) of one parameter's elements."""

    def __init__(
        self, param: nn.Parameter, index: torch.Tensor, m1: torch.Tensor, m2: torch.Tensor
    ) -> None:
        self.param = param
        self.index = index
        self.m1 = m1
        self.m2 = m2
        self.count = 0

    def sample(self) -> torch.Tensor | None:
        grad = self.param.grad
        if grad is None or grad.is_sparse:
            return None
        if self.index.device != grad.device:  # the model moved
            self.index, self.m1, self.m2 = (
                t.to(grad.device) for t in (self.index, self.m1, self.m2)
            )
        # one operation per parameter (a reshape would be a second): the sampling runs
        # for every parameter every few steps of a host-bound loop
        return grad.take(self.index).float()

    def moments(self, beta: float) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(mean unbiased variance, mean E[g^2]) over the subset, or ``None`` (< 2 samples)."""
        if self.count < 2:
            return None
        n = self.count
        w_sum = 1.0 - beta**n
        w_sq = (1.0 - beta) ** 2 * (1.0 - beta ** (2 * n)) / (1.0 - beta**2)
        e1, e2 = self.m1 / w_sum, self.m2 / w_sum
        var = (e2 - e1 * e1).clamp_min(0.0) / (1.0 - w_sq / w_sum**2)
        return var.mean(), e2.mean()


def _noise_probes(
    params: dict[str, nn.Parameter], samples: int, generator: torch.Generator
) -> dict[str, _NoiseProbe]:
    """A probe per parameter, its indices and EMAs being views of three buffers per device:
    three tensors per parameter would each take an allocator block of at least 512 bytes,
    50 times what a probe holds."""
    indices = {}
    for key, param in params.items():
        n = param.numel()
        # randint, not randperm: a permutation of a large embedding would be big
        indices[key] = (
            torch.arange(n) if n <= samples else torch.randint(n, (samples,), generator=generator)
        )
    probes = {}
    for device in {p.device for p in params.values()}:
        keys = [k for k, p in params.items() if p.device == device]
        sizes = [indices[k].numel() for k in keys]
        index = torch.cat([indices[k] for k in keys]).to(device)
        m1 = torch.zeros(index.numel(), device=device)
        m2 = torch.zeros_like(m1)
        parts = zip(keys, index.split(sizes), m1.split(sizes), m2.split(sizes), strict=True)
        for key, i, a, b in parts:
            probes[key] = _NoiseProbe(params[key], i, a, b)
    return {key: probes[key] for key in params}


class SignalTracker:
    """Curvature, Fisher concentration, gradient noise and sensitivity per module.

    Args:
        collector: the Fisher collector whose factors the signals read.
        optimizer: when given, :meth:`attach` is called with it.
        every: compute the signals every this many optimizer steps.
        top_fraction: the share of entries whose mass the concentration measures.
        noise_samples: gradient elements sampled per parameter for the noise ratio.
        noise_every: sample the gradients every this many optimizer steps.
        noise_beta: EMA coefficient of the gradient moments, per sample.
        seed: seeds the choice of sampled elements.

    Attributes:
        signals: the latest signals by module name (empty before the first evaluation).
        steps: optimizer steps seen since :meth:`attach`.

    Example:
        >>> from torch import nn
        >>> collector = FisherCollector(nn.Linear(4, 2))
        >>> tracker = SignalTracker(collector)
        >>> tracker.compute()[""].curvature  # factors start at ones
        1.0
    """

    def __init__(
        self,
        collector: FisherCollector,
        optimizer: Optimizer | None = None,
        *,
        every: int = 200,
        top_fraction: float = 0.1,
        noise_samples: int = 32,
        noise_every: int = 4,
        noise_beta: float = 0.95,
        seed: int = 0,
    ) -> None:
        if not isinstance(collector, FisherCollector):
            raise TypeError(f"collector must be a FisherCollector, got {type(collector).__name__}")
        for name, value in (
            ("every", every),
            ("noise_samples", noise_samples),
            ("noise_every", noise_every),
        ):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: needs an int >= 1")
        if not 0.0 < top_fraction <= 1.0:
            raise ValueError(f"top_fraction={top_fraction}: needs 0 < top_fraction <= 1")
        if not 0.0 < noise_beta < 1.0:
            raise ValueError(f"noise_beta={noise_beta}: needs 0 < noise_beta < 1")
        self.collector = collector
        self.every = every
        self.top_fraction = top_fraction
        self.noise_every = noise_every
        self.noise_beta = noise_beta
        self.steps = 0
        self.signals: dict[str, ModuleSignals] = {}
        params = {
            _probe_key(name, attr): getattr(layer.module, attr)
            for name, layer in collector.layers.items()
            for attr in layer.layouts
        }
        generator = torch.Generator().manual_seed(seed)
        self._probes = _noise_probes(params, noise_samples, generator)
        self._listeners: OrderedDict[int, Listener] = OrderedDict()
        self._handles: list[RemovableHandle] = []
        if optimizer is not None:
            self.attach(optimizer)

    def attach(self, optimizer: Optimizer) -> None:
        """Registers the step hooks: gradient sampling before each step, step counting
        and the evaluation every ``every`` steps after it.

        Wrappers that hold the real optimizer as ``.optimizer`` (Accelerate's
        ``AcceleratedOptimizer``) are unwrapped: their ``step`` calls the inner one,
        which is where hooks run, and only on steps that are actually taken.
        """
        if self._handles:
            raise RuntimeError("the tracker is already attached to an optimizer")
        while isinstance(getattr(optimizer, "optimizer", None), Optimizer):
            optimizer = optimizer.optimizer
        self._handles = [
            optimizer.register_step_pre_hook(self._sample),
            optimizer.register_step_post_hook(self._after_step),
        ]

    @property
    def attached(self) -> bool:
        """Whether the tracker follows an optimizer's steps."""
        return bool(self._handles)

    def add_listener(self, fn: Listener) -> RemovableHandle:
        """Calls ``fn(step, signals)`` after every optimizer step; ``signals`` is the fresh
        evaluation on evaluation steps, else ``None``. Returns a removable handle."""
        handle = RemovableHandle(self._listeners)
        self._listeners[handle.id] = fn
        return handle

    def _sample(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        if self.steps % self.noise_every:
            return
        with torch.no_grad():
            probes, samples = [], []
            for probe in self._probes.values():
                s = probe.sample()
                if s is not None:
                    probes.append(probe)
                    samples.append(s)
            if not probes:
                return
            m1s, m2s = [p.m1 for p in probes], [p.m2 for p in probes]
            b = self.noise_beta
            torch._foreach_mul_(m1s, b)
            torch._foreach_add_(m1s, samples, alpha=1.0 - b)
            torch._foreach_mul_(m2s, b)
            torch._foreach_add_(m2s, torch._foreach_mul(samples, samples), alpha=1.0 - b)
        for p in probes:
            p.count += 1

    def _after_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        self.steps += 1
        fresh = self.compute() if self.steps % self.every == 0 else None
        for fn in list(self._listeners.values()):
            fn(self.steps, fresh)

    @torch.no_grad()
    def compute(self) -> dict[str, ModuleSignals]:
        """Computes the signals now, stores them in :attr:`signals` and returns them.

        Everything stays on the device until one copy of all values at the end.
        """
        rows, factored = [], []
        for name, layer in self.collector.layers.items():
            terms, total = factor_terms(layer)
            params = [getattr(layer.module, attr) for attr in layer.layouts]
            weight_sq = torch.stack([p.detach().float().square().sum() for p in params]).sum()
            factored.append((terms, total))
            rows.append(
                (
                    name,
                    layer,
                    total,
                    [
                        curvature(terms, total).double(),
                        self._noise(name, layer).double(),
                        weight_sq.double(),
                    ],
                )
            )
        if not rows:
            self.signals = {}
            return {}
        concentration = top_shares(factored, self.top_fraction)
        device = concentration.device
        others = torch.stack([v.to(device) for *_, vs in rows for v in vs]).view(len(rows), 3)
        values = torch.cat([others[:, :1], concentration[:, None], others[:, 1:]], 1)
        self.signals = {}
        for (name, layer, total, _), (c, conc, v, wsq) in zip(rows, values.tolist(), strict=True):
            self.signals[name] = ModuleSignals(
                name=name,
                kind=type(layer.module).__name__,
                params=total,
                curvature=c,
                concentration=conc,
                noise=v,
                weight_norm_sq=wsq,
                sensitivity=c * wsq * v,
            )
        return self.signals

    def _noise(self, name: str, layer: LayerFactors) -> torch.Tensor:
        var_sum = e2_sum = None
        for attr in layer.layouts:
            probe = self._probes[_probe_key(name, attr)]
            moments = probe.moments(self.noise_beta)
            if moments is None:
                continue
            n = probe.param.numel()
            var_sum = moments[0] * n if var_sum is None else var_sum + moments[0] * n
            e2_sum = moments[1] * n if e2_sum is None else e2_sum + moments[1] * n
        if var_sum is None:
            return torch.tensor(float("nan"), device=layer.g.device)
        # identically zero gradients carry no noise; the true ratio lies in [0, 1], the
        # estimate (unbiased numerator over unbiased denominator) may stray above 1
        ratio = (var_sum / e2_sum.clamp_min(1e-30)).clamp_max(1.0)
        return torch.where(e2_sum > 0, ratio, torch.zeros_like(e2_sum))

    def as_dict(self) -> dict[str, dict[str, Any]]:
        """The latest signals as plain data, by module name."""
        return {
            name: {k: v for k, v in asdict(s).items() if k != "name"}
            for name, s in self.signals.items()
        }

    def table(self) -> str:
        """The latest signals as a readable table, one module per line.

        Example:
            >>> from torch import nn
            >>> tracker = SignalTracker(FisherCollector(nn.Linear(4, 2)))
            >>> _ = tracker.compute()
            >>> print(tracker.table().splitlines()[0].split())
            ['module', 'type', 'params', 'curvature', 'concentration', 'noise', 'sensitivity']
        """
        header = ("module", "type", "params", "curvature", "concentration", "noise", "sensitivity")
        lines = [
            (
                s.name or "(root)",
                s.kind,
                f"{s.params:,}",
                f"{s.curvature:.4g}",
                f"{s.concentration:.3f}",
                f"{s.noise:.3f}",
                f"{s.sensitivity:.4g}",
            )
            for s in self.signals.values()
        ]
        widths = [max(len(row[i]) for row in [header, *lines]) for i in range(len(header))]
        return "\n".join(
            "  ".join(
                cell.ljust(w) if i < 2 else cell.rjust(w)
                for i, (cell, w) in enumerate(zip(row, widths, strict=True))
            ).rstrip()
            for row in [header, *lines]
        )

    def state_dict(self) -> dict[str, Any]:
        """Step count, gradient-moment EMAs (with their sampled elements) and the latest signals."""
        return {
            "steps": self.steps,
            "probes": {
                key: {"index": p.index.cpu(), "m1": p.m1.cpu(), "m2": p.m2.cpu(), "count": p.count}
                for key, p in self._probes.items()
            },
            "signals": self.as_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores what :meth:`state_dict` saved; the modules must match."""
        missing = set(self._probes) - set(state["probes"])
        extra = set(state["probes"]) - set(self._probes)
        if missing or extra:
            raise KeyError(
                f"signal state does not match the model: missing {sorted(missing)[:5]}, "
                f"unexpected {sorted(extra)[:5]}"
            )
        for key, probe in self._probes.items():
            saved = state["probes"][key]
            if saved["index"].shape != probe.index.shape:
                raise ValueError(
                    f"signal state samples {saved['index'].numel()} gradient elements of "
                    f"{key!r}, this tracker {probe.index.numel()}: build it with the same "
                    "noise_samples"
                )
            # in place: the probes are views of shared buffers
            probe.index.copy_(saved["index"])
            probe.m1.copy_(saved["m1"])
            probe.m2.copy_(saved["m2"])
            probe.count = int(saved["count"])
        self.steps = int(state["steps"])
        self.signals = {
            name: ModuleSignals(name=name, **row) for name, row in state["signals"].items()
        }

    def remove(self) -> None:
        """Removes the optimizer hooks and every listener."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self._listeners.clear()

    def __repr__(self) -> str:
        n = len(self.collector.layers)
        return f"SignalTracker(modules={n}, every={self.every}, steps={self.steps})"


def _probe_key(module: str, attr: str) -> str:
    return f"{module}.{attr}" if module else attr
