"""The Fisher collector: owns the hooks and the per-layer factors.

The collector decides *which* modules carry factors (by :func:`rule_for`), takes their
statistics with removable hooks while :attr:`FisherCollector.collecting` is on, adds them
over micro-batches, and folds them into the running factors once per optimizer step
(:meth:`FisherCollector.fold`). *When* to collect is the optimizer's decision. The
hooks are registered only while collecting: the steps between two refreshes run the model
unhooked, at no host cost (:mod:`~hf_triaccel.curvature.collection.hooks`).

Parameters are matched to their factors by identity, looked up as the modules hold them
now (FSDP2 replaces a model's parameters with DTensors); a parameter sharded by rows
gets the slice of its factors that its local rows read
(:mod:`~hf_triaccel.curvature.collection.sharding`).

A refresh step runs the hooks of every layer, so they are kept to the device work
itself: each writes its sums into a preallocated buffer of the layer
(:class:`~hf_triaccel.curvature.collection.layer.LayerFactors`) through its rule, the
built-in rules' reductions queued and launched together
(:mod:`~hf_triaccel.curvature.rules.batching`). The hooks see the collector only through
the narrow state they share (:class:`~hf_triaccel.curvature.collection.hooks.HookState`).
Everything else is left to :meth:`FisherCollector.fold`, once per refresh, in batched
operations over all layers: merging the micro-batches' sums, adding them over processes,
the finish (:mod:`~hf_triaccel.curvature.rules.finish`) and the loss scale.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any

import torch
from torch import nn

from hf_triaccel._types import DEFAULT_FACTOR_INIT, EMA_MODES, FACTOR_INITS, ParamFactors
from hf_triaccel.curvature.collection.averaging import FoldPlans, fold_step
from hf_triaccel.curvature.collection.hooks import (
    GRADIENT_BYTES_PER_PARAMETER,
    ActivationHook,
    HookState,
    LayerHook,
    OutputHook,
    RefreshBatches,
)
from hf_triaccel.curvature.collection.layer import LayerFactors
from hf_triaccel.curvature.collection.sharding import local_factors, local_rows
from hf_triaccel.curvature.rules import FisherRule, rule_for

# model -> its collector; weak, and outside the model so that copies of the model
# (EMA or teacher copies) do not carry it
_ATTACHED: weakref.WeakKeyDictionary[nn.Module, FisherCollector] = weakref.WeakKeyDictionary()


def _no_model() -> None:
    """The model reference of a collector copied without a model."""
    return None


class FisherCollector:
    """Takes AdaFisher's Kronecker-factor statistics from a model with removable hooks.

    Args:
        model: the model to hook. Every module with a supported type and at least one
            trainable direct parameter gets factors; a parameter shared by several
            modules (tied embeddings) is assigned to the first one in
            ``named_modules()`` order.
        ema: ``"reference"`` or ``"paper"`` (see :mod:`hf_triaccel.curvature.collection.fold`).
        factor_init: what the factors start at, ``"zeros"`` (the default) or ``"ones"``
            (published; see :class:`~hf_triaccel.optim.config.AdaFisherConfig`).
        impl: implementation of the statistics (see :mod:`hf_triaccel.dispatch`).
        exclude: module names (as in ``named_modules()``) that get no factors.

    Attributes:
        hook_state: what the hooks share (the batches, the implementation, the
            generation): all they see of the collector.

    A collector copies and pickles (``copy.deepcopy``, ``pickle``): copied together with
    its model (or with an optimizer holding it), the copy takes statistics on the copied
    model; a copy of the model alone carries no live hooks.

    Example:
        >>> model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
        >>> collector = FisherCollector(model)
        >>> sorted(collector.layers)
        ['0', '2']
        >>> collector.collecting = False  # between refreshes: no hooks on the model
        >>> len(model[0]._forward_pre_hooks)
        0
        >>> collector.detach()
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        ema: str = "reference",
        factor_init: str = DEFAULT_FACTOR_INIT,
        impl: str | None = None,
        exclude: tuple[str, ...] = (),
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        if ema not in EMA_MODES:
            raise ValueError(f"ema={ema!r} is not one of {EMA_MODES}")
        if factor_init not in FACTOR_INITS:
            raise ValueError(f"factor_init={factor_init!r} is not one of {FACTOR_INITS}")
        self.ema = ema
        self.factor_init = factor_init
        self.impl = impl
        self.grad_scaler: torch.amp.GradScaler | None = None
        self.layers: dict[str, LayerFactors] = {}
        self._fold_plans = FoldPlans(impl)  # the folds of each set of ready layers
        unknown = set(exclude) - {n for n, _ in model.named_modules()}
        if unknown:
            raise ValueError(f"exclude names modules the model does not have: {sorted(unknown)}")
        owned: set[torch.Tensor] = set()
        for name, module in model.named_modules():
            rule = rule_for(module)
            if rule is None or name in exclude:
                continue
            self._add_layer(name, module, rule, owned)
        budget = GRADIENT_BYTES_PER_PARAMETER * sum(p.numel() for p in self._params())
        self.hook_state = HookState(RefreshBatches(budget), impl)
        self._model_ref: Any = weakref.ref(model)
        self._collecting = True
        self._attached = False
        self.attach()

    def _add_layer(
        self, name: str, module: nn.Module, rule: FisherRule, taken: set[torch.Tensor]
    ) -> None:
        layouts = rule.layouts(module)
        owned = {
            attr: p
            for attr, p in module.named_parameters(recurse=False)
            if p.requires_grad and attr in layouts and p not in taken
        }
        if not owned:
            return
        taken.update(owned.values())
        layouts = {k: layouts[k] for k in owned}
        zeros = self.ema == "paper" or self.factor_init == "zeros"
        layer = LayerFactors.create(name, module, rule, layouts, self.ema == "paper", zeros)
        self.layers[name] = layer

    @property
    def generation(self) -> int:
        """Incremented whenever factor tensors are reallocated (the model moved to another
        device), for whoever caches their addresses."""
        return self.hook_state.generation

    @property
    def batches(self) -> RefreshBatches:
        """The batches the hooks queue the statistics into."""
        return self.hook_state.batches

    @property
    def attached(self) -> bool:
        """Whether the collector is attached to its model (between :meth:`attach` and
        :meth:`detach`); its hooks are registered while it is also :attr:`collecting`."""
        return self._attached

    @property
    def collecting(self) -> bool:
        """Whether statistics are taken in the forwards and backwards from now on (set by
        the optimizer before each refresh step's forward, cleared after its fold). While
        it is off the hooks are removed from the model."""
        return self._collecting

    @collecting.setter
    def collecting(self, value: bool) -> None:
        value = bool(value)
        if value == self._collecting:
            return
        self._collecting = value
        if self._attached:
            if value:
                self._register()
            else:
                self._unregister()

    def attach(self) -> None:
        """Attaches the collector to its model again after :meth:`detach` (factors and
        the statistics gathered so far are kept). A collector attached to the same model
        is detached first, with a warning, so that statistics are not taken twice."""
        if self._attached:
            return
        model = self._model_ref()
        previous = None if model is None else _ATTACHED.get(model)
        if previous is not None and previous is not self and previous.attached:
            msg = "the model already had a FisherCollector: its hooks were removed"
            warnings.warn(msg + " so that statistics are not taken twice", stacklevel=3)
            previous.detach()
        if model is not None:
            _ATTACHED[model] = self
        self._attached = True
        if self._collecting:
            self._register()

    def detach(self) -> None:
        """Removes every hook from the model; factors stay readable, and :meth:`attach`
        hooks the model again."""
        self._unregister()
        self._attached = False
        model = self._model_ref()
        if model is not None and _ATTACHED.get(model) is self:
            del _ATTACHED[model]

    remove = detach

    def _register(self) -> None:
        for layer in self.layers.values():
            if layer.handles:
                continue
            module, state = layer.module, self.hook_state
            if layer.output_module is module:
                hook = LayerHook(state, layer)
                layer.handles.append(module.register_forward_hook(hook, with_kwargs=True))
                continue
            layer.handles += (
                module.register_forward_pre_hook(ActivationHook(state, layer), with_kwargs=True),
                layer.output_module.register_forward_hook(OutputHook(state, layer)),
            )

    def _unregister(self) -> None:
        self.batches.flush()  # what the hooks queued still counts
        for layer in self.layers.values():
            for handle in layer.handles:
                handle.remove()
            layer.handles.clear()

    def _params(self) -> dict[torch.Tensor, tuple[LayerFactors, str]]:
        """Every covered parameter, as its module holds it now, with its layer and name."""
        index: dict[torch.Tensor, tuple[LayerFactors, str]] = {}
        for layer in self.layers.values():
            for attr in layer.layouts:
                p = layer.module._parameters.get(attr)
                if p is not None:
                    index.setdefault(p, (layer, attr))
        return index

    def follow_parameters(self) -> None:
        """Moves each layer's tensors to where its parameters are, as the hooks do at a
        forward: for an update that comes before any hooked forward (a model moved, or a
        checkpoint loaded, since the last refresh).

        Example:
            >>> collector = FisherCollector(nn.Linear(3, 2))
            >>> collector.follow_parameters()  # already there: nothing moves
            >>> collector.generation
            0
        """
        for layer in self.layers.values():
            if layer.follow(getattr(layer.module, layer.anchor).device):
                self.hook_state.generation += 1  # whoever cached the factors' addresses

    def param_factors(self) -> dict[torch.Tensor, ParamFactors]:
        """The factors of every parameter the collector covers, by identity of the
        parameter as its module holds it now. A parameter sharded by rows (a DTensor of
        FSDP2) gets the slice of its factors that its local rows read, as views of the
        full vectors, laid out for its local shard.

        Example:
            >>> collector = FisherCollector(nn.Linear(3, 2))
            >>> [f.layout.a_off for f in collector.param_factors().values()]  # weight, bias
            [0, 3]
        """
        out = {}
        for p, (layer, attr) in self._params().items():
            full = ParamFactors(layer.g, layer.a, layer.layouts[attr])
            rows = local_rows(p)
            out[p] = full if rows is None else local_factors(full, p.shape, rows)
        return out

    def factors_for(self, param: torch.Tensor) -> ParamFactors | None:
        """The factors a parameter is preconditioned with, matched by identity (see
        :meth:`param_factors`, which looks every parameter up at once)."""
        return self.param_factors().get(param)

    def checkpoint_tensors(self) -> dict[torch.Tensor, dict[str, torch.Tensor]]:
        """The factor tensors saved with each covered parameter's optimizer state: its
        layer's running factors (``fisher_a``, ``fisher_g``) and, with ``ema="paper"``,
        the normalised ones the update reads (``fisher_a_used``, ``fisher_g_used``). The
        live, full vectors: loading copies into them.

        Example:
            >>> model = nn.Linear(3, 2)
            >>> sorted(FisherCollector(model).checkpoint_tensors()[model.bias])
            ['fisher_a', 'fisher_g']
        """
        out = {}
        for p, (layer, _) in self._params().items():
            out[p] = {"fisher_a": layer.a_ema, "fisher_g": layer.g_ema}
            if layer.a is not layer.a_ema:
                out[p].update(fisher_a_used=layer.a, fisher_g_used=layer.g)
        return out

    def fold(self, gamma: float, normalise: str = "absolute") -> None:
        """Folds the statistics accumulated since the last fold into the factors, with the
        EMA decay ``gamma`` and the normalisation ``normalise`` (both the optimizer's: see
        :mod:`hf_triaccel.curvature.collection.fold`).

        Adds the sums over micro-batches and, when ``torch.distributed`` runs several
        processes, over them (one all-reduce per device of every sum and count; see
        :mod:`~hf_triaccel.curvature.collection.averaging`), finishes the statistics once from the
        step's sums (:mod:`~hf_triaccel.curvature.rules.finish`), removes a GradScaler's loss
        scale from the gradient statistics, and resets the accumulators. Layers that saw
        no complete forward/backward since the last fold keep their factors.
        """
        self.batches.flush()
        ready = [ly for ly in self.layers.values() if ly.a_count and ly.g_count]
        if ready:
            self._fold_ready(ready, gamma, normalise)
        for ly in self.layers.values():
            ly.reset()

    def discard(self) -> None:
        """Forgets the statistics gathered since the last fold, queued or taken (a failed
        attempt's, which the step runs again).

        Example:
            >>> model = nn.Linear(3, 2)
            >>> collector = FisherCollector(model)
            >>> model(torch.ones(1, 3)).sum().backward()
            >>> collector.discard()
            >>> collector.layers[""].a_count
            0
        """
        self.batches.clear()
        for ly in self.layers.values():
            ly.reset()

    def _fold_ready(self, ready: list[LayerFactors], gamma: float, normalise: str) -> None:
        scaler, plans = self.grad_scaler, self._fold_plans(ready, self.generation)
        scale = None
        if scaler is not None and scaler.is_enabled() and scaler._scale is not None:
            scale = scaler._scale
        fold_step(ready, plans, self.ema, gamma, normalise, scale)

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        """Running factors by layer name (accumulators are not saved: a checkpoint is
        taken between optimizer steps, when they are empty)."""
        return {name: ly.factor_state() for name, ly in self.layers.items()}

    def load_state_dict(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        """Restores factors saved by :meth:`state_dict`; layer names must match."""
        missing = set(self.layers) - set(state)
        extra = set(state) - set(self.layers)
        if missing or extra:
            raise KeyError(
                f"Fisher factors do not match the model: missing {sorted(missing)[:5]}, "
                f"unexpected {sorted(extra)[:5]}"
            )
        for name, ly in self.layers.items():
            ly.load_factor_state(state[name])

    def __getstate__(self) -> dict[str, Any]:
        """Everything but the folds (they hold this collector's addresses), with the model,
        so that a copy hooks the copy of the model."""
        skip = ("_fold_plans", "_model_ref", "hook_state")
        state = {k: v for k, v in vars(self).items() if k not in skip}
        state["budget"] = self.batches.gradients.budget  # the batches: nothing queued
        state["generation"] = self.generation
        state["model"] = self._model_ref()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        model = state.pop("model")
        state.setdefault("factor_init", "ones")  # pickled before the setting existed
        budget, generation = state.pop("budget"), state.pop("generation")
        self.__dict__.update(state)
        self.hook_state = HookState(RefreshBatches(budget), self.impl)
        self.hook_state.generation = generation
        self._fold_plans = FoldPlans(self.impl)
        self._model_ref = _no_model if model is None else weakref.ref(model)
        self._unregister()  # the copied modules hold inert stand-ins of the original's hooks
        if self._attached:
            if model is not None:
                _ATTACHED[model] = self
            if self._collecting:
                self._register()

    def __enter__(self) -> FisherCollector:
        return self

    def __exit__(self, *exc) -> None:
        self.detach()

    def __repr__(self) -> str:
        return (
            f"FisherCollector(layers={len(self.layers)}, ema={self.ema!r}, "
            f"factor_init={self.factor_init!r})"
        )
