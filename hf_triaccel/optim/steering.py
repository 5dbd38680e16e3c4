"""Per-module step sizes from the curvature signal (experimental, off by default).

:class:`StepSizeSteering` gives each module of a :class:`SignalTracker` a step-size scale,
re-decided at every evaluation of the tracker::

    scale = clamp((median curvature / module curvature) ** power, min_scale, max_scale)

so that modules in flatter directions than the median take longer steps and those in
sharper ones shorter steps (the median is over the modules with a finite, positive
curvature; the others keep scale 1). The scale is applied by multiplying each of the
module's parameter gradients in an optimizer step pre-hook. AdaFisher's update is linear
in the gradient (a momentum average, then a preconditioner built from activation and
output-gradient statistics, not from ``.grad``), so this scales the module's step as a
per-module learning rate would; the weight-decay term is not scaled. Other optimizers,
Adam above all, normalise the gradient away, hence AdaFisher only.

The tracker's gradient sampling runs first (it was registered first) and sees the
gradients unscaled. Gradient clipping, done by the Trainer before ``optimizer.step()``,
sees them unscaled too.

Example:
    >>> from torch import nn
    >>> from hf_triaccel import AdaFisher
    >>> model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    >>> optimizer = AdaFisher.from_model(model, lr=1e-3)
    >>> tracker = SignalTracker(optimizer.collector, optimizer, every=2)
    >>> steering = StepSizeSteering(tracker, optimizer)
    >>> for _ in range(2):
    ...     model(torch.randn(4, 8)).square().mean().backward()
    ...     optimizer.step()
    ...     optimizer.zero_grad()
    >>> sorted(steering.scales)
    ['0', '2']
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from typing import Any

import torch
from torch.optim import Optimizer

from hf_triaccel.curvature.signals import ModuleSignals, SignalTracker
from hf_triaccel.optim.adafisher import AdaFisher


class StepSizeSteering:
    """Scales each module's AdaFisher step by a factor from its curvature.

    Args:
        tracker: the signal tracker whose evaluations set the scales.
        optimizer: the AdaFisher optimizer the tracker follows (Accelerate's wrapper is
            unwrapped).
        power: exponent of the curvature ratio (0.5: the square root).
        min_scale: lower bound of a scale.
        max_scale: upper bound of a scale.

    Attributes:
        scales: the current scale by module name; modules absent take unscaled steps
            (empty before the tracker's first evaluation).

    Raises:
        TypeError: ``optimizer`` is not AdaFisher / AdaFisherW.
        ValueError: the tracker is not attached to an optimizer yet, or bounds or power
            out of range.
    """

    def __init__(
        self,
        tracker: SignalTracker,
        optimizer: Optimizer,
        *,
        power: float = 0.5,
        min_scale: float = 0.5,
        max_scale: float = 2.0,
    ) -> None:
        while isinstance(getattr(optimizer, "optimizer", None), Optimizer):
            optimizer = optimizer.optimizer
        if not isinstance(optimizer, AdaFisher):
            raise TypeError(
                "step-size steering needs AdaFisher or AdaFisherW (an update linear in the "
                f"gradient), got {type(optimizer).__name__}"
            )
        if not tracker.attached:
            # its gradient sampling must run before the scaling: attached first, it does
            raise ValueError("attach the tracker to the optimizer before steering with it")
        if not power > 0.0:
            raise ValueError(f"power={power}: needs > 0")
        if not 0.0 < min_scale <= 1.0 <= max_scale:
            raise ValueError(
                f"min_scale={min_scale}, max_scale={max_scale}: need 0 < min_scale <= 1 <= "
                "max_scale"
            )
        self.tracker = tracker
        self.power = power
        self.min_scale = min_scale
        self.max_scale = max_scale
        self.scales: dict[str, float] = {}
        self._params = {
            name: [getattr(layer.module, attr) for attr in layer.layouts]
            for name, layer in tracker.collector.layers.items()
        }
        self._plan: list[tuple[list[torch.Tensor], list[float]]] | None = None
        self._handles = [
            tracker.add_listener(self._on_step),
            optimizer.register_step_pre_hook(self._scale_gradients),
        ]

    def _on_step(self, step: int, signals: dict[str, ModuleSignals] | None) -> None:
        if signals is not None:
            self.update({name: s.curvature for name, s in signals.items()})

    def update(self, curvature: Mapping[str, float]) -> None:
        """Sets the scales from each module's curvature.

        Example:
            >>> from torch import nn
            >>> from hf_triaccel import AdaFisher
            >>> model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2))
            >>> optimizer = AdaFisher.from_model(model, lr=1e-3)
            >>> tracker = SignalTracker(optimizer.collector, optimizer)
            >>> steering = StepSizeSteering(tracker, optimizer)
            >>> steering.update({"0": 1.0, "1": 4.0, "2": 100.0})
            >>> steering.scales
            {'0': 2.0, '1': 1.0, '2': 0.5}
        """
        unknown = set(curvature) - set(self._params)
        if unknown:
            raise KeyError(f"curvature names modules the tracker has not: {sorted(unknown)[:5]}")
        usable = {n: c for n, c in curvature.items() if math.isfinite(c) and c > 0.0}
        if not usable:
            return
        reference = statistics.median(usable.values())
        self.scales = {
            name: min(self.max_scale, max(self.min_scale, (reference / c) ** self.power))
            for name, c in usable.items()
        }
        self._plan = None

    def _scale_gradients(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        if self._plan is None:
            # one multi-tensor multiply per device and dtype, as foreach kernels need
            groups: dict[tuple[torch.device, torch.dtype], tuple[list, list]] = {}
            for name, scale in self.scales.items():
                if scale == 1.0:
                    continue
                for p in self._params[name]:
                    params, factors = groups.setdefault((p.device, p.dtype), ([], []))
                    params.append(p)
                    factors.append(scale)
            self._plan = list(groups.values())
        with torch.no_grad():
            for params, factors in self._plan:
                present = [(p.grad, f) for p, f in zip(params, factors, strict=True)]
                present = [(g, f) for g, f in present if g is not None and not g.is_sparse]
                if present:
                    grads, scales = zip(*present, strict=True)
                    torch._foreach_mul_(list(grads), list(scales))

    def summary(self) -> dict[str, float]:
        """The smallest and largest scale (``lr_scale_min``, ``lr_scale_max``; 1.0 before
        the first evaluation), as a telemetry provider."""
        values = list(self.scales.values()) or [1.0]
        return {"lr_scale_min": min(values), "lr_scale_max": max(values)}

    def state_dict(self) -> dict[str, Any]:
        """The current scales (restored by :meth:`load_state_dict`, so that a resumed run
        steps as the interrupted one until the next evaluation)."""
        return {"scales": dict(self.scales)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores what :meth:`state_dict` saved; the module names must exist."""
        unknown = set(state["scales"]) - set(self._params)
        if unknown:
            raise KeyError(
                f"steering state names modules the tracker has not: {sorted(unknown)[:5]}"
            )
        self.scales = {name: float(s) for name, s in state["scales"].items()}
        self._plan = None

    def remove(self) -> None:
        """Stops steering: the step hook and the tracker listener are removed."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def __repr__(self) -> str:
        if not self.scales:
            return "StepSizeSteering(no evaluation yet)"
        low, high = min(self.scales.values()), max(self.scales.values())
        return f"StepSizeSteering(modules={len(self.scales)}, scales {low:.3g}..{high:.3g})"
