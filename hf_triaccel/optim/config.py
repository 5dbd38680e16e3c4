"""The one configuration object of AdaFisher: hyperparameters, defaults, validation.

Every entry point derives from :class:`AdaFisherConfig`: the optimizer constructor
validates through it, ``TriAccelArguments`` and ``TriAccelPlugin`` build one, and the
recipes take its defaults. A field has one default everywhere.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from hf_triaccel._types import EMA_MODES
from hf_triaccel.dispatch import validate_impl

DEFAULT_LR = 1e-3
"""AdaFisher's default learning rate, in every entry point."""


@dataclass
class AdaFisherConfig:
    """AdaFisher / AdaFisherW hyperparameters (docs/design.md, "AdaFisher").

    Args:
        lr: learning rate (a float or a one-element tensor).
        beta: momentum coefficient, in [0, 1).
        damping: lambda added to every preconditioner entry, > 0.
        gamma: EMA coefficient of the Fisher factors, in (0, 1).
        update_every: refresh the factors every this many optimizer steps; ``None``
            means 100 for ``ema="reference"`` and 1 for ``ema="paper"``.
        weight_decay: L2 penalty (AdaFisher) or decoupled decay (AdaFisherW), >= 0.
        ema: ``"reference"`` (published results) or ``"paper"``.
        impl: ``"triton"``, ``"foreach"``, ``"reference"``, ``"auto"`` or ``None``
            (automatic; the ``HF_TRIACCEL_IMPL`` environment variable overrides automatic).

    Raises:
        ValueError: a field out of its range, naming the field and what it needs.

    Example:
        >>> AdaFisherConfig(lr=3e-3).resolved_update_every
        100
        >>> AdaFisherConfig(beta=1.5)
        Traceback (most recent call last):
        ...
        ValueError: AdaFisherConfig.beta=1.5: needs 0 <= beta < 1
    """

    lr: float | torch.Tensor = field(default=DEFAULT_LR, metadata={"help": "Learning rate."})
    beta: float = field(default=0.9, metadata={"help": "Momentum coefficient."})
    damping: float = field(default=1e-3, metadata={"help": "Lambda added to every Fisher entry."})
    gamma: float = field(default=0.8, metadata={"help": "EMA coefficient of the Fisher factors."})
    update_every: int | None = field(
        default=None,
        metadata={
            "help": "Refresh the Fisher factors every N optimizer steps "
            "(default 100 for ema=reference, 1 for ema=paper)."
        },
    )
    weight_decay: float = field(
        default=0.0,
        metadata={"help": "Weight decay: L2 for adafisher, decoupled for adafisherw."},
    )
    ema: str = field(
        default="reference",
        metadata={"help": "Fisher EMA rule: reference (published results) or paper."},
    )
    impl: str | None = field(
        default=None,
        metadata={"help": "Kernels: triton, foreach or reference (default: automatic)."},
    )

    def __post_init__(self) -> None:
        self.validate()

    def validate(self, owner: str = "AdaFisherConfig") -> None:
        """Checks every field; errors name ``owner.<field>``.

        Args:
            owner: the name errors give the object (an entry point passes its own).
        """
        lr = self.lr
        if isinstance(lr, torch.Tensor):
            if lr.numel() != 1:
                raise ValueError(f"{owner}.lr: a tensor learning rate must have one element")
        elif not lr >= 0.0:
            raise ValueError(f"{owner}.lr={lr!r}: needs >= 0")
        checks = (
            ("beta", 0.0 <= self.beta < 1.0, "needs 0 <= beta < 1"),
            ("damping", self.damping > 0.0, "needs > 0"),
            ("gamma", 0.0 < self.gamma < 1.0, "needs 0 < gamma < 1"),
            (
                "update_every",
                self.update_every is None
                or (
                    isinstance(self.update_every, int)
                    and not isinstance(self.update_every, bool)
                    and self.update_every >= 1
                ),
                "needs an integer >= 1 (or None for the EMA rule's default)",
            ),
            ("weight_decay", self.weight_decay >= 0.0, "needs >= 0"),
            ("ema", self.ema in EMA_MODES, f"must be one of {EMA_MODES}"),
        )
        for name, ok, why in checks:
            if not ok:
                raise ValueError(f"{owner}.{name}={getattr(self, name)!r}: {why}")
        try:
            validate_impl(self.impl)
        except ValueError as err:
            raise ValueError(f"{owner}.impl: {err}") from None

    @property
    def resolved_update_every(self) -> int:
        """``update_every``, with ``None`` resolved from the EMA rule."""
        if self.update_every is not None:
            return self.update_every
        return 100 if self.ema == "reference" else 1

    def optimizer_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of the AdaFisher / AdaFisherW constructor."""
        return dataclasses.asdict(self)
