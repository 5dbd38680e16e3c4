"""The Fisher collector: owns the hooks and the per-layer factors.

The collector decides *which* modules carry factors (by :func:`rule_for`), takes
their statistics with removable hooks while :attr:`FisherCollector.collecting` is on,
accumulates them over micro-batches, and folds them into the running factors once
per optimizer step (:meth:`FisherCollector.fold`). *When* to collect is the
optimizer's decision. Factors are saved by layer name.

A refresh step runs the hooks of every layer, so they are kept to the device work
itself: each writes its statistic straight into a preallocated buffer of the layer
(:class:`~hf_triaccel.curvature.layer.LayerFactors`) through its rule
(:meth:`FisherRule.a_write` / :meth:`FisherRule.g_write`: for the built-in rules, one or
two kernel launches and, for some layers, one more operation), with no allocation, host
synchronisation or per-call shape arithmetic once a layer has seen its input shape.
Whatever is linear in the
micro-batches and the same for all of them (merging the slots of several micro-batches,
the constant entries of ``a``, the average over micro-batches, the loss scale) is left
to :meth:`FisherCollector.fold`, once per refresh, in batched operations over all layers.
"""

from __future__ import annotations

import warnings
import weakref

import torch
import torch.distributed as dist
from torch import nn

from hf_triaccel._types import EMA_MODES, ParamFactors
from hf_triaccel.curvature.fold import FactorFold
from hf_triaccel.curvature.layer import LayerFactors, PendingStatistic
from hf_triaccel.curvature.rules import FisherRule, rule_for

# Sets of ready layers whose folds are kept: all layers, usually; a model whose layers
# take turns (a mixture of experts) must not pile up folds.
_MAX_FOLD_SETS = 8

# model -> its collector; weak, and outside the model so that copies of the model
# (EMA or teacher copies) do not carry it
_ATTACHED: weakref.WeakKeyDictionary[nn.Module, FisherCollector] = weakref.WeakKeyDictionary()


