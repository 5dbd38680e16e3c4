"""AdaFisher in any ``transformers.Trainer``, the stock one and TRL's included: a callback
and the optimizer factory it hands the Trainer.

The Trainer builds its optimizer through ``optimizer_cls_and_kwargs`` (transformers 5.17
and later call a factory with the model) and runs its callbacks around training; those two
extension points carry everything AdaFisher needs from the Trainer's lifecycle::

    triaccel = TriAccelCallback(lr=1e-3, weight_decay=0.01, precision=True)
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=data,
        callbacks=[triaccel],
        optimizer_cls_and_kwargs=triaccel.optimizer_cls_and_kwargs,
    )

* the factory builds the optimizer, its Fisher collector and the controllers the
  settings ask for (``TriAccelPlugin.build``), when the Trainer creates its optimizer:
  before a checkpoint's optimizer state is loaded, so the controllers' state resumes
  with it;
* ``on_train_begin`` hands the collector the fp16 loss scaler (the prepared optimizer's
  ``scaler``), so that statistics are unscaled, and attaches the hooks again after a
  previous ``train()``;
* ``on_train_end`` writes the precision report (``report_dir``) and takes the hooks off
  the model (the collector keeps its factors).

``on_train_end`` does not run when training raises: the hooks then stay until
:meth:`TriAccelCallback.detach` (``TriAccelTrainer`` detaches them in ``train``'s cleanup).
The elastic batch re-runs a step in pieces inside ``training_step``, for which the Trainer
has no extension point: it needs :class:`~hf_triaccel.integrations.trainer.TriAccelMixin`
on the trainer's class.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn
from transformers import TrainerCallback

from hf_triaccel.integrations.low_memory import (
    announce_low_memory,
    ledger_report,
    release_blockers,
)
from hf_triaccel.integrations.plugin import TriAccelParts, TriAccelPlugin
from hf_triaccel.integrations.precision_report import (
    PRECISION_MAP_NAME,
    has_matplotlib,
    write_precision_report,
)
from hf_triaccel.optim.adafisher import AdaFisher


def inner_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside Accelerate's (or SageMaker's) wrapper.

    Example:
        >>> sgd = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
        >>> inner_optimizer(sgd) is sgd
        True
    """
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


class OptimizerFromCallback:
    """The optimizer factory of :attr:`TriAccelCallback.optimizer_cls_and_kwargs`: the
    Trainer instantiates it and calls it with the model and ``callback=...``."""

    def __call__(self, model: nn.Module, callback: TriAccelCallback) -> AdaFisher:
        return callback.build(model)


