"""AdaFisher for the stock ``transformers.Trainer``: the optimizer factories.

From transformers 5.17 on, ``Trainer(optimizer_cls_and_kwargs=(factory, kwargs))`` accepts
a class that is not an optimizer, instantiates it and calls it with the model and the
kwargs. The factories below build the optimizer with
:func:`~hf_triaccel.optim.adafisher.build_adafisher`, the one builder every entry point
uses (parameters grouped by :func:`~hf_triaccel.optim.groups.param_groups`), from an
:class:`~hf_triaccel.optim.config.AdaFisherConfig`. With an older transformers, build the
optimizer yourself and pass ``optimizers=(optimizer, None)``.

The factories alone give the optimizer;
:class:`~hf_triaccel.integrations.callback.TriAccelCallback` adds what the Trainer's
lifecycle needs (hooks detached after training, fp16 statistics unscaled, the precision
controller and its report).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from hf_triaccel.optim.adafisher import AdaFisher, build_adafisher, optimizer_class
from hf_triaccel.optim.config import AdaFisherConfig


class AdaFisherFactory:
    """AdaFisher (L2 decay) for the stock ``transformers.Trainer`` (5.17 or later):
    ``Trainer(..., optimizer_cls_and_kwargs=(AdaFisherFactory, {"lr": 1e-3}))``.

    The Trainer instantiates the class and calls it with the model and the kwargs (the
    :class:`AdaFisherConfig` fields; left out, a field takes its default, so the learning
    rate is AdaFisher's own and not ``TrainingArguments.learning_rate``).
    :func:`trainer_optimizer` builds the pair and checks the kwargs at once.

    Example:
        >>> opt = AdaFisherWFactory()(nn.Linear(4, 2), lr=3e-3)
        >>> type(opt).__name__, opt.defaults["lr"]
        ('AdaFisherW', 0.003)
        >>> opt.collector.remove()
    """

    optimizer = "adafisher"

    def __call__(self, model: nn.Module, **hyperparameters: Any) -> AdaFisher:
        config = AdaFisherConfig.from_values(hyperparameters, owner=type(self).__name__)
        return build_adafisher(model, config, self.optimizer)


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
    cls = optimizer_class(optimizer, "trainer_optimizer.optimizer")
    AdaFisherConfig.from_values(hyperparameters, owner="trainer_optimizer")
    return FACTORIES[cls.__name__.lower()], dict(hyperparameters)
