"""Per-module second-order signals from state the optimizer already holds.

:class:`SignalTracker` computes, every ``every`` optimizer steps (default 200), one row of
signals per module of a :class:`~hf_triaccel.curvature.collector.FisherCollector`, with no
extra forward or backward pass:

curvature ``c``
    The mean over the module's preconditioned entries of ``F - damping = g_i * a_j`` (so
    ``c`` does not depend on the damping), computed on the factors without materialising
    ``F`` (:func:`~hf_triaccel.curvature.signals.terms.mean_entry`). The module's ``c`` is the
    element-weighted mean over its parameters.
concentration
    The share of the module's factor mass ``sum(F - damping)`` held by its largest 10%
    entries (``ceil(0.1 * N)`` of its ``N`` entries), again on the factorisation
    (:func:`~hf_triaccel.curvature.signals.terms.top_shares`). A flat Fisher gives 0.1, a Fisher
    held by few entries values near 1.
gradient noise ratio ``v``
    ``mean(E[g^2] - E[g]^2) / mean(E[g^2])`` over the module's gradient elements, from EMAs
    kept for ``noise_samples`` sampled elements per parameter (see
    :mod:`hf_triaccel.curvature.signals.noise`). They are updated by an optimizer step pre-hook
    every ``noise_every`` steps, from the unscaled gradient about to be applied; ``nan``
    until two samples were taken.
sensitivity ``s = c * ||W||^2 * v``
    ``||W||^2`` being the squared norm of the module's preconditioned parameters. A
    HAWQ-like score: ``c * ||W||^2`` approximates the loss change from a relative
    perturbation of the module's weights (as low-precision rounding causes), weighted by
    the gradient noise ratio.

The tracker follows an optimizer through its step hooks (:meth:`SignalTracker.attach`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from hf_triaccel.curvature.collection.layer import LayerFactors
from hf_triaccel.curvature.collection.sharding import is_sharded
from hf_triaccel.curvature.collector import FisherCollector
from hf_triaccel.curvature.signals.noise import noise_probes, noise_ratio, update_probes
from hf_triaccel.curvature.signals.terms import factor_terms, mean_entry, top_shares

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

    Raises:
        NotImplementedError: the collector's parameters are sharded by FSDP2 (here, or at
            an evaluation when they were sharded after the tracker was built).

    Attributes:
        signals: the latest signals by module name (empty before the first evaluation).
        steps: optimizer steps seen since :meth:`attach`.

    Example:
        >>> from torch import nn
        >>> collector = FisherCollector(nn.Linear(4, 2))
        >>> tracker = SignalTracker(collector)
        >>> tracker.compute()[""].curvature  # factors start at zeros
        0.0
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
        params = self._params()
        generator = torch.Generator().manual_seed(seed)
        self._probes = noise_probes(params, noise_samples, generator)
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
        if self.steps % self.noise_every == 0:
            update_probes(self._probes.values(), self.noise_beta)

    def _after_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        self.steps += 1
        fresh = self.compute() if self.steps % self.every == 0 else None
        for fn in list(self._listeners.values()):
            fn(self.steps, fresh)

    def _params(self) -> dict[str, torch.Tensor]:
        """The collector's parameters by probe key; refuses FSDP2-sharded ones."""
        params = {
            _probe_key(name, attr): getattr(layer.module, attr)
            for name, layer in self.collector.layers.items()
            for attr in layer.layouts
        }
        sharded = [key for key, p in params.items() if is_sharded(p)]
        if sharded:
            raise NotImplementedError(
                f"the curvature signals (adaptive precision, step-size steering) do not support "
                f"parameters sharded by FSDP2 (DTensor), such as {sharded[0]!r}: turn them off "
                "under FSDP2, or train with DDP or on one device"
            )
        return params

    @torch.no_grad()
    def compute(self) -> dict[str, ModuleSignals]:
        """Computes the signals now, stores them in :attr:`signals` and returns them.

        Everything stays on the device until one copy of all values at the end.

        Raises:
            NotImplementedError: the model's parameters are sharded by FSDP2.
        """
        self._params()  # sharded since the tracker was built: the signals would be per shard
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
                        mean_entry(terms, total).double(),
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
        probes = [self._probes[_probe_key(name, attr)] for attr in layer.layouts]
        return noise_ratio(probes, self.noise_beta, layer.g.device)

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