class FisherCollector:
    """Takes AdaFisher's Kronecker-factor statistics from a model with removable hooks.

    Args:
        model: the model to hook. Every module with a supported type and at least one
            trainable direct parameter gets factors; a parameter shared by several
            modules (tied embeddings) is assigned to the first one in
            ``named_modules()`` order.
        ema: ``"reference"`` or ``"paper"`` (see :mod:`hf_triaccel.curvature.fold`).
        impl: implementation of the statistics (see :mod:`hf_triaccel.dispatch`).
        exclude: module names (as in ``named_modules()``) that get no factors.

    Attributes:
        generation: incremented whenever factor tensors are reallocated (the model
            moved to another device), for whoever caches their addresses.

    Example:
        >>> model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
        >>> collector = FisherCollector(model)
        >>> sorted(collector.layers)
        ['0', '2']
        >>> collector.remove()
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        ema: str = "reference",
        impl: str | None = None,
        exclude: tuple[str, ...] = (),
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        if ema not in EMA_MODES:
            raise ValueError(f"ema={ema!r} is not one of {EMA_MODES}")
        previous = _ATTACHED.get(model)
        if previous is not None and previous.attached:
            warnings.warn(
                "the model already had a FisherCollector: its hooks were removed so that "
                "statistics are not taken twice",
                stacklevel=2,
            )
            previous.remove()
        self.ema = ema
        self.impl = impl
        self.collecting = True
        self.grad_scaler: torch.amp.GradScaler | None = None
        self.generation = 0
        self.layers: dict[str, LayerFactors] = {}
        self._by_param: dict[nn.Parameter, ParamFactors] = {}
        # the folds of each set of ready layers, valid for the generation they were made in
        self._fold_cache: tuple[int, dict[tuple[str, ...], list[FactorFold]]] = (0, {})
        unknown = set(exclude) - {n for n, _ in model.named_modules()}
        if unknown:
            raise ValueError(f"exclude names modules the model does not have: {sorted(unknown)}")
        for name, module in model.named_modules():
            rule = rule_for(module)
            if rule is None or name in exclude:
                continue
            self._add_layer(name, module, rule)
        _ATTACHED[model] = self
        self._model_ref = weakref.ref(model)

    def _add_layer(self, name: str, module: nn.Module, rule: FisherRule) -> None:
        layouts = rule.layouts(module)
        owned = {
            attr: p
            for attr, p in module.named_parameters(recurse=False)
            if p.requires_grad and attr in layouts and p not in self._by_param
        }
        if not owned:
            return
        anchor = next(iter(owned))
        device = owned[anchor].device
        a_len, g_len = rule.sizes(module)
        paper = self.ema == "paper"
        # Factors start at ones. In paper mode only the normalised EMA is ever read,
        # and min-max normalisation removes any constant, so the EMA is kept without
        # the seed's share gamma^t: the same result, without float32 cancellation
        # when the statistics are tiny next to 1.
        seed = torch.zeros if paper else torch.ones
        a_ema = seed(a_len, device=device)
        g_ema = seed(g_len, device=device)
        a_sum = torch.zeros(a_len, device=device)
        layer = LayerFactors(
            name=name,
            module=module,
            rule=rule,
            layouts={k: layouts[k] for k in owned},
            a_ema=a_ema,
            g_ema=g_ema,
            a=torch.ones_like(a_ema) if paper else a_ema,
            g=torch.ones_like(g_ema) if paper else g_ema,
            a_sum=a_sum,
            g_sum=torch.zeros(g_len, device=device),
            output_module=rule.output_module(module),
            slots=[a_sum],
            owners=[None],
            anchor=anchor,
        )
        layer.handles.append(
            module.register_forward_pre_hook(self._pre_hook(layer), with_kwargs=True)
        )
        layer.handles.append(layer.output_module.register_forward_hook(self._output_hook(layer)))
        self.layers[name] = layer
        for attr, p in owned.items():
            self._by_param[p] = ParamFactors(layer.g, layer.a, layer.layouts[attr])

    @property
    def attached(self) -> bool:
        """Whether the hooks are still registered."""
        return any(layer.handles for layer in self.layers.values())

    def _move(self, layer: LayerFactors, device: torch.device) -> None:
        """Moves a layer's tensors to where its module now is."""
        for t in layer.tensors() + layer.slots[1:]:
            t.data = t.data.to(device)
        # cached views and scratch buffers belong to the old storage
        layer.cache.clear()
        self.generation += 1

    def _pre_hook(self, layer: LayerFactors):
        """Takes the activation statistic from the module input, before its forward."""

        def hook(module, args, kwargs):
            # a deep copy of the model shares these closures: ignore the copy's calls
            if not self.collecting or module is not layer.module or not torch.is_grad_enabled():
                return
            x = args[0] if args else next(iter(kwargs.values()))
            device = getattr(module, layer.anchor).device
            if layer.a_sum.device != device:  # the model moved since the last call
                self._move(layer, device)
            slot = layer.free_slot()
            last = layer.rule.a_write(module, x.detach(), layer.slots[slot], self.impl, layer.cache)
            pending = PendingStatistic(slot, last)
            layer.owners[slot] = weakref.ref(pending)
            layer.pending_a.append(pending)

        return hook

    def _output_hook(self, layer: LayerFactors):
        """Pairs the pending activation statistic with the gradient of the output.

        The statistic counts only when the gradient arrives, so a forward that no
        backward follows (an evaluation pass with autograd on) leaves no trace.
        """

        def hook(module, args, output):
            if module is not layer.output_module or not layer.pending_a:
                return
            pending = layer.pending_a.pop()
            if not isinstance(output, torch.Tensor) or not output.requires_grad:
                return

            def grad_hook(grad: torch.Tensor) -> None:
                layer.confirm(pending)
                if grad.requires_grad:  # a backward that builds a graph (create_graph)
                    grad = grad.detach()
                accumulate = layer.g_count > 0
                layer.rule.g_write(
                    layer.module, grad, layer.g_sum, accumulate, self.impl, layer.cache
                )
                layer.g_count += 1

            output.register_hook(grad_hook)

        return hook

    def factors_for(self, param: nn.Parameter) -> ParamFactors | None:
        """The factors a parameter is preconditioned with, matched by identity."""
        return self._by_param.get(param)

    def fold(self, gamma: float) -> None:
        """Folds the statistics accumulated since the last fold into the factors.

        Averages over micro-batches and, when ``torch.distributed`` is initialised,
        over processes (one all-reduce of every sum and count), removes a GradScaler's
        loss scale from the gradient statistics, and resets the accumulators. Layers
        that saw no complete forward/backward since the last fold keep their factors.

        Under data parallelism each process's loss is a mean over its own share of
        the batch, so its output gradients are ``world_size`` times those of the
        global-batch loss: gradient statistics are divided by ``world_size**2``, which
        makes Linear and Conv factors equal to a single process's on the global batch.
        (Normalisation layers' statistics are squares of batch sums: they are averaged
        over processes, not equal to the global-batch ones.)
        """
        ready = [ly for ly in self.layers.values() if ly.a_count and ly.g_count]
        if ready:
            self._fold_ready(ready, gamma)
        for ly in self.layers.values():
            ly.reset()

    def _fold_ready(self, ready: list[LayerFactors], gamma: float) -> None:
        distributed = dist.is_available() and dist.is_initialized()
        distributed = distributed and dist.get_world_size() > 1
        self._merge_slots(ready)
        self._write_last_entries(ready, force=distributed)
        g_scale: torch.Tensor | float = 1.0
        if distributed:
            g_scale = self._average_over_processes(ready)
        else:
            # averages over micro-batches: nothing to do for the usual single one
            several = [ly for ly in ready if ly.a_count > 1 or ly.g_count > 1]
            if several:
                torch._foreach_div_(
                    [t for ly in several for t in (ly.a_sum, ly.g_sum)],
                    [float(c) for ly in several for c in (ly.a_count, ly.g_count)],
                )
                for ly in several:
                    ly.last_written = None
        scaler = self.grad_scaler
        if scaler is not None and scaler.is_enabled() and scaler._scale is not None:
            g_scale = g_scale * scaler._scale.double().square().float()
        if not isinstance(g_scale, float) or g_scale != 1.0:
            torch._foreach_div_([ly.g_sum for ly in ready], g_scale)
        for fold in self._folds(ready):
            fold(self.ema, gamma)

    @staticmethod
    def _merge_slots(ready: list[LayerFactors]) -> None:
        """Gathers each layer's confirmed statistics into slot 0 (``a_sum``): in place
        when the first micro-batch used it, by a copy otherwise, then one batched
        addition per further micro-batch."""
        copies: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        adds: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []
        for ly in ready:
            order = list(ly.confirmed)
            if order == [0]:
                continue
            if 0 in order:
                order.remove(0)
            else:
                first = order.pop(0)
                copies[0].append(ly.a_sum)
                copies[1].append(ly.slots[first])
                ly.last_written = None  # the copy overwrote the last entry too
            for k, slot in enumerate(order):
                if k == len(adds):
                    adds.append(([], []))
                adds[k][0].append(ly.a_sum)
                adds[k][1].append(ly.slots[slot])
        if copies[0]:
            torch._foreach_copy_(*copies)
        for dst, src in adds:
            torch._foreach_add_(dst, src)

    @staticmethod
    def _write_last_entries(ready: list[LayerFactors], force: bool) -> None:
        """Sets the last entry of ``a_sum`` where the rule left it to the fold (the bias
        column, a norm layer's size entry), unless it already holds that value."""
        stale = [ly for ly in ready if ly.has_last and (force or ly.last_written != ly.last_sum)]
        if not stale:
            return
        ends = [ly.a_sum[-1:] for ly in stale]
        torch._foreach_zero_(ends)
        torch._foreach_add_(ends, [ly.last_sum for ly in stale])
        for ly in stale:
            # an all-reduce or an average will change it again
            ly.last_written = None if force or ly.a_count > 1 else ly.last_sum

    def _average_over_processes(self, ready: list[LayerFactors]) -> float:
        """Sums the statistics and counts over processes and divides by the counts."""
        device = ready[0].a_sum.device
        counts = torch.tensor(
            [c for ly in ready for c in (ly.a_count, ly.g_count)], dtype=torch.float32
        )
        if device.type == "cuda":  # a pinned source keeps the copy asynchronous
            counts = counts.pin_memory()
        counts = counts.to(device, non_blocking=True)
        sums = [t for ly in ready for t in (ly.a_sum, ly.g_sum)]
        g_scale = self._all_reduce(sums + [counts])
        torch._foreach_div_(sums, list(counts.unbind()))
        return g_scale

    def _folds(self, ready: list[LayerFactors]) -> list[FactorFold]:
        """One :class:`FactorFold` per device for the ``ready`` layers: the fold's one
        cache, kept per set of ready layers (usually all of them) until a tensor moves."""
        if self._fold_cache[0] != self.generation:
            self._fold_cache = (self.generation, {})
        folds = self._fold_cache[1]
        key = tuple(ly.name for ly in ready)
        if key not in folds:
            by_device: dict[torch.device, list[list[torch.Tensor]]] = {}
            for ly in ready:
                emas, news, useds = by_device.setdefault(ly.a_ema.device, [[], [], []])
                emas += (ly.a_ema, ly.g_ema)
                news += (ly.a_sum, ly.g_sum)
                useds += (ly.a, ly.g)
            if len(folds) >= _MAX_FOLD_SETS:
                del folds[next(iter(folds))]
            folds[key] = [FactorFold(*lists, impl=self.impl) for lists in by_device.values()]
        return folds[key]

    @staticmethod
    def _all_reduce(tensors: list[torch.Tensor]) -> float:
        """Sums ``tensors`` over processes in one bucketed call; returns the factor
        that gradient statistics must be divided by (``world_size**2``)."""
        flat = torch.cat([t.reshape(-1) for t in tensors])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        torch._foreach_copy_(tensors, list(flat.split([t.numel() for t in tensors])))
        return float(dist.get_world_size()) ** 2

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        """Running factors by layer name (accumulators are not saved: a checkpoint is
        taken between optimizer steps, when they are empty)."""
        return {
            name: {
                "a": ly.a_ema.clone(),
                "g": ly.g_ema.clone(),
                "a_used": ly.a.clone(),
                "g_used": ly.g.clone(),
            }
            for name, ly in self.layers.items()
        }

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
            entry = state[name]
            for key, dst in (("a", ly.a_ema), ("g", ly.g_ema), ("a_used", ly.a), ("g_used", ly.g)):
                src = entry[key]
                if src.shape != dst.shape:
                    raise ValueError(
                        f"factor {key!r} of layer {name!r} has shape {tuple(src.shape)}, "
                        f"expected {tuple(dst.shape)}"
                    )
                dst.copy_(src)

    def remove(self) -> None:
        """Removes every hook; factors stay readable."""
        for ly in self.layers.values():
            for h in ly.handles:
                h.remove()
            ly.handles.clear()
        model = self._model_ref()
        if model is not None and _ATTACHED.get(model) is self:
            del _ATTACHED[model]

    def __enter__(self) -> FisherCollector:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def __repr__(self) -> str:
        return f"FisherCollector(layers={len(self.layers)}, ema={self.ema!r})"
