"""AdaFisher for every entry point: one builder, one configuration, one parameter-group rule.

:func:`build_adafisher` is the only place an integration builds AdaFisher or AdaFisherW
for a model: it attaches the :class:`~hf_triaccel.curvature.collector.FisherCollector`
and groups the parameters with :func:`~hf_triaccel.optim.groups.param_groups` (no decay
on biases and normalisation weights). ``TriAccelTrainer``, the Accelerate helper, the
stock-``Trainer`` factories below and the timm registration all go through it, with
hyperparameters validated by :class:`~hf_triaccel.optim.config.AdaFisherConfig`.

The factories serve the stock ``transformers.Trainer``: from transformers 5.17 on,
``Trainer(optimizer_cls_and_kwargs=(factory, kwargs))`` accepts a class that is not an
optimizer, instantiates it and calls it with the model. With an older transformers, build
the optimizer yourself and pass ``optimizers=(optimizer, None)``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from hf_triaccel.optim.adafisher import AdaFisher, AdaFisherW
from hf_triaccel.optim.config import AdaFisherConfig
from hf_triaccel.optim.groups import param_groups

OPTIMIZERS: dict[str, type[AdaFisher]] = {"adafisher": AdaFisher, "adafisherw": AdaFisherW}
"""hf_triaccel's optimizers by the name every entry point accepts."""

_FIELD_IN_ERROR = re.compile(r"^AdaFisherConfig\.(\w+)")


def optimizer_name(name: Any, owner: str) -> str:
    """``name`` as a key of :data:`OPTIMIZERS` (any case).

    Raises:
        ValueError: naming ``owner`` and listing the valid names.

    Example:
        >>> optimizer_name("AdaFisherW", "TriAccelPlugin.optimizer")
        'adafisherw'
    """
    key = str(getattr(name, "value", name)).lower()
    if key not in OPTIMIZERS:
        raise ValueError(f"{owner}={name!r} is not one of {sorted(OPTIMIZERS)}")
    return key


def adafisher_config(
    owner: str, values: Mapping[str, Any], names: Mapping[str, str] | None = None
) -> AdaFisherConfig:
    """An :class:`AdaFisherConfig` from ``values``, with errors that name the entry point's
    own field: ``names`` maps a config field to it (e.g. ``"beta"`` ->
    ``"adafisher_beta"``).

    Raises:
        ValueError: a value out of range, as ``owner.<field>=value: what it needs``.
        TypeError: a name that is not a field of the config.

    Example:
        >>> adafisher_config("TriAccelArguments", {"beta": 2.0}, {"beta": "adafisher_beta"})
        Traceback (most recent call last):
        ...
        ValueError: TriAccelArguments.adafisher_beta=2.0: needs 0 <= beta < 1
    """
    try:
        return AdaFisherConfig(**values)
    except ValueError as err:
        message = str(err)
        found = _FIELD_IN_ERROR.match(message)
        if found is None:
            raise
        field = (names or {}).get(found.group(1), found.group(1))
        raise ValueError(f"{owner}.{field}{message[found.end() :]}") from None


def build_adafisher(
    model: nn.Module,
    optimizer: str = "adafisherw",
    config: AdaFisherConfig | None = None,
    *,
    params: Any = None,
    grad_scaler: torch.amp.GradScaler | None = None,
    **torch_flags: Any,
) -> AdaFisher:
    """AdaFisher or AdaFisherW for ``model``, with its Fisher collector.

    Args:
        model: the unwrapped model (its modules carry the Fisher factors).
        optimizer: ``"adafisher"`` (L2 decay) or ``"adafisherw"`` (decoupled decay).
        config: hyperparameters (default: :class:`AdaFisherConfig` defaults).
        params: parameters or param groups; default, the trainable parameters in the two
            groups of :func:`~hf_triaccel.optim.groups.param_groups`.
        grad_scaler: the loss scaler of fp16 training, so that statistics are unscaled.
        **torch_flags: torch.optim flags passed to the optimizer (``foreach``, ...).

    Example:
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
        >>> opt = build_adafisher(model, config=AdaFisherConfig(weight_decay=0.1))
        >>> [(len(g["params"]), g["weight_decay"]) for g in opt.param_groups]
        [(1, 0.1), (3, 0.0)]
        >>> opt.collector.remove()
    """
    cls = OPTIMIZERS[optimizer_name(optimizer, "optimizer")]
    config = config or AdaFisherConfig()
    collector = config.build_collector(model)
    collector.grad_scaler = grad_scaler
    if params is None:
        params = param_groups(model, config.weight_decay)
    return cls(params, collector, **config.optimizer_kwargs(), **torch_flags)


class AdaFisherFactory:
    """AdaFisher (L2 decay) for the stock ``transformers.Trainer`` (5.17 or later):
    ``Trainer(..., optimizer_cls_and_kwargs=(AdaFisherFactory, {"lr": 1e-3}))``.

    The Trainer instantiates the class and calls it with the model and the kwargs (the
    :class:`AdaFisherConfig` fields; left out, a field takes its default, so the learning
    rate is AdaFisher's own and not ``TrainingArguments.learning_rate``). Parameters are
    grouped by :func:`~hf_triaccel.optim.groups.param_groups` with the kwargs'
    ``weight_decay``. :func:`trainer_optimizer` builds the pair and checks the kwargs at
    once.

    The stock Trainer neither unscales fp16 statistics nor removes the Fisher hooks after
    training: ``TriAccelTrainer`` does both (and adds adaptive precision and the elastic
    batch).

    Example:
        >>> opt = AdaFisherWFactory()(nn.Linear(4, 2), lr=3e-3)
        >>> type(opt).__name__, opt.defaults["lr"]
        ('AdaFisherW', 0.003)
        >>> opt.collector.remove()
    """

    optimizer = "adafisher"

    def __call__(self, model: nn.Module, **hyperparameters: Any) -> AdaFisher:
        config = adafisher_config(type(self).__name__, hyperparameters)
        return build_adafisher(model, self.optimizer, config)


class AdaFisherWFactory(AdaFisherFactory):
    """AdaFisherW (decoupled decay) for the stock ``transformers.Trainer``; see
    :class:`AdaFisherFactory`."""

    optimizer = "adafisherw"


FACTORIES: dict[str, type[AdaFisherFactory]] = {
    "adafisher": AdaFisherFactory,
    "adafisherw": AdaFisherWFactory,
}


def trainer_optimizer(
    optimizer: str = "adafisherw", **hyperparameters: Any
) -> tuple[type[AdaFisherFactory], dict[str, Any]]:
    """The ``optimizer_cls_and_kwargs`` pair of the stock ``transformers.Trainer`` for
    hf_triaccel's ``optimizer``, with ``hyperparameters`` (:class:`AdaFisherConfig`
    fields) checked now rather than when training starts.

    Raises:
        ValueError: an unknown optimizer or a value out of range, naming it.

    Example:
        >>> factory, kwargs = trainer_optimizer("adafisherw", lr=2e-3, weight_decay=0.01)
        >>> factory.__name__, kwargs
        ('AdaFisherWFactory', {'lr': 0.002, 'weight_decay': 0.01})
        >>> trainer_optimizer(lr=-1.0)
        Traceback (most recent call last):
        ...
        ValueError: trainer_optimizer.lr=-1.0: needs >= 0
    """
    name = optimizer_name(optimizer, "trainer_optimizer.optimizer")
    adafisher_config("trainer_optimizer", hyperparameters)
    return FACTORIES[name], dict(hyperparameters)
