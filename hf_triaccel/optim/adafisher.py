"""AdaFisher and AdaFisherW: diagonal Kronecker-factored Fisher preconditioning.

Over 400 lines: one torch optimizer class (construction and its checks, the step, the
state-dict round trip); the per-group plans, the update, gradient release and the saved
state's format are modules of their own.

The optimizer decides *when* statistics are taken (every ``update_every`` optimizer
steps, plus before the first step) and folds them into the factors held by a
:class:`~hf_triaccel.curvature.collector.FisherCollector`. The collector, not the
optimizer, owns the hooks.

Parameters sharded by FSDP2 (DTensors, ``Shard(0)``) are updated where they live: each
process steps its local rows with the slice of the factors they read, and keeps its
momentum as a DTensor of the parameter's placements, so that
``torch.distributed.checkpoint`` saves and reshards the state. The Fisher factors ride in
the per-parameter state (``fisher_a``, ``fisher_g``: the full vectors, the same on every
process) and the refresh schedule in each saved param group (``fisher_steps``), the parts
of a state dict that ``torch.distributed.checkpoint.state_dict`` keeps.
"""

from __future__ import annotations

import itertools
import operator
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from hf_triaccel.curvature.collection.sharding import local_tensor
from hf_triaccel.curvature.collector import FisherCollector
from hf_triaccel.dispatch import resolve_impl
from hf_triaccel.optim.checkpoint import (
    FISHER_KEY,
    ROUNDING_SEED_KEY,
    SCHEDULE_KEY,
    check_loadable,
    restore_states,
    saved_schedule,
)
from hf_triaccel.optim.config import (
    AdaFisherConfig,
    check_step_hyperparameters,
    impl_from_torch_flags,
)
from hf_triaccel.optim.functional import prepare_adafisher
from hf_triaccel.optim.groups import param_groups
from hf_triaccel.optim.plans import GroupPlan, plan_group
from hf_triaccel.optim.release import GradientRelease, check_releasable

_TORCH_FLAGS = ("foreach", "fused", "capturable", "differentiable")
_grad_of = operator.attrgetter("grad")
_NONES = itertools.repeat(None)


