"""AdaFisher and AdaFisherW: diagonal Kronecker-factored Fisher preconditioning.

The optimizer decides *when* statistics are taken (every ``update_every`` optimizer
steps, plus before the first step) and folds them into the factors held by a
:class:`~hf_triaccel.curvature.collector.FisherCollector`. The collector, not the
optimizer, owns the hooks.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from hf_triaccel.curvature.collector import FisherCollector
from hf_triaccel.curvature.fold import EMA_MODES
from hf_triaccel.dispatch import validate_impl
from hf_triaccel.optim.functional import _check_args, adafisher

_FISHER_KEY = "fisher"


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
        if self.collector is not None and self.collector.collecting:
            self.collector.fold(self.gamma)
        for group in self.param_groups:
            by_device: dict[tuple[torch.device, torch.dtype], list[list]] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                    state["momentum"] = torch.zeros_like(p, dtype=torch.float32)
                lists = by_device.setdefault((p.device, p.dtype), [[], [], [], [], []])
                lists[0].append(p)
                lists[1].append(p.grad)
                lists[2].append(state["momentum"])
                lists[3].append(None if self.collector is None else self.collector.factors_for(p))
                lists[4].append(state["step"])
            for params, grads, moms, factors, steps in by_device.values():
                torch._foreach_add_(steps, 1.0)
                adafisher(
                    params,
                    grads,
                    moms,
                    factors,
                    steps,
                    lr=group["lr"],
                    beta=group["beta"],
                    weight_decay=group["weight_decay"],
                    damping=group["damping"],
                    decoupled=self.decoupled,
                    impl=self.impl,
                )
        self.fisher_steps += 1
        self._sync_collecting()
        return loss

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
