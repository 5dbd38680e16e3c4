"""Accelerate integration: the ``TriAccelPlugin`` and the one call that applies it.

Accelerate has no registry for third-party plugins, so this is a dataclass in the
style of its own plugins (fields with help) plus :func:`prepare_triaccel`, which builds
the optimizer and its Fisher collector and hands everything to ``Accelerator.prepare``.
The plugin *is* an :class:`~hf_triaccel.optim.config.AdaFisherConfig` (the same fields
under the same names, defaults and validation: a new hyperparameter reaches it without a
line here) with the optimizer's name and the controllers' settings added. It is the
settings object of every hf_triaccel run: ``TriAccelArguments.to_plugin()`` gives the
Trainer's, and :class:`~hf_triaccel.integrations.callback.TriAccelCallback` holds one.
:meth:`TriAccelPlugin.build` builds the optimizer with
:func:`~hf_triaccel.optim.adafisher.build_adafisher` (the one builder) and the controllers.
Settings come from the fields only: the one environment
variable hf_triaccel reads is ``HF_TRIACCEL_IMPL`` (the kernel implementation).

As in ``TriAccelTrainer``, a model with 2-D convolutions is put in channels_last
(``channels_last``; the loop feeds it batches through :meth:`TriAccelPrepared.batch`), and
a compiled model (``torch.compile(model)``, or an ``Accelerator`` with a dynamo backend)
runs its refresh steps eagerly (:mod:`~hf_triaccel.integrations.compiled`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from torch import nn

from hf_triaccel.curvature.collector import FisherCollector
from hf_triaccel.curvature.signals import SignalTracker
from hf_triaccel.integrations.compiled import eager_module, route_refresh_steps
from hf_triaccel.integrations.layout import channels_last_batch, to_channels_last
from hf_triaccel.optim.adafisher import AdaFisher, build_adafisher, optimizer_class
from hf_triaccel.optim.checkpoint import keep_in_state_dict
from hf_triaccel.optim.config import AdaFisherConfig
from hf_triaccel.optim.steering import StepSizeSteering
from hf_triaccel.precision import PrecisionController, PrecisionPolicy


@dataclass
class TriAccelPlugin(AdaFisherConfig):
    """Settings of hf_triaccel for a hand-written Accelerate loop.

    The AdaFisher fields (``lr``, ``beta``, ``damping``, ``gamma``, ``update_every``,
    ``weight_decay``, ``ema``, ``normalise``, ``impl``) are :class:`AdaFisherConfig`'s, with its
    defaults; the rest choose the optimizer and the controllers. Invalid values raise at
    construction, naming ``TriAccelPlugin.<field>``.

    Example:
        >>> from accelerate import Accelerator
        >>> plugin = TriAccelPlugin(optimizer="adafisherw", lr=1e-3, weight_decay=5e-4)
        >>> prepared = prepare_triaccel(Accelerator(cpu=True), nn.Linear(4, 2), plugin)
        >>> [g["weight_decay"] for g in prepared.optimizer.param_groups]  # the bias: none
        [0.0005, 0.0]
        >>> TriAccelPlugin(lr=-1.0)
        Traceback (most recent call last):
        ...
        ValueError: TriAccelPlugin.lr=-1.0: needs >= 0
    """

    optimizer: str = field(
        default="adafisherw",
        metadata={"help": "adafisher (L2 decay) or adafisherw (decoupled decay)."},
    )
    precision: bool = field(
        default=False,
        metadata={
            "help": "Per-module adaptive compute precision (fp32 / bf16 / fp16) steered by "
            "the Fisher signals."
        },
    )
    signals_every: int = field(
        default=200,
        metadata={"help": "Re-evaluate signals and precision every N optimizer steps."},
    )
    fp32_fraction: float = field(
        default=PrecisionPolicy.fp32_fraction,
        metadata={
            "help": "Share of the compute and of the activations kept in fp32, given to the "
            "modules most sensitive per unit of that cost."
        },
    )
    fp16_fraction: float | None = field(
        default=None,
        metadata={
            "help": "Share of the compute and activations in fp16, least sensitive first (default "
            "0.25 under fp16 mixed precision, where a loss scaler exists, else 0)."
        },
    )
    lr_steering: bool = field(
        default=False,
        metadata={
            "help": "Per-module step-size scale from the curvature signal, re-decided at each "
            "signals evaluation (experimental)."
        },
    )
    channels_last: bool = field(
        default=True,
        metadata={
            "help": "Put a model with 2-D convolutions in channels_last memory format "
            "(cuDNN's fastest convolutions in bf16/fp16; a hand-written loop feeds it batches "
            "through TriAccelPrepared.batch); other models are left as they are."
        },
    )

    def __post_init__(self) -> None:
        self.validate(owner="TriAccelPlugin")
        name = optimizer_class(self.optimizer, "TriAccelPlugin.optimizer").__name__
        self.optimizer = name.lower()
        for name in ("fp32_fraction", "fp16_fraction"):
            value = getattr(self, name)
            if value is not None and not 0.0 <= value <= 1.0:
                raise ValueError(f"TriAccelPlugin.{name}={value!r}: must lie in [0, 1]")
        if not self.signals_every >= 1:
            raise ValueError(f"TriAccelPlugin.signals_every={self.signals_every!r}: needs >= 1")

    def build_optimizer(
        self, model: nn.Module, params: Any = None, grad_scaler: torch.amp.GradScaler | None = None
    ) -> AdaFisher:
        """Builds the collector for ``model`` and the optimizer over ``params``.

        Args:
            model: the unwrapped model whose modules carry the Fisher factors.
            params: parameters or param groups (default: the trainable parameters, without
                weight decay on biases and normalisation weights).
            grad_scaler: the loss scaler of fp16 training, so that statistics are unscaled.
        """
        return build_adafisher(model, self, self.optimizer, params=params, grad_scaler=grad_scaler)

    def build(
        self,
        model: nn.Module,
        *,
        params: Any = None,
        grad_scaler: torch.amp.GradScaler | None = None,
        fp16: bool = False,
    ) -> TriAccelParts:
        """The optimizer and the controllers these settings ask for, on ``model``.

        Args:
            model: the unwrapped model whose modules carry the Fisher factors.
            params: parameters or param groups (default: the trainable parameters, without
                weight decay on biases and normalisation weights).
            grad_scaler: the loss scaler of fp16 training, so that statistics are unscaled.
            fp16: whether training runs under fp16 mixed precision.

        Example:
            >>> parts = TriAccelPlugin(lr_steering=True).build(nn.Linear(4, 2))
            >>> type(parts.optimizer).__name__, parts.precision, parts.steering is not None
            ('AdaFisherW', None, True)
            >>> parts.remove()
        """
        optimizer = self.build_optimizer(model, params, grad_scaler)
        signals, precision = self.build_precision(model, optimizer, fp16=fp16) or (None, None)
        steering = self.build_steering(optimizer, signals)
        if steering is not None:
            signals = steering.tracker
        return TriAccelParts(optimizer, signals, precision, steering)

    def build_precision(
        self, model: nn.Module, optimizer: AdaFisher, *, fp16: bool
    ) -> tuple[SignalTracker, PrecisionController] | None:
        """Signals and the precision controller for ``model``, driven by ``optimizer``'s
        steps; ``None`` unless ``precision`` is on. Their state rides along in the
        optimizer's ``state_dict``, so every checkpoint that saves the optimizer keeps it.

        Args:
            model: the unwrapped model the optimizer's collector was built on.
            optimizer: the AdaFisher optimizer (not the Accelerate wrapper).
            fp16: whether training runs under fp16 mixed precision (a loss scaler exists).
        """
        if not self.precision:
            return None
        fp16_fraction = self.fp16_fraction
        if fp16_fraction is None:
            fp16_fraction = 0.25 if fp16 else 0.0
        signals = SignalTracker(optimizer.collector, optimizer, every=self.signals_every)
        policy = PrecisionPolicy(fp32_fraction=self.fp32_fraction, fp16_fraction=fp16_fraction)
        controller = PrecisionController(model, policy, tracker=signals)
        keep_in_state_dict(optimizer, "triaccel_precision", signals=signals, precision=controller)
        return signals, controller

    def build_steering(
        self, optimizer: AdaFisher, signals: SignalTracker | None
    ) -> StepSizeSteering | None:
        """Step-size steering of ``optimizer`` from ``signals`` (the tracker
        :meth:`build_precision` built, or a new one when it built none); ``None`` unless
        ``lr_steering`` is on. Its state rides along in the optimizer's ``state_dict``.

        Example:
            >>> model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
            >>> plugin = TriAccelPlugin(lr_steering=True)
            >>> optimizer = plugin.build_optimizer(model)
            >>> plugin.build_steering(optimizer, None)
            StepSizeSteering(no evaluation yet)
        """
        if not self.lr_steering:
            return None
        parts = {}
        if signals is None:
            signals = SignalTracker(optimizer.collector, optimizer, every=self.signals_every)
            parts["signals"] = signals
        steering = StepSizeSteering(signals, optimizer)
        keep_in_state_dict(optimizer, "triaccel_steering", **parts, steering=steering)
        return steering


@dataclass
class TriAccelParts:
    """What :meth:`TriAccelPlugin.build` builds: the optimizer and its controllers."""

    optimizer: AdaFisher
    signals: SignalTracker | None = None
    precision: PrecisionController | None = None
    steering: StepSizeSteering | None = None

    def remove(self) -> None:
        """Takes the controllers' hooks off and detaches the collector, which keeps its
        factors (a repeat does nothing)."""
        for part in (self.steering, self.precision, self.signals):
            if part is not None:
                part.remove()
        self.optimizer.collector.detach()


@dataclass
class TriAccelPrepared:
    """What :func:`prepare_triaccel` returns: the prepared objects and the controllers.

    ``channels_last`` tells whether the model was put in channels_last; :meth:`batch`
    gives a batch the same layout.
    """

    model: nn.Module
    optimizer: Any
    collector: FisherCollector
    others: tuple = ()
    signals: SignalTracker | None = None
    precision: PrecisionController | None = None
    steering: StepSizeSteering | None = None
    channels_last: bool = False

    def batch(self, batch: Any) -> Any:
        """``batch`` (a tensor, or a mapping, list or tuple of them) with its 4-D image
        tensors in channels_last when the model is (see
        :func:`~hf_triaccel.integrations.layout.channels_last_batch`), else as it is.

        Example:
            >>> from accelerate import Accelerator
            >>> run = prepare_triaccel(Accelerator(cpu=True), nn.Conv2d(3, 4, 3))
            >>> run.channels_last, run.batch(torch.zeros(2, 3, 8, 8)).is_contiguous()
            (True, False)
        """
        return channels_last_batch(batch) if self.channels_last else batch


def check_distributed_support(
    distributed_type: DistributedType, fsdp_version: int | None = None
) -> None:
    """Raises for the parallelism modes AdaFisher does not support: DeepSpeed and FSDP1.

    Single device, DDP and FSDP2 (``torch.distributed.fsdp.fully_shard``, whose parameters
    are DTensors sharded by rows) are supported. DeepSpeed's ZeRO and FSDP1 flatten the
    parameters of many layers into one buffer and shard that, which hides the layer
    shapes the Fisher factors are laid out by.

    Args:
        distributed_type: the Accelerator's ``distributed_type``.
        fsdp_version: under FSDP, its version (default: the running Accelerator's FSDP
            plugin's).

    Example:
        >>> check_distributed_support(DistributedType.DEEPSPEED)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        NotImplementedError: hf_triaccel does not support DeepSpeed: ... use FSDP2 ...
    """
    fsdp2 = (
        "use FSDP2 (an accelerate config with `distributed_type: FSDP` and "
        "`fsdp_config: {fsdp_version: 2}`, or the Trainer's `fsdp` with "
        "`fsdp_config={'version': 2}`), DDP (`accelerate launch --multi_gpu`) or one device"
    )
    if distributed_type == DistributedType.DEEPSPEED:
        raise NotImplementedError(
            "hf_triaccel does not support DeepSpeed: ZeRO flattens and partitions the "
            f"parameters, hiding the layer shapes the Fisher factors need; {fsdp2}"
        )
    if distributed_type != DistributedType.FSDP:
        return
    if fsdp_version is None:
        from accelerate.state import AcceleratorState, is_initialized

        plugin = getattr(AcceleratorState(), "fsdp_plugin", None) if is_initialized() else None
        fsdp_version = getattr(plugin, "fsdp_version", None)
    if fsdp_version != 2:
        raise NotImplementedError(
            f"hf_triaccel does not support FSDP version {fsdp_version or 1}: it flattens the "
            f"parameters of many layers into one buffer, hiding the layer shapes the Fisher "
            f"factors need; {fsdp2}"
        )


def check_fsdp_features(precision: bool, lr_steering: bool, prefix: str = "") -> None:
    """Raises when a feature driven by the curvature signals is on under FSDP2: the
    signals read whole parameters and gradients, which FSDP2 shards.

    Example:
        >>> check_fsdp_features(precision=False, lr_steering=True)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        NotImplementedError: lr_steering=True: the curvature signals ... not under FSDP2; ...
    """
    for name, on in (("precision", precision), ("lr_steering", lr_steering)):
        if on:
            raise NotImplementedError(
                f"{prefix}{name}=True: the curvature signals that drive it read whole "
                "parameters and gradients, not under FSDP2; turn it off under FSDP2, or "
                "train with DDP or on one device"
            )


def prepare_triaccel(
    accelerator: Accelerator,
    model: nn.Module,
    plugin: TriAccelPlugin | None = None,
    *others: Any,
    params: Any = None,
) -> TriAccelPrepared:
    """Builds AdaFisher for ``model`` and prepares everything with ``accelerator``.

    A model with 2-D convolutions is put in channels_last (``plugin.channels_last``):
    feed it ``run.batch(batch)``. A compiled model (``torch.compile(model, ...)``) is
    prepared as its eager module (hooks, DDP, autocast) and compiled again with the same
    settings; refresh steps then run the eager module (see
    :func:`~hf_triaccel.integrations.compiled.route_refresh_steps`), as do those of a
    model the ``Accelerator``'s dynamo backend compiles.

    Args:
        accelerator: the run's ``Accelerator`` (single device or DDP).
        model: the model, not yet prepared (or its ``torch.compile`` wrapper).
        plugin: settings (default: ``TriAccelPlugin()``, every field at its default).
        *others: more objects to prepare in the same call (dataloaders, scheduler).
        params: parameters or param groups for the optimizer (default: all trainable).

    Returns:
        :class:`TriAccelPrepared` with the prepared model and optimizer, the collector,
        and the prepared ``others`` in order.

    Example:
        >>> from accelerate import Accelerator
        >>> from torch import nn
        >>> run = prepare_triaccel(Accelerator(cpu=True), nn.Linear(4, 2))
        >>> run.collector.layers.keys()
        dict_keys([''])
    """
    plugin = plugin or TriAccelPlugin()
    check_distributed_support(accelerator.distributed_type)
    if accelerator.distributed_type == DistributedType.FSDP:
        check_fsdp_features(plugin.precision, plugin.lr_steering, "TriAccelPlugin.")
    compiled, eager = model, eager_module(model)
    model = model if eager is None else eager  # hooks and controllers on the eager modules
    channels_last = plugin.channels_last and to_channels_last(model)
    parts = plugin.build(
        model,
        params=params,
        grad_scaler=accelerator.scaler,
        fp16=accelerator.mixed_precision == "fp16",
    )
    optimizer = parts.optimizer
    prepared = list(accelerator.prepare(model, optimizer, *others))
    if eager is not None and eager_module(prepared[0]) is None:
        # the user's compile settings, around the prepared (DDP, autocast) module
        prepared[0] = compiled.dynamo_ctx(prepared[0])
    if eager_module(prepared[0]) is not None:
        route_refresh_steps(prepared[0], optimizer.collector)
    return TriAccelPrepared(
        prepared[0],
        prepared[1],
        optimizer.collector,
        tuple(prepared[2:]),
        parts.signals,
        parts.precision,
        parts.steering,
        channels_last,
    )