class AdaFisher(Optimizer):
    """AdaFisher with L2 weight decay (docs/design.md, "AdaFisher").

    A torch optimizer: param groups, ``state_dict`` / ``load_state_dict``, closures,
    ``copy.deepcopy``. A float64 parameter is updated in float64 arithmetic; float32,
    bfloat16 and float16 ones in float32. The momentum is kept in ``state_dtype`` (default:
    the arithmetic's); bfloat16 and float16 weights store their update as
    ``weight_rounding`` says (with ``"kahan"``, a ``compensation`` buffer per parameter
    in its state). With ``release_grads=True`` the steps that do not refresh the factors
    run during the backward pass (:mod:`hf_triaccel.optim.release`; ``release`` holds
    the hooks). Complex parameters are refused.

    Args:
        params: parameters or param groups, as for any torch optimizer; a group may
            override ``lr``, ``beta``, ``damping``, ``weight_decay`` and ``maximize``.
        collector: the :class:`FisherCollector` of the model being trained. Parameters
            of modules it covers are preconditioned with their Fisher factors, the
            others with F = 1. Without a collector every parameter gets F = 1
            (a warning says so); :meth:`from_model` builds both in one call.
        config: the hyperparameters as an :class:`~hf_triaccel.optim.config.AdaFisherConfig`;
        **hyperparameters: or else its fields by name (``lr``, ``beta``, ``damping``,
            ``weight_decay``...; same defaults, validated by it). ``ema`` and
            ``factor_init`` must match the collector's.
        maximize: ascend the objective instead of descending it.
        foreach, fused, capturable, differentiable: torch.optim's flags, which timm and
            other wrappers pass: ``foreach=True`` selects ``impl="foreach"``,
            ``foreach=False`` the per-tensor loop (``"reference"``), ``fused=True``
            ``"triton"``; ``capturable`` and ``differentiable`` must stay ``False``.

    Raises:
        ValueError: a hyperparameter out of range (naming the field), flags that
            disagree, an ``ema`` other than the collector's, ``weight_rounding="stochastic"``
            with float16 weights, or ``release_grads=True`` with sharded parameters or
            several processes.
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
        config: AdaFisherConfig | None = None,
        maximize: bool = False,
        foreach: bool | None = None,
        fused: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        **hyperparameters: Any,
    ) -> None:
        name = type(self).__name__
        if config is not None and hyperparameters:
            raise TypeError(
                f"{name}: give a config or hyperparameters, not both "
                f"(got config and {sorted(hyperparameters)})"
            )
        if config is None:
            config = AdaFisherConfig.from_values(hyperparameters, owner=name)
        impl = impl_from_torch_flags(
            config.impl,
            foreach=foreach,
            fused=fused,
            capturable=capturable,
            differentiable=differentiable,
            owner=name,
        )
        # a plain config (a subclass's extra fields are not the optimizer's), impl resolved
        config = AdaFisherConfig(**{**config.optimizer_kwargs(), "impl": impl})
        if collector is not None and not isinstance(collector, FisherCollector):
            raise TypeError(f"collector must be a FisherCollector, got {type(collector).__name__}")
        for setting in ("ema", "factor_init"):
            ours = getattr(config, setting)
            theirs = ours if collector is None else getattr(collector, setting)
            if ours != theirs:
                raise ValueError(
                    f"{name}.{setting}={ours!r} but the collector was built with "
                    f"{setting}={theirs!r}"
                )
        super().__init__(params, {**config.step_defaults(), "maximize": bool(maximize)})
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
        self.normalise = config.normalise
        self.factor_init = config.factor_init
        self.impl = config.impl
        self.fisher_steps = 0
        params = [p for group in self.param_groups for p in group["params"]]
        if config.weight_rounding == "stochastic" and any(p.dtype == torch.float16 for p in params):
            raise ValueError(
                f"{name}.weight_rounding='stochastic' rounds bfloat16 weights; float16 ones "
                "need weight_rounding='kahan'"
            )
        # the random stream of stochastic rounding, drawn from torch's generator so that a
        # seeded run repeats (only when used: other runs' random streams stay as they were);
        # saved with the state
        stochastic = config.weight_rounding == "stochastic"
        self.rounding_seed = int(torch.randint(0, 2**31 - 1, ()).item()) if stochastic else 0
        self.release: GradientRelease | None = None
        if config.release_grads:
            check_releasable(params, name)
            self.release = GradientRelease(self)
        self._plans: list[GroupPlan | None] = []
        self._sync_collecting()

    @classmethod
    def from_model(
        cls,
        model: nn.Module,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]] | None = None,
        **hyperparameters: Any,
    ) -> AdaFisher:
        """Builds the collector for ``model`` and the optimizer in one call
        (:func:`build_adafisher` with this class): ``params`` default to the trainable
        parameters in the groups of :func:`~hf_triaccel.optim.groups.param_groups` (no
        weight decay on biases and normalisation weights); ``hyperparameters`` are the
        constructor's.

        Example:
            >>> opt = AdaFisherW.from_model(nn.Linear(4, 2), lr=1e-3, weight_decay=0.01)
            >>> [g["weight_decay"] for g in opt.param_groups]
            [0.01, 0.0]
        """
        flags = {k: hyperparameters.pop(k) for k in _TORCH_FLAGS if k in hyperparameters}
        maximize = hyperparameters.pop("maximize", False)
        config = AdaFisherConfig.from_values(hyperparameters, owner=cls.__name__)
        return build_adafisher(model, config, cls, params=params, maximize=maximize, **flags)

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
        refresh = self.fisher_steps % self.update_every == 0
        if self.collector is not None:
            self.collector.collecting = refresh
        if self.release is not None:
            self.release.step_finished(refresh_next=self.collector is not None and refresh)

    def rounding_seed_for(self, stream: int) -> int:
        """The seed of stochastic rounding for ``stream`` (a part of this step's update)
        at the current step: different for every step and stream, the same on a resumed
        run."""
        return (self.rounding_seed + 1_000_003 * self.fisher_steps + 7919 * stream) & 0x7FFFFFFF

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
        groups = self.param_groups
        if len(self._plans) != len(groups):  # a first step, or state loaded since the last
            if collector is not None:  # factors built or restored away from their parameters
                collector.follow_parameters()
            self._plans = [None] * len(groups)
        if collector is not None and collector.collecting:
            collector.fold(self.gamma, self.normalise)
        generation = 0 if collector is None else collector.generation
        released = self.release is not None and self.release.active
        stream = 0
        for i, group in enumerate(groups):
            params = group["params"]
            grads = list(map(_grad_of, params))
            has_grad = tuple(map(operator.is_not, grads, _NONES))
            if released and not any(has_grad):
                continue  # stepped by the hooks: the plan stays for the next refresh step
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
                plan = self._plans[i] = plan_group(
                    self.state,
                    group,
                    grads,
                    has_grad,
                    generation,
                    collector=collector,
                    impl=self.impl,
                    owner=type(self).__name__,
                    state_dtype=self.config.resolved_state_dtype,
                    rounding=self.config.weight_rounding,
                )
            lr, beta = group["lr"], group["beta"]
            weight_decay, damping = group["weight_decay"], group["damping"]
            check_step_hyperparameters(lr, beta, weight_decay, damping, owner=type(self).__name__)
            for part in plan.parts:
                impl = resolve_impl(self.impl, part.device)
                if impl != part.impl:
                    part.update = prepare_adafisher(
                        part.params,
                        part.moms,
                        part.factors,
                        part.steps,
                        impl=impl,
                        comps=part.comps,
                        rounding=part.rounding,
                    )
                    part.impl = impl
                part.counts.add_(1.0)
                part_grads = grads if part.positions is None else [grads[j] for j in part.positions]
                if part.sharded:
                    part_grads = list(map(local_tensor, part_grads))
                part.update(
                    part_grads,
                    lr=lr,
                    beta=beta,
                    weight_decay=weight_decay,
                    damping=damping,
                    decoupled=self.decoupled,
                    maximize=group["maximize"],
                    seed=self.rounding_seed_for(stream),
                )
                stream += 1
        self.fisher_steps += 1
        self._sync_collecting()
        return loss

    def state_dict(self) -> dict[str, Any]:
        """The torch optimizer state, whose per-parameter entries hold the Fisher factors
        of the parameter's layer, plus the refresh schedule in every param group, so that
        a resumed run continues exactly."""
        sd = super().state_dict()
        for group in sd["param_groups"]:
            group[SCHEDULE_KEY] = self.fisher_steps
            group[ROUNDING_SEED_KEY] = self.rounding_seed
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a state dict of :meth:`state_dict`, as saved or through
        ``torch.distributed.checkpoint.state_dict.set_optimizer_state_dict`` (torch's
        older format, with each ``step`` a number, and hf_triaccel 0.2's, with the
        factors by layer name, too).

        Raises:
            ValueError: a state dict of another optimizer (AdamW's, say), naming the
                entries it lacks; or one that does not match the param groups.
        """
        state_dict = dict(state_dict)
        legacy = state_dict.pop(FISHER_KEY, None)
        check_loadable(state_dict, f"{type(self).__name__}.load_state_dict")
        groups = state_dict["param_groups"]
        seeds = [g[ROUNDING_SEED_KEY] for g in groups if ROUNDING_SEED_KEY in g]
        groups = [{k: v for k, v in g.items() if k != ROUNDING_SEED_KEY} for g in groups]
        fisher_steps, state_dict["param_groups"] = saved_schedule(groups)
        super().load_state_dict(state_dict)
        if seeds:
            self.rounding_seed = int(seeds[0])
        collector = self.collector
        restore_states(
            self,
            state_dict,
            {} if collector is None else collector.checkpoint_tensors(),
            state_dtype=self.config.resolved_state_dtype,
        )
        self._plans = []  # the momenta and steps were replaced
        if legacy is not None:
            fisher_steps = legacy["fisher_steps"]
            if collector is not None and legacy["factors"] is not None:
                collector.load_state_dict(legacy["factors"])
        if fisher_steps is not None:
            self.fisher_steps = int(fisher_steps)
            self._sync_collecting()

    def __getstate__(self) -> dict[str, Any]:
        """What ``copy.deepcopy`` and pickle keep: torch's state (without its hooks, as
        torch does) and every public attribute. The step plans hold the addresses of
        this optimizer's tensors: a copy builds its own at its first step, and steps every
        parameter in ``step()`` (gradient release hooks stay with the original)."""
        state = super().__getstate__()
        state.update((k, v) for k, v in vars(self).items() if not k.startswith("_"))
        state["release"] = None  # hooks on the original's parameters: a copy has none
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._plans = []
        for group in self.param_groups:
            group.setdefault("maximize", False)  # groups saved before the flag existed
        # optimizers pickled before the setting existed folded with the published rule
        self.__dict__.setdefault("normalise", "absolute")
        self.__dict__.setdefault("factor_init", "ones")
        self.__dict__.setdefault("rounding_seed", 0)
        self.__dict__.setdefault("release", None)


class AdaFisherW(AdaFisher):
    """AdaFisher with decoupled weight decay (AdamW-style). Same arguments as
    :class:`AdaFisher`.

    Example:
        >>> opt = AdaFisherW.from_model(nn.Linear(8, 2), lr=1e-3, weight_decay=0.05)
    """

    decoupled = True


OPTIMIZERS: dict[str, type[AdaFisher]] = {"adafisher": AdaFisher, "adafisherw": AdaFisherW}
"""hf_triaccel's optimizers by the name every entry point accepts (any case)."""


def optimizer_class(name: str | type[AdaFisher], owner: str = "optimizer") -> type[AdaFisher]:
    """The optimizer class named ``name`` (a key of :data:`OPTIMIZERS`, any case; a class
    passes through); a ValueError names ``owner`` and the valid names.

    Example:
        >>> optimizer_class("adam", "TriAccelPlugin.optimizer")
        Traceback (most recent call last):
        ...
        ValueError: TriAccelPlugin.optimizer='adam' is not one of ['adafisher', 'adafisherw']
    """
    if isinstance(name, type) and issubclass(name, AdaFisher):
        return name
    key = str(getattr(name, "value", name)).lower()
    if key not in OPTIMIZERS:
        raise ValueError(f"{owner}={name!r} is not one of {sorted(OPTIMIZERS)}")
    return OPTIMIZERS[key]


def build_adafisher(
    model: nn.Module,
    config: AdaFisherConfig | None = None,
    optimizer: str | type[AdaFisher] = "adafisherw",
    *,
    params: Iterable[torch.Tensor] | Iterable[dict[str, Any]] | None = None,
    grad_scaler: torch.amp.GradScaler | None = None,
    **torch_flags: Any,
) -> AdaFisher:
    """The one builder of AdaFisher or AdaFisherW with its Fisher collector, which every
    entry point goes through (``from_model``, the Trainer, Accelerate, the factories).

    Args:
        model: the unwrapped model (its modules carry the Fisher factors).
        config: hyperparameters (default: :class:`AdaFisherConfig`'s defaults).
        optimizer: ``"adafisher"`` (L2 decay), ``"adafisherw"`` (decoupled) or a class.
        params: parameters or param groups; default, the trainable parameters in the groups
            of :func:`~hf_triaccel.optim.groups.param_groups`.
        grad_scaler: the loss scaler of fp16 training, so that statistics are unscaled.
        **torch_flags: ``maximize`` and torch.optim's flags (``foreach``, ``fused``...).

    Example:
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
        >>> opt = build_adafisher(model, AdaFisherConfig(weight_decay=0.1))
        >>> [(len(g["params"]), g["weight_decay"]) for g in opt.param_groups]
        [(1, 0.1), (3, 0.0)]
        >>> opt.collector.remove()
    """
    cls = optimizer_class(optimizer)
    config = config or AdaFisherConfig()
    flags = {k: v for k, v in torch_flags.items() if k != "maximize"}
    impl = impl_from_torch_flags(config.impl, **flags, owner=cls.__name__)
    collector = FisherCollector(model, ema=config.ema, factor_init=config.factor_init, impl=impl)
    collector.grad_scaler = grad_scaler
    if params is None:
        params = param_groups(model, config.weight_decay)
    try:
        return cls(params, collector, config=config, **torch_flags)
    except Exception:
        collector.remove()  # a refused configuration leaves no hooks behind
        raise
