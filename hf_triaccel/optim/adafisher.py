"""AdaFisher and AdaFisherW: diagonal Kronecker-factored Fisher preconditioning.

The optimizer decides *when* statistics are taken (every ``update_every`` optimizer
steps, plus before the first step) and folds them into the factors held by a
:class:`~hf_triaccel.curvature.collector.FisherCollector`. The collector, not the
optimizer, owns the hooks.
"""

from __future__ import annotations

import itertools
import operator
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from hf_triaccel._types import EMA_MODES, ParamFactors
from hf_triaccel.curvature.collector import FisherCollector
from hf_triaccel.dispatch import resolve_impl, validate_impl
from hf_triaccel.optim.functional import _check_args, prepare_adafisher

_FISHER_KEY = "fisher"
_grad_of = operator.attrgetter("grad")
_NONES = itertools.repeat(None)


@dataclass
class _DevicePart:
    """The parameters of one param group on one device that have gradients."""

    device: torch.device
    positions: list[int] | None  # their positions in the group; None: every parameter
    params: list[torch.Tensor]
    moms: list[torch.Tensor]
    factors: list[ParamFactors | None]
    # One buffer of step counts, so that counting a step is one operation; each
    # parameter's state["step"] is a view of its entry, as torch optimizers keep it.
    counts: torch.Tensor
    steps: list[torch.Tensor]
    impl: str
    update: Callable[..., None]


@dataclass
class _GroupPlan:
    """What :meth:`AdaFisher.step` reuses for a param group from step to step; valid
    while the group, the optimizer's state mapping, the set of the group's parameters
    with gradients and the collector's factor storage stay the same (a state entry
    replaced in place, other than by :meth:`AdaFisher.load_state_dict`, is not seen)."""

    group: dict[str, Any]
    state: dict[Any, Any]  # the optimizer's state mapping the momenta were taken from
    params: list[torch.Tensor]
    n_params: int
    has_grad: tuple[bool, ...]
    generation: int
    parts: list[_DevicePart]


