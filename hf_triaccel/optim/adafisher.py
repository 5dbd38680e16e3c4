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

from hf_triaccel._types import ParamFactors
from hf_triaccel.curvature.collector import FisherCollector
from hf_triaccel.dispatch import resolve_impl
from hf_triaccel.optim.checkpoint import FISHER_KEY, check_loadable, restore_states
from hf_triaccel.optim.config import (
    AdaFisherConfig,
    check_step_hyperparameters,
    impl_from_torch_flags,
)
from hf_triaccel.optim.functional import compute_dtype, prepare_adafisher
from hf_triaccel.optim.groups import param_groups

_TORCH_FLAGS = ("foreach", "fused", "capturable", "differentiable")
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
    """AdaFisher with L2 weight decay (docs/design.md, "AdaFisher").

    A torch optimizer: param groups, ``state_dict`` / ``load_state_dict``, closures,
    ``copy.deepcopy``. A float64 parameter is updated in float64 with a float64
    momentum; float32, bfloat16 and float16 ones in float32 with a float32 momentum.
    Complex parameters are refused.

    Args:
        params: parameters or param groups, as for any torch optimizer; a group may
            override ``lr``, ``beta``, ``damping``, ``weight_decay`` and ``maximize``.
        collector: the :class:`FisherCollector` of the model being trained. Parameters
            of modules it covers are preconditioned with their Fisher factors, the
            others with F = 1. Without a collector every parameter gets F = 1
            (a warning says so); :meth:`from_model` builds both in one call.
        lr, beta, damping, gamma, update_every, weight_decay, ema, impl: the
            hyperparameters of :class:`~hf_triaccel.optim.config.AdaFisherConfig`
            (same defaults), validated by it; ``ema`` must match the collector's.
        maximize: ascend the objective instead of descending it.
        foreach, fused, capturable, differentiable: torch.optim's flags, which timm and
            other wrappers pass: ``foreach=True`` selects ``impl="foreach"``,
            ``foreach=False`` the per-tensor loop (``"reference"``), ``fused=True``
            ``"triton"``; ``capturable`` and ``differentiable`` must stay ``False``.

    Raises:
        ValueError: a hyperparameter out of range (naming the field), flags that
            disagree, or an ``ema`` other than the collector's.
        TypeError: a complex parameter, or a collector of another type.

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
        lr: float | torch.Tensor = AdaFisherConfig.lr,
        beta: float = AdaFisherConfig.beta,
        damping: float = AdaFisherConfig.damping,
        gamma: float = AdaFisherConfig.gamma,
        update_every: int | None = AdaFisherConfig.update_every,
        weight_decay: float = AdaFisherConfig.weight_decay,
        ema: str = AdaFisherConfig.ema,
        impl: str | None = AdaFisherConfig.impl,
        maximize: bool = False,
        foreach: bool | None = None,
        fused: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
    ) -> None:
        name = type(self).__name__
        impl = impl_from_torch_flags(
            impl,
            foreach=foreach,
            fused=fused,
            capturable=capturable,
            differentiable=differentiable,
            owner=name,
        )
        config = AdaFisherConfig(
            lr=lr,
            beta=beta,
            damping=damping,
            gamma=gamma,
            update_every=update_every,
            weight_decay=weight_decay,
            ema=ema,
            impl=impl,
        )
        if collector is not None and not isinstance(collector, FisherCollector):
            raise TypeError(f"collector must be a FisherCollector, got {type(collector).__name__}")
        if collector is not None and collector.ema != config.ema:
            raise ValueError(
                f"{name}.ema={config.ema!r} but the collector was built with ema={collector.ema!r}"
            )
        defaults = dict(
            lr=lr, beta=beta, damping=damping, weight_decay=weight_decay, maximize=bool(maximize)
        )
        super().__init__(params, defaults)
        if collector is None:
            warnings.warn(
                f"{name} without a FisherCollector preconditions every parameter with "
                f"F = 1; use {name}.from_model(model, ...) for Fisher preconditioning",
                stacklevel=2,
            )
        self.config = config
        self.collector = collector
        self.gamma = config.gamma
        self.update_every = config.resolved_update_every
        self.ema = config.ema
        self.impl = config.impl
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
            params: parameters or param groups; default, the trainable parameters in
                the groups of :func:`~hf_triaccel.optim.groups.param_groups` (no weight
                decay on biases and normalisation weights).
            **hyperparameters: as for the constructor (``ema`` and the implementation
                are passed to the collector too).

        Example:
            >>> opt = AdaFisherW.from_model(nn.Linear(4, 2), lr=1e-3, weight_decay=0.01)
            >>> [g["weight_decay"] for g in opt.param_groups]
            [0.01, 0.0]
        """
        flags = {k: hyperparameters[k] for k in _TORCH_FLAGS if k in hyperparameters}
        impl = impl_from_torch_flags(hyperparameters.get("impl"), **flags, owner=cls.__name__)
        ema = hyperparameters.get("ema", AdaFisherConfig.ema)
        if params is None:
            decay = hyperparameters.get("weight_decay", AdaFisherConfig.weight_decay)
            params = param_groups(model, decay)
        collector = FisherCollector(model, ema=ema, impl=impl)
        try:
            return cls(params, collector, **hyperparameters)
        except Exception:
            collector.remove()  # a refused configuration leaves no hooks behind
            raise

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Adds a param group (see :meth:`torch.optim.Optimizer.add_param_group`),
        refusing values out of range and parameters that are not real floating-point."""
        super().add_param_group(param_group)
        i = len(self.param_groups) - 1
        group = self.param_groups[i]
        owner = f"{type(self).__name__}.param_groups[{i}]"
        try:
            check_step_hyperparameters(
                group["lr"], group["beta"], group["weight_decay"], group["damping"], owner=owner
            )
            for j, p in enumerate(group["params"]):
                if not p.is_floating_point():
                    raise TypeError(
                        f"{owner}: parameter {j} is {p.dtype}; {type(self).__name__} "
                        "updates real floating-point parameters only (complex ones are "
                        "not supported)"
                    )
        except (TypeError, ValueError):
            self.param_groups.pop()
            raise

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
            check_step_hyperparameters(lr, beta, weight_decay, damping, owner=type(self).__name__)
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
                    maximize=group["maximize"],
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
        gradients, one part per device (the update routes by dtype itself)."""
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
                state["momentum"] = torch.zeros_like(p, dtype=compute_dtype(p.dtype))
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
        sd[FISHER_KEY] = {
            "fisher_steps": self.fisher_steps,
            "factors": None if self.collector is None else self.collector.state_dict(),
        }
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a state dict of :meth:`state_dict` (torch's older format, with each
        ``step`` a number, too).

        Raises:
            ValueError: a state dict of another optimizer (AdamW's, say), naming the
                entries it lacks; or one that does not match the param groups.
        """
        state_dict = dict(state_dict)
        fisher = state_dict.pop(FISHER_KEY, None)
        check_loadable(state_dict, f"{type(self).__name__}.load_state_dict")
        super().load_state_dict(state_dict)
        restore_states(self, state_dict)
        self._plans = []  # the momenta and steps were replaced
        if fisher is None:
            return
        self.fisher_steps = int(fisher["fisher_steps"])
        if self.collector is not None and fisher["factors"] is not None:
            self.collector.load_state_dict(fisher["factors"])
        self._sync_collecting()

    def __getstate__(self) -> dict[str, Any]:
        """What ``copy.deepcopy`` and pickle keep: torch's state (without its hooks, as
        torch does) and every public attribute. The step plans hold the addresses of
        this optimizer's tensors: a copy builds its own at its first step."""
        state = super().__getstate__()
        state.update((k, v) for k, v in vars(self).items() if not k.startswith("_"))
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._plans = []
        for group in self.param_groups:
            group.setdefault("maximize", False)  # groups saved before the flag existed


class AdaFisherW(AdaFisher):
    """AdaFisher with decoupled weight decay (AdamW-style). Same arguments as
    :class:`AdaFisher`.

    Example:
        >>> model = nn.Linear(8, 2)
        >>> opt = AdaFisherW.from_model(model, lr=1e-3, weight_decay=0.05)
    """

    decoupled = True
