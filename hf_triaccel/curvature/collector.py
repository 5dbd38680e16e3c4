"""The Fisher collector: owns the hooks and the per-layer factors.

The collector decides *which* modules carry factors (by :func:`rule_for`), takes
their statistics with removable hooks while :attr:`FisherCollector.collecting` is on,
accumulates them over micro-batches, and folds them into the running factors once
per optimizer step (:meth:`FisherCollector.fold`). *When* to collect is the
optimizer's decision. Factors are saved by layer name.
"""

from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from hf_triaccel.curvature.fold import fold_factors
from hf_triaccel.curvature.rules import FactorLayout, FisherRule, rule_for

# model -> its collector; weak, and outside the model so that copies of the model
# (EMA or teacher copies) do not carry it
_ATTACHED: weakref.WeakKeyDictionary[nn.Module, FisherCollector] = weakref.WeakKeyDictionary()


@dataclass
class LayerFactors:
    """Factors of one module.

    ``a`` and ``g`` are what the preconditioner reads; ``a_ema`` / ``g_ema`` the
    running averages (the same tensors in ``ema="reference"`` mode). ``a_sum`` /
    ``g_sum`` accumulate the statistics of the current optimizer step over its
    micro-batches; ``a_count`` / ``g_count`` count them. ``output_module`` is where
    the output gradient is taken (the module itself, or a submodule before a fused
    activation); ``pending_a`` holds activation statistics waiting for their gradient.
    """

    name: str
    module: nn.Module
    rule: FisherRule
    layouts: dict[str, FactorLayout]
    a_ema: torch.Tensor
    g_ema: torch.Tensor
    a: torch.Tensor
    g: torch.Tensor
    a_sum: torch.Tensor
    g_sum: torch.Tensor
    output_module: nn.Module | None = None
    a_count: int = 0
    g_count: int = 0
    pending_a: list[torch.Tensor] = field(default_factory=list)
    handles: list[RemovableHandle] = field(default_factory=list)

    @property
    def device(self) -> torch.device:
        return next(self.module.parameters()).device

    def tensors(self) -> list[torch.Tensor]:
        return [self.a_ema, self.g_ema, self.a, self.g, self.a_sum, self.g_sum]


@dataclass(frozen=True)
class ParamFactors:
    """What the update needs for one parameter: its two factor vectors and layout."""

    g: torch.Tensor
    a: torch.Tensor
    layout: FactorLayout


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
        if ema not in ("reference", "paper"):
            raise ValueError(f"ema={ema!r} is not one of ('reference', 'paper')")
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
        self.layers: dict[str, LayerFactors] = {}
        self._by_param: dict[nn.Parameter, ParamFactors] = {}
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
        device = next(iter(owned.values())).device
        a_len, g_len = rule.sizes(module)
        paper = self.ema == "paper"
        # Factors start at ones. In paper mode only the normalised EMA is ever read,
        # and min-max normalisation removes any constant, so the EMA is kept without
        # the seed's share gamma^t: the same result, without float32 cancellation
        # when the statistics are tiny next to 1.
        seed = torch.zeros if paper else torch.ones
        a_ema = seed(a_len, device=device)
        g_ema = seed(g_len, device=device)
        layer = LayerFactors(
            name=name,
            module=module,
            rule=rule,
            layouts={k: layouts[k] for k in owned},
            a_ema=a_ema,
            g_ema=g_ema,
            a=torch.ones_like(a_ema) if paper else a_ema,
            g=torch.ones_like(g_ema) if paper else g_ema,
            a_sum=torch.zeros(a_len, device=device),
            g_sum=torch.zeros(g_len, device=device),
            output_module=rule.output_module(module),
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

    def _pre_hook(self, layer: LayerFactors):
        """Takes the activation statistic from the module input, before its forward."""

        def hook(module, args, kwargs):
            # a deep copy of the model shares these closures: ignore the copy's calls
            if not self.collecting or module is not layer.module or not torch.is_grad_enabled():
                return
            x = args[0] if args else next(iter(kwargs.values()))
            if layer.a_sum.device != layer.device:  # the model moved since the last call
                for t in layer.tensors():
                    t.data = t.data.to(layer.device)
            with torch.no_grad():
                layer.pending_a.append(layer.rule.a_stat(module, x.detach(), self.impl))

        return hook

    def _output_hook(self, layer: LayerFactors):
        """Pairs the pending activation statistic with the gradient of the output.

        The statistic is added only when the gradient arrives, so a forward that no
        backward follows (an evaluation pass with autograd on) leaves no trace.
        """

        def hook(module, args, output):
            if module is not layer.output_module or not layer.pending_a:
                return
            a = layer.pending_a.pop()
            if not isinstance(output, torch.Tensor) or not output.requires_grad:
                return

            def grad_hook(grad: torch.Tensor) -> None:
                with torch.no_grad():
                    layer.a_sum.add_(a)
                    layer.g_sum.add_(layer.rule.g_stat(layer.module, grad, self.impl))
                layer.a_count += 1
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
            ly.a_sum.zero_()
            ly.g_sum.zero_()
            ly.a_count = ly.g_count = 0
            ly.pending_a.clear()

    def _fold_ready(self, ready: list[LayerFactors], gamma: float) -> None:
        device = ready[0].a_sum.device
        counts = torch.tensor(
            [c for ly in ready for c in (ly.a_count, ly.g_count)], dtype=torch.float32
        )
        if device.type == "cuda":  # a pinned source keeps the copy asynchronous
            counts = counts.pin_memory()
        counts = counts.to(device, non_blocking=True)
        sums = [t for ly in ready for t in (ly.a_sum, ly.g_sum)]
        g_scale = self._all_reduce(sums + [counts])
        scaler = self.grad_scaler
        if scaler is not None and scaler.is_enabled() and scaler._scale is not None:
            g_scale = g_scale * scaler._scale.double().square().float()
        torch._foreach_div_(sums, list(counts.unbind()))
        torch._foreach_div_([ly.g_sum for ly in ready], g_scale)
        by_device: dict[torch.device, list[LayerFactors]] = {}
        for ly in ready:
            by_device.setdefault(ly.a_ema.device, []).append(ly)
        for group in by_device.values():
            fold_factors(
                [t for ly in group for t in (ly.a_ema, ly.g_ema)],
                [t for ly in group for t in (ly.a_sum, ly.g_sum)],
                [t for ly in group for t in (ly.a, ly.g)],
                self.ema,
                gamma,
                self.impl,
            )

    @staticmethod
    def _all_reduce(tensors: list[torch.Tensor]) -> torch.Tensor | float:
        """Sums ``tensors`` over processes in one bucketed call; returns the factor
        that gradient statistics must be divided by (``world_size**2``)."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return 1.0
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
