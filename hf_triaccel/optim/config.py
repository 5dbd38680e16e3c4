"""The one configuration object of AdaFisher: hyperparameters, defaults, validation.

Every entry point derives from :class:`AdaFisherConfig`: the optimizer constructor and
:func:`~hf_triaccel.optim.adafisher.build_adafisher` (the one builder of an optimizer
with its collector) validate through it; ``TriAccelArguments``, ``TriAccelPlugin``, the
Trainer callback and factories and timm's registry build one with
:meth:`AdaFisherConfig.from_values`, whose errors name the entry point's own field. A
field has one default, one help text and one check, here: a new hyperparameter is a new
field (and, where the Trainer's namespace needs it, one field of ``TriAccelArguments``).

The same module holds the two checks that run outside a config:
:func:`check_step_hyperparameters` (the values a param group may override, checked
again by the optimizer and the functional update) and :func:`impl_from_torch_flags`
(torch.optim's ``foreach`` / ``fused`` / ``capturable`` / ``differentiable``, which
wrappers such as timm pass to every optimizer).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from hf_triaccel._types import DEFAULT_FACTOR_INIT, EMA_MODES, FACTOR_INITS, NORMALISE_MODES
from hf_triaccel.dispatch import validate_impl

STATE_DTYPES = (None, "float32", "bfloat16", "float16")
"""The momentum storage dtypes :class:`AdaFisherConfig` accepts (``None``: the arithmetic's)."""

ROUNDINGS = ("nearest", "kahan", "stochastic")
"""How a weight stores its update (:mod:`hf_triaccel.optim.functional` describes each)."""

DEFAULT_LR = 1.2e-2
"""AdaFisher's default learning rate, in every entry point: the best of the learning-rate
grid of a CIFAR ResNet-18 at batch 512 under the published fold rule with the factors
seeded with zeros, the defaults (``benchmarks/results/chosen.json``). Under that rule the
step is close to momentum SGD's at ``lr / damping`` from the first step on; a model unlike
the one measured may need its own."""


STEP_FIELDS = ("lr", "beta", "damping", "weight_decay")
"""The fields the update reads at every step: a param group may override each of them."""


def check_step_hyperparameters(
    lr: float | torch.Tensor,
    beta: float,
    weight_decay: float,
    damping: float,
    *,
    owner: str = "AdaFisherConfig",
) -> None:
    """Checks the hyperparameters the update reads at every step (a param group may
    override each of them); errors name ``owner.<field>``.

    A tensor learning rate is checked for its size only: reading its value would
    synchronise with the device at every step.

    Raises:
        ValueError: a value out of its range.

    Example:
        >>> check_step_hyperparameters(1e-3, beta=0.9, weight_decay=0.0, damping=0.0)
        Traceback (most recent call last):
        ...
        ValueError: AdaFisherConfig.damping=0.0: needs > 0
    """
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1:
            raise ValueError(f"{owner}.lr: a tensor learning rate must have one element")
    elif not lr >= 0.0:
        raise ValueError(f"{owner}.lr={lr!r}: needs >= 0")
    if not 0.0 <= beta < 1.0:
        raise ValueError(f"{owner}.beta={beta!r}: needs 0 <= beta < 1")
    if not damping > 0.0:
        raise ValueError(f"{owner}.damping={damping!r}: needs > 0")
    if not weight_decay >= 0.0:
        raise ValueError(f"{owner}.weight_decay={weight_decay!r}: needs >= 0")


def impl_from_torch_flags(
    impl: str | None,
    *,
    foreach: bool | None = None,
    fused: bool | None = None,
    capturable: bool = False,
    differentiable: bool = False,
    owner: str = "AdaFisher",
) -> str | None:
    """The implementation asked for by ``impl`` together with torch.optim's flags.

    ``foreach=True`` asks for ``"foreach"`` and ``foreach=False`` for the per-tensor
    loop (``"reference"``), as in torch's optimizers; ``fused=True`` asks for the fused
    kernel (``"triton"``) and ``fused=False`` for anything else (``"foreach"``, or
    ``"reference"`` with ``foreach=False``). ``None`` leaves the choice to ``impl``.

    Raises:
        ValueError: flags that ask for different implementations, or
            ``capturable=True`` / ``differentiable=True`` (not supported).

    Example:
        >>> impl_from_torch_flags(None, foreach=True)
        'foreach'
        >>> impl_from_torch_flags("triton", foreach=True)
        Traceback (most recent call last):
        ...
        ValueError: AdaFisher: impl='triton' and foreach=True choose different implementations
    """
    if differentiable:
        raise ValueError(
            f"{owner}: differentiable=True is not supported (the update runs under "
            "torch.no_grad); leave differentiable=False"
        )
    if capturable:
        raise ValueError(
            f"{owner}: capturable=True is not supported; leave capturable=False (the "
            "fused implementation, impl='triton', can be captured in a CUDA graph after "
            "one uncaptured step)"
        )
    given = []  # (the argument as written, the implementation it asks for; None: any)
    if impl is not None:
        given.append((f"impl={impl!r}", validate_impl(impl)))
    if foreach is not None:
        given.append((f"foreach={foreach}", "foreach" if foreach else "reference"))
    if fused is not None:
        given.append((f"fused={fused}", "triton" if fused else None))
    wanted = {name for _, name in given if name is not None}
    if len(wanted) > 1 or (fused is False and wanted == {"triton"}):
        arguments = " and ".join(text for text, _ in given)
        raise ValueError(f"{owner}: {arguments} choose different implementations")
    if wanted:
        return wanted.pop()
    return "foreach" if fused is False else None


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
        ema: ``"reference"`` (the published fold rule) or ``"paper"``.
        normalise: min-max normalisation of each new Fisher statistic: ``"absolute"``
            (the published one, (X - min) / (max - min + 1e-6)) or ``"relative"``, this
            project's scale-free variant, not the published algorithm: (X - min) /
            ((max - min) * (1 + 1e-6) + tiny), which spans [0, 1) however small the
            statistic's range (the absolute one leaves a range far below 1e-6 near 0).
        factor_init: what the factors start at: ``"zeros"`` (the default, this project's
            variant, not the published algorithm) or ``"ones"`` (the published seed). Under
            ``ema="reference"`` a factor from ones is about ten times its settled scale after
            the first refresh and settles at the second, so the step grows about
            ``1 + 0.0064 / damping`` times at the second refresh (at step ``update_every``),
            wherever the schedule is then; from zeros the first refresh already puts it at
            0.92 of its settled scale and the step keeps its size. No effect under
            ``ema="paper"``, whose normalisation removes any constant seed.
        impl: ``"triton"``, ``"foreach"``, ``"reference"``, ``"auto"`` or ``None``
            (automatic; the ``HF_TRIACCEL_IMPL`` environment variable overrides automatic).
        state_dtype: the momentum's storage, one of :data:`STATE_DTYPES` (``None``: the
            update's arithmetic dtype). The arithmetic stays float32 (float64 for float64
            parameters); the momentum is rounded to nearest when stored.
        weight_rounding: how a weight narrower than the arithmetic stores its update:
            ``"nearest"``, ``"kahan"`` (a compensation buffer of the weight's dtype per
            parameter, 2 bytes per bfloat16 parameter) or ``"stochastic"`` (bfloat16
            weights only). See :mod:`hf_triaccel.optim.functional`.
        release_grads: gradient release (:mod:`hf_triaccel.optim.release`): on steps
            that do not refresh the Fisher factors, each parameter is stepped from a
            hook as soon as its gradient is complete, and the gradient freed; needs one
            backward pass per optimizer step and unclipped, unscaled gradients.

    Raises:
        ValueError: a field out of its range, naming the field and what it needs.

    Example:
        >>> AdaFisherConfig(lr=3e-3).resolved_update_every
        100
        >>> AdaFisherConfig(beta=1.5)
        Traceback (most recent call last):
        ...
        ValueError: AdaFisherConfig.beta=1.5: needs 0 <= beta < 1
        >>> AdaFisherConfig(normalise="scaled")
        Traceback (most recent call last):
        ...
        ValueError: AdaFisherConfig.normalise='scaled': must be one of ('absolute', 'relative')
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
        metadata={"help": "Fisher EMA rule: reference (the published fold rule) or paper."},
    )
    normalise: str = field(
        default="absolute",
        metadata={
            "help": "Min-max normalisation of each Fisher statistic: absolute (published, "
            "(X - min) / (max - min + 1e-6)) or relative (this project's scale-free variant, "
            "not the published algorithm: the statistic spans [0, 1) whatever its scale)."
        },
    )
    factor_init: str = field(
        default=DEFAULT_FACTOR_INIT,
        metadata={
            "help": "What the Fisher factors start at: zeros (this project's variant, not the "
            "published algorithm: no jump in the step size at the second refresh under "
            "ema=reference) or ones (published)."
        },
    )
    impl: str | None = field(
        default=None,
        metadata={"help": "Kernels: triton, foreach or reference (default: automatic)."},
    )
    state_dtype: str | None = field(
        default=None,
        metadata={
            "help": "The momentum's storage: float32, bfloat16 or float16 (default: the "
            "update's arithmetic dtype, float32, or float64 for float64 parameters)."
        },
    )
    weight_rounding: str = field(
        default="nearest",
        metadata={
            "help": "How a bfloat16/float16 weight stores its update: nearest, kahan "
            "(a compensation buffer of the weight's dtype carries what rounding drops) or "
            "stochastic (bfloat16 weights)."
        },
    )
    release_grads: bool = field(
        default=False,
        metadata={
            "help": "Step each parameter during the backward pass as soon as its gradient "
            "is complete, and free the gradient, on steps that do not refresh the factors."
        },
    )

    def __post_init__(self) -> None:
        self.validate()

    def validate(self, owner: str = "AdaFisherConfig") -> None:
        """Checks every field; errors name ``owner.<field>``.

        Args:
            owner: the name errors give the object (an entry point passes its own).
        """
        check_step_hyperparameters(self.lr, self.beta, self.weight_decay, self.damping, owner=owner)
        checks = (
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
            ("ema", self.ema in EMA_MODES, f"must be one of {EMA_MODES}"),
            ("normalise", self.normalise in NORMALISE_MODES, f"must be one of {NORMALISE_MODES}"),
            ("factor_init", self.factor_init in FACTOR_INITS, f"must be one of {FACTOR_INITS}"),
            ("state_dtype", self.state_dtype in STATE_DTYPES, f"must be one of {STATE_DTYPES}"),
            (
                "weight_rounding",
                self.weight_rounding in ROUNDINGS,
                f"must be one of {ROUNDINGS}",
            ),
            ("release_grads", isinstance(self.release_grads, bool), "must be True or False"),
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

    @property
    def resolved_state_dtype(self) -> torch.dtype | None:
        """``state_dtype`` as a torch dtype (``None``: the arithmetic's)."""
        return None if self.state_dtype is None else getattr(torch, self.state_dtype)

    @classmethod
    def from_values(
        cls,
        values: Mapping[str, Any],
        *,
        owner: str | None = None,
        names: Mapping[str, str] | None = None,
    ) -> AdaFisherConfig:
        """A configuration from ``values`` (field -> value), with errors that name the
        entry point's own fields: ``owner.<name>``, where ``names`` maps a field to the
        entry point's name for it (default: the field's own).

        Raises:
            TypeError: a name that is not a field, listing the fields.
            ValueError: a value out of range, as ``owner.<name>=value: what it needs``.

        Example:
            >>> AdaFisherConfig.from_values({"lr": 2e-3}).lr
            0.002
            >>> AdaFisherConfig.from_values(
            ...     {"beta": 2.0}, owner="TriAccelArguments", names={"beta": "adafisher_beta"}
            ... )
            Traceback (most recent call last):
            ...
            ValueError: TriAccelArguments.adafisher_beta=2.0: needs 0 <= beta < 1
            >>> AdaFisherConfig.from_values({"momentum": 0.9}, owner="AdaFisherW")
            ... # doctest: +ELLIPSIS
            Traceback (most recent call last):
            ...
            TypeError: AdaFisherW: unknown hyperparameter ['momentum']; the fields are ...
        """
        owner = owner or cls.__name__
        fields = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(values) - set(fields))
        if unknown:
            raise TypeError(
                f"{owner}: unknown hyperparameter {unknown}; the fields are {', '.join(fields)}"
            )
        try:
            return cls(**values)
        except ValueError as err:
            found = re.match(rf"^{cls.__name__}\.(\w+)", str(err))
            if found is None:
                raise
            name = (names or {}).get(found.group(1), found.group(1))
            raise ValueError(f"{owner}.{name}{str(err)[found.end() :]}") from None

    def optimizer_kwargs(self) -> dict[str, Any]:
        """The hyperparameters as keyword arguments of the AdaFisher / AdaFisherW
        constructor (the fields of :class:`AdaFisherConfig` only, for a subclass too).

        Example:
            >>> sorted(AdaFisherConfig().optimizer_kwargs())[:3]
            ['beta', 'damping', 'ema']
        """
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(AdaFisherConfig)}

    def step_defaults(self) -> dict[str, Any]:
        """The per-group defaults of the optimizer (:data:`STEP_FIELDS`)."""
        return {name: getattr(self, name) for name in STEP_FIELDS}
