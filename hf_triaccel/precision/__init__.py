"""Per-module compute precision (fp32 / bf16 / fp16) chosen from second-order signals.

Example:
    >>> from torch import nn
    >>> from hf_triaccel.precision import PrecisionController, PrecisionPolicy
    >>> model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    >>> controller = PrecisionController(model, PrecisionPolicy(rules=[("2", "fp32")]))
    >>> controller.decisions
    {'1': 'fp32', '2': 'fp32'}
"""

from hf_triaccel.precision.controller import PrecisionController, PrecisionEvent
from hf_triaccel.precision.hooks import PrecisionHook
from hf_triaccel.precision.plot import plot_precision_map
from hf_triaccel.precision.policy import (
    PRECISIONS,
    PrecisionPolicy,
    PrecisionRule,
    as_precision,
    is_normalisation,
)

__all__ = [
    "PRECISIONS",
    "PrecisionController",
    "PrecisionEvent",
    "PrecisionHook",
    "PrecisionPolicy",
    "PrecisionRule",
    "as_precision",
    "is_normalisation",
    "plot_precision_map",
]
