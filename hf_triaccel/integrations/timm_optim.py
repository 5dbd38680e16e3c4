"""AdaFisher in timm's optimizer registry: ``create_optimizer_v2(model, "adafisherw")``.

timm builds the parameter groups from the model (no weight decay on 1-D parameters and
biases: for timm models the same split as :func:`~hf_triaccel.optim.groups.param_groups`)
and hands the optimizer only the groups. AdaFisher's Fisher factors need the modules, so
the optimizer timm creates binds itself to its model at the model's first forward: a
global module forward pre-hook (torch's public ``register_module_forward_pre_hook``) waits
for the first module whose parameters include all of the optimizer's, skips wrappers
(a module without parameters of its own and with one child, such as DDP or a compiled
module), builds the :class:`~hf_triaccel.curvature.collector.FisherCollector` there and
removes itself. The statistics of that first forward are taken, as AdaFisher's first
refresh needs, except for a model that is itself a single layer.

Under fp16 loss scaling set ``optimizer.collector.grad_scaler = scaler`` after the first
forward, so that the statistics are unscaled.
"""

from __future__ import annotations

import dataclasses
import warnings
import weakref
from typing import Any

import torch
from torch import nn

from hf_triaccel.curvature.collector import FisherCollector
from hf_triaccel.optim.adafisher import OPTIMIZERS, AdaFisher
from hf_triaccel.optim.config import AdaFisherConfig

_DESCRIPTIONS = {
    "adafisher": "AdaFisher: diagonal Kronecker-factored Fisher preconditioning, L2 decay "
    "(hf_triaccel)",
    "adafisherw": "AdaFisherW: AdaFisher with decoupled weight decay (hf_triaccel)",
}

_CONFIG_FIELDS = tuple(f.name for f in dataclasses.fields(AdaFisherConfig))


def _is_wrapper(module: nn.Module) -> bool:
    """A module that only forwards to one child (DDP, compiled modules, thin wrappers)."""
    children = iter(module.children())
    only_child = next(children, None) is not None and next(children, None) is None
    return only_child and next(module.parameters(recurse=False), None) is None


class _BindAtFirstForward:
    """Builds the optimizer's collector on the first module forward that covers its
    parameters, then removes itself."""

    def __init__(self, optimizer: AdaFisher) -> None:
        self.optimizer = weakref.ref(optimizer)
        self.params = {p for group in optimizer.param_groups for p in group["params"]}
        self.handle = torch.nn.modules.module.register_module_forward_pre_hook(self)

    def __call__(self, module: nn.Module, args: Any) -> None:
        optimizer = self.optimizer()
        if optimizer is None or optimizer.collector is not None:
            self.handle.remove()
            return
        if _is_wrapper(module) or not self.params <= set(module.parameters()):
            return
        self.handle.remove()
        config = optimizer.config
        optimizer.collector = FisherCollector(
            module, ema=config.ema, factor_init=config.factor_init, impl=config.impl
        )


def _timm_optimizer(name: str):
    cls = OPTIMIZERS[name]

    def create(params: Any, **kwargs: Any) -> AdaFisher:
        fields = {k: kwargs.pop(k) for k in list(kwargs) if k in _CONFIG_FIELDS}
        config = AdaFisherConfig.from_values(fields, owner=f"create_optimizer_v2({name!r})")
        with warnings.catch_warnings():
            # the collector is attached at the first forward (see the module docstring)
            warnings.filterwarnings("ignore", message=".*without a FisherCollector")
            optimizer = cls(params, None, config=config, **kwargs)
        _BindAtFirstForward(optimizer)
        return optimizer

    create.__name__ = create.__qualname__ = cls.__name__
    return create


def register_timm_optimizers() -> list[str]:
    """Registers ``"adafisher"`` and ``"adafisherw"`` in timm's optimizer registry, so that
    ``timm.optim.create_optimizer_v2(model, "adafisherw", lr=..., weight_decay=...)`` builds
    them (AdaFisher's other hyperparameters pass as keyword arguments: ``update_every=50``).
    Calling it again leaves the registry as it is (timm warns when a name is registered
    twice).

    Returns:
        The registered names.

    Example:
        >>> import timm.optim
        >>> register_timm_optimizers()
        ['adafisher', 'adafisherw']
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> opt = timm.optim.create_optimizer_v2(model, "adafisherw", lr=1e-3)
        >>> _ = model(torch.randn(3, 4))  # the first forward binds the Fisher collector
        >>> sorted(opt.collector.layers)
        ['0', '2']
        >>> opt.collector.remove()
    """
    # timm's registry object is only reachable through its factory module
    from timm.optim import OptimInfo
    from timm.optim._optim_factory import default_registry

    registered = set(default_registry.list_optimizers())
    for name in OPTIMIZERS:
        info = default_registry.get_optimizer_info(name) if name in registered else None
        if info is not None and info.description == _DESCRIPTIONS[name]:
            continue  # ours already
        default_registry.register(
            OptimInfo(
                name=name,
                opt_class=_timm_optimizer(name),
                description=_DESCRIPTIONS[name],
                has_eps=False,
                has_momentum=False,
                has_betas=False,
            )
        )
    return list(OPTIMIZERS)
