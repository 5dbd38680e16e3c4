"""Accelerate integration: the ``TriAccelPlugin`` and the one call that applies it.

Accelerate has no registry for third-party plugins, so this is a dataclass in the
style of its own plugins (fields with help, environment fallbacks resolved in one
place) plus :func:`prepare_triaccel`, which builds the optimizer and its Fisher
collector and hands everything to ``Accelerator.prepare``. ``TriAccelTrainer`` uses
the same :meth:`TriAccelPlugin.build_optimizer`, so both paths share one
implementation.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from torch import nn

from hf_triaccel._types import EMA_MODES
from hf_triaccel.curvature.collector import FisherCollector
from hf_triaccel.curvature.signals import SignalTracker
from hf_triaccel.dispatch import validate_impl
from hf_triaccel.optim.adafisher import AdaFisher, AdaFisherW
from hf_triaccel.optim.steering import StepSizeSteering
from hf_triaccel.precision import PrecisionController, PrecisionPolicy

OPTIMIZERS = {"adafisher": AdaFisher, "adafisherw": AdaFisherW}
ENV_PREFIX = "HF_TRIACCEL_"


def _env_default(name: str, kind: type) -> Any:
    """Value of ``HF_TRIACCEL_<NAME>`` converted to ``kind``, or ``None``."""
    raw = os.environ.get(ENV_PREFIX + name.upper())
    if raw is None or raw == "":
        return None
    if kind is bool:
        return raw.lower() in ("1", "true", "yes", "on")
    return kind(raw)


@dataclass
class TriAccelPlugin:
    """Settings of hf_triaccel for a hand-written Accelerate loop (and for the Trainer).

    Every field left at ``None`` is read from the environment variable
    ``HF_TRIACCEL_<FIELD>`` (e.g. ``HF_TRIACCEL_OPTIMIZER=adafisher``), else takes its
    documented default.

    Example:
        >>> from accelerate import Accelerator
        >>> from torch import nn
        >>> plugin = TriAccelPlugin(optimizer="adafisherw", lr=1e-3, weight_decay=5e-4)
        >>> prepared = prepare_triaccel(Accelerator(cpu=True), nn.Linear(4, 2), plugin)
        >>> prepared.optimizer.step  # doctest: +ELLIPSIS
        <...>
    """

    optimizer: str | None = field(
        default=None, metadata={"help": "adafisher or adafisherw (default adafisherw)."}
    )
    lr: float | None = field(default=None, metadata={"help": "Learning rate (default 1e-3)."})
    weight_decay: float | None = field(
        default=None,
        metadata={"help": "Weight decay: L2 for adafisher, decoupled for adafisherw (default 0)."},
    )
    beta: float | None = field(default=None, metadata={"help": "Momentum (default 0.9)."})
    damping: float | None = field(
        default=None, metadata={"help": "Lambda added to every Fisher entry (default 1e-3)."}
    )
    gamma: float | None = field(
        default=None, metadata={"help": "EMA coefficient of the Fisher factors (default 0.8)."}
    )
    update_every: int | None = field(
        default=None,
        metadata={"help": "Refresh the Fisher factors every N optimizer steps (default 100)."},
    )
    ema: str | None = field(
        default=None,
        metadata={"help": "Fisher EMA rule: reference (published results) or paper."},
    )
    impl: str | None = field(
        default=None,
        metadata={"help": "Kernels: triton, foreach or reference (default: automatic)."},
    )
    precision: bool | None = field(
        default=None,
        metadata={
            "help": "Per-module adaptive compute precision (fp32 / bf16 / fp16) steered by "
            "the Fisher signals (default off)."
        },
    )
    signals_every: int | None = field(
        default=None,
        metadata={"help": "Re-evaluate signals and precision every N optimizer steps (200)."},
    )
    fp32_fraction: float | None = field(
        default=None,
        metadata={
            "help": "Share of the compute and of the activations kept in fp32, given to the "
            "modules most sensitive per unit of that cost (default 0.005)."
        },
    )
    fp16_fraction: float | None = field(
        default=None,
        metadata={
            "help": "Share of the compute and activations in fp16, least sensitive first (default "
            "0.25 under fp16 mixed precision, where a loss scaler exists, else 0)."
        },
    )
    lr_steering: bool | None = field(
        default=None,
        metadata={
            "help": "Per-module step-size scale from the curvature signal, re-decided every "
            "signals_every steps (experimental, default off)."
        },
    )

    _DEFAULTS = {
        "optimizer": "adafisherw",
        "lr": 1e-3,
        "weight_decay": 0.0,
        "beta": 0.9,
        "damping": 1e-3,
        "gamma": 0.8,
        "update_every": None,
        "ema": "reference",
        "impl": None,
        "precision": False,
        "signals_every": 200,
        "fp32_fraction": PrecisionPolicy.fp32_fraction,
        "fp16_fraction": None,
        "lr_steering": False,
    }

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if getattr(self, f.name) is None:
                kind = {
                    "lr": float,
                    "weight_decay": float,
                    "beta": float,
                    "damping": float,
                    "gamma": float,
                    "update_every": int,
                    "precision": bool,
                    "signals_every": int,
                    "fp32_fraction": float,
                    "fp16_fraction": float,
                    "lr_steering": bool,
                }.get(f.name, str)
                env = _env_default(f.name, kind)
                setattr(self, f.name, env if env is not None else self._DEFAULTS[f.name])
        self.optimizer = str(self.optimizer).lower()
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(
                f"TriAccelPlugin.optimizer={self.optimizer!r} is not one of {sorted(OPTIMIZERS)}"
            )
        if self.ema not in EMA_MODES:
            raise ValueError(f"TriAccelPlugin.ema={self.ema!r} is not one of {EMA_MODES}")
        validate_impl(self.impl)
        for name in ("fp32_fraction", "fp16_fraction"):
            value = getattr(self, name)
            if value is not None and not 0.0 <= value <= 1.0:
                raise ValueError(f"TriAccelPlugin.{name}={value!r} must lie in [0, 1]")
        if self.signals_every < 1:
            raise ValueError(f"TriAccelPlugin.signals_every={self.signals_every!r} must be >= 1")

    def optimizer_kwargs(self) -> dict[str, Any]:
        """Hyperparameters of the optimizer constructor."""
        return dict(
            lr=self.lr,
            beta=self.beta,
            damping=self.damping,
            gamma=self.gamma,
            update_every=self.update_every,
            weight_decay=self.weight_decay,
            ema=self.ema,
            impl=self.impl,
        )

    def build_collector(self, model: nn.Module) -> FisherCollector:
        """The Fisher collector for ``model`` (unwrap DDP/compile wrappers first)."""
        return FisherCollector(model, ema=self.ema, impl=self.impl)

    def build_optimizer(
        self, model: nn.Module, params: Any = None, grad_scaler: torch.amp.GradScaler | None = None
    ) -> AdaFisher:
        """Builds the collector for ``model`` and the optimizer over ``params``.

        Args:
            model: the unwrapped model whose modules carry the Fisher factors.
            params: parameters or param groups (default: every trainable parameter).
            grad_scaler: the loss scaler of fp16 training, so that statistics are unscaled.
        """
        collector = self.build_collector(model)
        collector.grad_scaler = grad_scaler
        if params is None:
            params = [p for p in model.parameters() if p.requires_grad]
        return OPTIMIZERS[self.optimizer](params, collector, **self.optimizer_kwargs())

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
        _checkpoint_with(optimizer, "triaccel_precision", signals=signals, precision=controller)
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
        _checkpoint_with(optimizer, "triaccel_steering", **parts, steering=steering)
        return steering


def _checkpoint_with(optimizer: torch.optim.Optimizer, key: str, **parts: Any) -> None:
    """Adds the state of ``parts`` (objects with ``state_dict`` / ``load_state_dict``) to
    ``optimizer.state_dict()`` under ``key`` and restores it from
    ``optimizer.load_state_dict()`` (torch's public optimizer hooks)."""

    def save(opt, state_dict):
        state_dict[key] = {name: part.state_dict() for name, part in parts.items()}
        return state_dict

    def load(opt, state_dict):
        state_dict = dict(state_dict)
        saved = state_dict.pop(key, None)
        if saved is not None:
            for name, part in parts.items():
                part.load_state_dict(saved[name])
        return state_dict

    optimizer.register_state_dict_post_hook(save)
    optimizer.register_load_state_dict_pre_hook(load)


@dataclass
class TriAccelPrepared:
    """What :func:`prepare_triaccel` returns: the prepared objects and the controllers."""

    model: nn.Module
    optimizer: Any
    collector: FisherCollector
    others: tuple = ()
    signals: SignalTracker | None = None
    precision: PrecisionController | None = None
    steering: StepSizeSteering | None = None


def check_distributed_support(distributed_type: DistributedType) -> None:
    """Raises for parallelism modes the Fisher hooks do not support yet."""
    unsupported = {DistributedType.FSDP: "FSDP", DistributedType.DEEPSPEED: "DeepSpeed"}
    if distributed_type in unsupported:
        raise NotImplementedError(
            f"hf_triaccel does not support {unsupported[distributed_type]} yet: its sharded "
            "parameters hide the layer shapes the Fisher factors need. Use DDP "
            "(`accelerate launch --multi_gpu`) or a single device."
        )


def prepare_triaccel(
    accelerator: Accelerator,
    model: nn.Module,
    plugin: TriAccelPlugin | None = None,
    *others: Any,
    params: Any = None,
) -> TriAccelPrepared:
    """Builds AdaFisher for ``model`` and prepares everything with ``accelerator``.

    Args:
        accelerator: the run's ``Accelerator`` (single device or DDP).
        model: the model, not yet prepared.
        plugin: settings (default: ``TriAccelPlugin()``, i.e. environment or defaults).
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
    optimizer = plugin.build_optimizer(model, params, grad_scaler=accelerator.scaler)
    signals, precision = plugin.build_precision(
        model, optimizer, fp16=accelerator.mixed_precision == "fp16"
    ) or (None, None)
    steering = plugin.build_steering(optimizer, signals)
    if steering is not None:
        signals = steering.tracker
    prepared = accelerator.prepare(model, optimizer, *others)
    return TriAccelPrepared(
        prepared[0],
        prepared[1],
        optimizer.collector,
        tuple(prepared[2:]),
        signals,
        precision,
        steering,
    )