class TriAccelCallback(TrainerCallback):
    """AdaFisher or AdaFisherW with its hooks, controllers and precision report, for any
    ``transformers.Trainer``: pass it in ``callbacks`` and its
    :attr:`optimizer_cls_and_kwargs` to the Trainer (see the module's docstring).

    Args:
        plugin: the settings (a :class:`TriAccelPlugin`); or else
        **settings: its fields by name (``optimizer="adafisherw"``, ``lr``,
            ``weight_decay``, ``precision``...), checked now.
        report_dir: folder that receives the precision report (``precision_map.png``,
            ``signals.json``) when training ends; default none.
        telemetry: an :class:`~hf_triaccel.integrations.telemetry.EfficiencyTelemetry`
            that reports the controllers' counts (``TriAccelTrainer`` passes its own).

    Example:
        >>> triaccel = TriAccelCallback(lr=2e-3, update_every=10)
        >>> factory, kwargs = triaccel.optimizer_cls_and_kwargs
        >>> optimizer = factory()(nn.Linear(4, 2), **kwargs)
        >>> type(optimizer).__name__, optimizer.defaults["lr"], optimizer.update_every
        ('AdaFisherW', 0.002, 10)
        >>> triaccel.detach()
        >>> TriAccelCallback(lr=-1.0)
        Traceback (most recent call last):
        ...
        ValueError: TriAccelCallback.lr=-1.0: needs >= 0
    """

    def __init__(
        self,
        plugin: TriAccelPlugin | None = None,
        *,
        report_dir: str | None = None,
        telemetry: Any = None,
        **settings: Any,
    ) -> None:
        if plugin is not None and settings:
            raise TypeError(
                f"TriAccelCallback: give a plugin or settings, not both (got {sorted(settings)})"
            )
        self.plugin = plugin or TriAccelPlugin.from_values(settings, owner="TriAccelCallback")
        self.report_dir = report_dir
        self.telemetry = telemetry
        self.parts: TriAccelParts | None = None
        self.fp16 = False
        self._carried_state: dict[str, Any] | None = None

    @property
    def optimizer_cls_and_kwargs(self) -> tuple[type, dict[str, Any]]:
        """The Trainer's ``optimizer_cls_and_kwargs``: a factory that calls :meth:`build`."""
        return OptimizerFromCallback, {"callback": self}

    @property
    def optimizer(self) -> AdaFisher | None:
        """The optimizer :meth:`build` built last (``None`` before)."""
        return None if self.parts is None else self.parts.optimizer

    def carry_state(self, state_dict: dict[str, Any]) -> None:
        """A state dict for the next optimizer :meth:`build` builds to load (an optimizer
        rebuilt on the same model continues where the last one stopped)."""
        self._carried_state = state_dict

    def build(self, model: nn.Module) -> AdaFisher:
        """The optimizer and controllers of :attr:`plugin` on ``model`` (what the Trainer's
        factory call runs); a previous build's hooks are taken off first."""
        self.detach()
        self.parts = parts = self.plugin.build(model, fp16=self.fp16)
        if self._carried_state is not None:
            parts.optimizer.load_state_dict(self._carried_state)
            self._carried_state = None
        if self.telemetry is not None and parts.precision is not None:
            self.telemetry.add_provider(parts.precision.counts, "precision")
        if self.telemetry is not None and parts.steering is not None:
            self.telemetry.add_provider(parts.steering.summary, "steering")
        if self.telemetry is not None:
            optimizer = parts.optimizer
            self.telemetry.add_provider(lambda: ledger_report(model, optimizer), "memory_ledger")
        return parts.optimizer

    def detach(self) -> None:
        """Takes the controllers' hooks and the Fisher hooks off the model; the collector
        keeps its factors (a repeat does nothing)."""
        if self.parts is not None:
            self.parts.remove()

    def on_init_end(self, args, state, control, **kwargs):
        self.fp16 = bool(args.fp16)

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        parts = self.parts
        if parts is None or inner_optimizer(optimizer) is not parts.optimizer:
            raise ValueError(
                "TriAccelCallback: the Trainer's optimizer is not the one this callback "
                "builds; pass optimizer_cls_and_kwargs=callback.optimizer_cls_and_kwargs "
                "to the Trainer (and no optimizers=...)"
            )
        blockers = release_blockers(args) if parts.optimizer.config.release_grads else []
        if blockers:
            raise ValueError(
                "TriAccelCallback: release_grads=True cannot release in this run: "
                + "; ".join(blockers)
            )
        if kwargs.get("model") is not None:
            announce_low_memory(args, kwargs["model"])
        collector = parts.optimizer.collector
        collector.grad_scaler = getattr(optimizer, "scaler", None)  # Accelerate's, under fp16
        if not collector.attached:
            if parts.precision is not None or parts.steering is not None:
                raise RuntimeError(
                    "TriAccelCallback: the controllers (precision, lr_steering) were removed "
                    "when the last train() ended; build a new Trainer for another train(), "
                    "or use TriAccelTrainer, which rebuilds them"
                )
            collector.attach()
        if parts.precision is not None and state.is_world_process_zero and not has_matplotlib():
            warnings.warn(
                "precision: matplotlib is not installed, so the precision map "
                f"({PRECISION_MAP_NAME}) will be skipped; install it with "
                "pip install 'hf-triaccel[hf]'",
                stacklevel=2,
            )

    def on_train_end(self, args, state, control, **kwargs):
        parts, folder = self.parts, self.report_dir
        report = parts is not None and parts.precision is not None and folder is not None
        if report and state.is_world_process_zero:
            write_precision_report(folder, parts.precision, parts.signals, state.global_step)
        self.detach()