class AdaFisher(Optimizer):
    """AdaFisher with L2 weight decay (DESIGN.md section 3).

    Args:
        params: parameters or param groups, as for any torch optimizer.
        collector: the :class:`FisherCollector` of the model being trained. Parameters
            of modules it covers are preconditioned with their Fisher factors, the
            others with F = 1. Without a collector every parameter gets F = 1
            (a warning says so); :meth:`from_model` builds both in one call.
        lr: learning rate (a float or a one-element tensor).
        beta: momentum coefficient.
        damping: lambda added to every preconditioner entry.
        gamma: EMA coefficient of the Fisher factors.
        update_every: refresh the factors every this many optimizer steps
            (default 100 for ``ema="reference"``, 1 for ``ema="paper"``).
        weight_decay: L2 penalty added to the gradient.
        ema: ``"reference"`` (published results) or ``"paper"``; must match the collector.
        impl: ``"triton"``, ``"foreach"``, ``"reference"`` or ``None`` (automatic;
            the ``HF_TRIACCEL_IMPL`` environment variable overrides automatic).

    Example:
        >>> model = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2))
        >>> opt = AdaFisher.from_model(model, lr=1e-3)
        >>> loss = model(torch.randn(16, 8)).square().mean()
        >>> loss.backward(); opt.step(); opt.zero_grad()
    """

    decoupled = False

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        collector: FisherCollector | None = None,
        *,
        lr: float | torch.Tensor = 1e-3,
        beta: float = 0.9,
        damping: float = 1e-3,
        gamma: float = 0.8,
        update_every: int | None = None,
        weight_decay: float = 0.0,
        ema: str = "reference",
        impl: str | None = None,
    ) -> None:
        _check_args(lr, beta, weight_decay, damping)
        if not 0.0 < gamma < 1.0:
            raise ValueError(f"invalid gamma: {gamma} (needs 0 < gamma < 1)")
        if ema not in EMA_MODES:
            raise ValueError(f"ema={ema!r} is not one of {EMA_MODES}")
        if update_every is None:
            update_every = 100 if ema == "reference" else 1
        if not isinstance(update_every, int) or update_every < 1:
            raise ValueError(f"invalid update_every: {update_every!r} (needs an int >= 1)")
        if collector is not None and not isinstance(collector, FisherCollector):
            raise TypeError(f"collector must be a FisherCollector, got {type(collector).__name__}")
        if collector is not None and collector.ema != ema:
            raise ValueError(f"ema={ema!r} but the collector was built with ema={collector.ema!r}")
        validate_impl(impl)
        defaults = dict(lr=lr, beta=beta, damping=damping, weight_decay=weight_decay)
        super().__init__(params, defaults)
        if collector is None:
            warnings.warn(
                f"{type(self).__name__} without a FisherCollector preconditions every "
                "parameter with F = 1; use "
                f"{type(self).__name__}.from_model(model, ...) for Fisher preconditioning",
                stacklevel=2,
            )
        self.collector = collector
        self.gamma = gamma
        self.update_every = update_every
        self.ema = ema
        self.impl = impl
        self.fisher_steps = 0
        self._plans: list[_GroupPlan | None] = []
        self._sync_collecting()

    @classmethod
    def from_model(
        cls,
        model: nn.Module,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]] | None = None,
        **hyperparameters: Any,
    ) -> AdaFisher:
        """Builds the collector for ``model`` and the optimizer in one call.

        Args:
            model: the model to train.
            params: parameters or param groups; default, every trainable parameter.
            **hyperparameters: as for the constructor (``ema`` and ``impl`` are
                passed to the collector too).

        Example:
            >>> opt = AdaFisherW.from_model(nn.Linear(4, 2), lr=1e-3, weight_decay=0.01)
        """
        collector = FisherCollector(
            model, ema=hyperparameters.get("ema", "reference"), impl=hyperparameters.get("impl")
        )
        if params is None:
            params = [p for p in model.parameters() if p.requires_grad]
        return cls(params, collector, **hyperparameters)

    def _sync_collecting(self) -> None:
        if self.collector is not None:
            self.collector.collecting = self.fisher_steps % self.update_every == 0

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Performs one optimization step.

        Args:
            closure: re-evaluates the model and returns the loss (optional).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        collector = self.collector
        if collector is not None and collector.collecting:
            collector.fold(self.gamma)
        generation = 0 if collector is None else collector.generation
        groups = self.param_groups
        if len(self._plans) != len(groups):
            self._plans = [None] * len(groups)
        for i, group in enumerate(groups):
            params = group["params"]
            grads = list(map(_grad_of, params))
            has_grad = tuple(map(operator.is_not, grads, _NONES))
            plan = self._plans[i]
            if (
                plan is None
                or plan.group is not group
                or plan.state is not self.state
                or plan.params is not params
                or plan.n_params != len(params)
                or plan.has_grad != has_grad
                or plan.generation != generation
            ):
                plan = self._plans[i] = self._plan_group(group, grads, has_grad, generation)
            lr, beta = group["lr"], group["beta"]
            weight_decay, damping = group["weight_decay"], group["damping"]
            _check_args(lr, beta, weight_decay, damping)
            for part in plan.parts:
                impl = resolve_impl(self.impl, part.device)
                if impl != part.impl:
                    part.update = prepare_adafisher(
                        part.params, part.moms, part.factors, part.steps, impl=impl
                    )
                    part.impl = impl
                part.counts.add_(1.0)
                part.update(
                    grads if part.positions is None else [grads[j] for j in part.positions],
                    lr=lr,
                    beta=beta,
                    weight_decay=weight_decay,
                    damping=damping,
                    decoupled=self.decoupled,
                )
        self.fisher_steps += 1
        self._sync_collecting()
        return loss

    def _plan_group(
        self,
        group: dict[str, Any],
        grads: list[torch.Tensor | None],
        has_grad: tuple[bool, ...],
        generation: int,
    ) -> _GroupPlan:
        """Creates missing state and binds the update of a group's parameters with
        gradients, one part per device (the update groups by dtype itself)."""
        params = group["params"]
        by_device: dict[torch.device, list[int]] = {}
        for j, (p, g) in enumerate(zip(params, grads, strict=True)):
            if g is None:
                continue
            if g.is_sparse:
                raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
            state = self.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                state["momentum"] = torch.zeros_like(p, dtype=torch.float32)
            by_device.setdefault(p.device, []).append(j)
        parts = []
        for device, positions in by_device.items():
            ps = [params[j] for j in positions]
            states = [self.state[p] for p in ps]
            counts = torch.stack([s["step"] for s in states]).to(device, torch.float32)
            steps = list(counts.unbind())
            for state, step in zip(states, steps, strict=True):
                state["step"] = step
            moms = [s["momentum"] for s in states]
            factors = [
                None if self.collector is None else self.collector.factors_for(p) for p in ps
            ]
            impl = resolve_impl(self.impl, device)
            parts.append(
                _DevicePart(
                    device=device,
                    positions=None if len(positions) == len(params) else positions,
                    params=ps,
                    moms=moms,
                    factors=factors,
                    counts=counts,
                    steps=steps,
                    impl=impl,
                    update=prepare_adafisher(ps, moms, factors, steps, impl=impl),
                )
            )
        return _GroupPlan(group, self.state, params, len(params), has_grad, generation, parts)

    def state_dict(self) -> dict[str, Any]:
        """The torch optimizer state plus the Fisher factors (by layer name) and the
        refresh schedule, so that a resumed run continues exactly."""
        sd = super().state_dict()
        sd[_FISHER_KEY] = {
            "fisher_steps": self.fisher_steps,
            "factors": None if self.collector is None else self.collector.state_dict(),
        }
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        fisher = state_dict.pop(_FISHER_KEY, None)
        super().load_state_dict(state_dict)
        # torch casts loaded state to the parameter's dtype (bf16 momentum would lose
        # bits) and leaves "step" where it was saved: restore both from the saved values
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for pid, p in zip(saved_ids, params, strict=True):
            if pid in state_dict["state"]:
                saved = state_dict["state"][pid]
                self.state[p] = {
                    "step": saved["step"].to(device=p.device, dtype=torch.float32),
                    "momentum": saved["momentum"].to(device=p.device, dtype=torch.float32),
                }
        self._plans = []  # the momenta and steps were replaced
        if fisher is None:
            return
        self.fisher_steps = int(fisher["fisher_steps"])
        if self.collector is not None and fisher["factors"] is not None:
            self.collector.load_state_dict(fisher["factors"])
        self._sync_collecting()


class AdaFisherW(AdaFisher):
    """AdaFisher with decoupled weight decay (AdamW-style). Same arguments as
    :class:`AdaFisher`.

    Example:
        >>> model = nn.Linear(8, 2)
        >>> opt = AdaFisherW.from_model(model, lr=1e-3, weight_decay=0.05)
    """

    decoupled = True
