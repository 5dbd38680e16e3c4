"""What precision a module may compute in: fixed choices, user rules, and the ranking bands.

Precisions, most to least precise: ``"fp32"``, ``"bf16"``, ``"fp16"``. A module's choice
comes from the first of these that applies:

1. normalisation layers (BatchNorm, LayerNorm, GroupNorm, RMSNorm, InstanceNorm, and any
   class whose name contains one of those words, e.g. ``LlamaRMSNorm``) always compute in
   fp32;
2. user rules, in the order given: the first rule whose glob matches the module's name
   (as in ``named_modules()``) or whose class matches the module wins;
3. the automatic choice from the sensitivity ranking (:meth:`PrecisionPolicy.propose`).

A module whose fp16 output overflowed is then kept at bf16 or above, whichever of 2 or 3
chose it (see :class:`~hf_triaccel.precision.controller.PrecisionController`).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from hf_triaccel._types import is_normalisation

PRECISIONS = ("fp32", "bf16", "fp16")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_ALIASES = {
    "float32": "fp32",
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    **{p: p for p in PRECISIONS},
}


def as_precision(value: str | torch.dtype) -> str:
    """The canonical precision name of ``value`` (a name or a torch dtype).

    Example:
        >>> as_precision(torch.bfloat16), as_precision("half")
        ('bf16', 'fp16')
    """
    if isinstance(value, torch.dtype):
        for name, dtype in DTYPES.items():
            if dtype == value:
                return name
        raise ValueError(f"no precision for dtype {value}; choose one of {PRECISIONS}")
    key = str(value).lower()
    if key not in _ALIASES:
        raise ValueError(f"unknown precision {value!r}; choose one of {PRECISIONS}")
    return _ALIASES[key]


@dataclass(frozen=True)
class PrecisionRule:
    """Pins the modules it matches to one precision.

    Args:
        match: a glob on the module's name (``"encoder.layer.*.attention.*"``), a module
            class, or a tuple of classes (matched with ``isinstance``).
        precision: ``"fp32"``, ``"bf16"``, ``"fp16"`` or the torch dtype.

    Example:
        >>> rule = PrecisionRule("lm_head", "fp32")
        >>> rule.matches("lm_head", nn.Linear(2, 2)), rule.matches("head", nn.Linear(2, 2))
        (True, False)
    """

    match: str | type | tuple[type, ...]
    precision: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "precision", as_precision(self.precision))
        classes = self.match if isinstance(self.match, tuple) else (self.match,)
        if not isinstance(self.match, str) and not all(isinstance(c, type) for c in classes):
            raise TypeError(f"a rule matches a name glob or module classes, got {self.match!r}")

    def matches(self, name: str, module: nn.Module) -> bool:
        """Whether the rule applies to the module ``name``."""
        if isinstance(self.match, str):
            return fnmatch.fnmatchcase(name, self.match)
        return isinstance(module, self.match)


@dataclass
class PrecisionPolicy:
    """How the controller chooses each module's compute precision.

    Modules are ranked by sensitivity per unit of cost, most first: a cheap module is
    protected cheaply. A module's cost is the larger of its share of the ranked modules'
    compute (multiply-adds per forward) and of their activations (input and output
    elements per forward), both measured by the controller: computing in fp32 takes
    time in proportion to the first, and memory in proportion to the second (float32
    copies of the input, output and gradients while its forward and backward run). A
    module's place ``q`` is the larger of the two shares that come before its middle (with
    equal costs, ``(rank + 0.5) / n``). Modules with ``q < fp32_fraction`` compute in fp32,
    those with ``q > 1 - fp16_fraction`` in fp16, the rest in bf16.

    Hysteresis, two guards that both must pass before a module changes: its ``q`` must
    cross the boundary of its current band by ``margin`` (a module in bf16 moves to fp32
    only when ``q < fp32_fraction - margin``, back only when ``q > fp32_fraction + margin``),
    and the same change must be proposed at ``patience`` consecutive evaluations. A module
    whose rank alternates around a boundary therefore never moves. A module's first
    automatic choice is taken at once.

    Args:
        rules: :class:`PrecisionRule` objects or ``(match, precision)`` pairs; the first
            matching rule wins over the automatic choice (normalisation layers stay fp32
            whatever the rules say).
        fp32_fraction: share of the compute and of the activations in fp32 (small by
            default, on purpose: a few percent already puts whole convolutions in fp32,
            at a cost in time and peak memory that BENCHMARKS.md records).
        fp16_fraction: share of the compute and of the activations in fp16 (0 disables
            fp16; fp16 regions need a loss scaler, as in any fp16 training).
        margin: hysteresis margin, in the unit of ``q``.
        patience: consecutive evaluations a change must be proposed at before it is made.

    Example:
        >>> policy = PrecisionPolicy(rules=[("lm_head", "fp32")], fp16_fraction=0.0)
        >>> policy.propose(0.9, current=None)
        'bf16'
    """

    rules: Sequence[PrecisionRule | tuple] = field(default_factory=tuple)
    fp32_fraction: float = 0.005
    fp16_fraction: float = 0.25
    margin: float = 0.002
    patience: int = 2

    def __post_init__(self) -> None:
        self.rules = tuple(
            r if isinstance(r, PrecisionRule) else PrecisionRule(*r) for r in self.rules
        )
        for name in ("fp32_fraction", "fp16_fraction"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name}={value}: needs 0 <= {name} <= 1")
        if self.fp32_fraction + self.fp16_fraction > 1.0:
            raise ValueError("fp32_fraction + fp16_fraction must not exceed 1")
        if not 0.0 <= self.margin < 0.5:
            raise ValueError(f"margin={self.margin}: needs 0 <= margin < 0.5")
        if not isinstance(self.patience, int) or self.patience < 1:
            raise ValueError(f"patience={self.patience!r}: needs an int >= 1")

    def fixed(self, name: str, module: nn.Module) -> tuple[str, str] | None:
        """``(precision, reason)`` when the module's precision does not come from the
        ranking (reason ``"norm"`` or ``"rule"``), else ``None``.

        Example:
            >>> PrecisionPolicy(rules=[(nn.Linear, "fp16")]).fixed("0", nn.Linear(2, 2))
            ('fp16', 'rule')
        """
        if is_normalisation(module):
            return "fp32", "norm"
        for rule in self.rules:
            if rule.matches(name, module):
                return rule.precision, "rule"
        return None

    def _band(self, q: float) -> int:
        """Index into :data:`PRECISIONS` of the band containing ``q``."""
        if q < self.fp32_fraction:
            return 0
        return 2 if q > 1.0 - self.fp16_fraction else 1

    def propose(self, q: float, current: str | None) -> str:
        """The precision for a module at place ``q`` now at ``current`` (``None``:
        no automatic choice yet), with the margin applied (not the patience).

        Example:
            >>> policy = PrecisionPolicy(fp32_fraction=0.5, fp16_fraction=0.0, margin=0.1)
            >>> policy.propose(0.55, "fp32"), policy.propose(0.65, "fp32")
            ('fp32', 'bf16')
        """
        band = self._band(q)
        if current is None:
            return PRECISIONS[band]
        level = PRECISIONS.index(current)
        # boundaries between bands: [fp32 | bf16] at fp32_fraction, [bf16 | fp16] above
        upper = (None, self.fp32_fraction, 1.0 - self.fp16_fraction)
        if band < level and q >= upper[level] - self.margin:
            return current
        if band > level and q <= upper[level + 1] + self.margin:
            return current
        return PRECISIONS[band]
