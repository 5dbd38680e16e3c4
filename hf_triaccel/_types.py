"""The types and constants that the kernels and the Python side share.

This module is the leaf of the package: it imports only torch, so that
``hf_triaccel.kernels`` can take tensors described here without importing the layers
above it (see docs/design.md, "Layout").
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

EMA_MODES = ("reference", "paper")
"""The Fisher-factor EMA rules: ``"reference"`` (the published fold rule) and ``"paper"``."""

NORMALISE_MODES = ("absolute", "relative")
"""The min-max normalisations of a Fisher statistic: ``"absolute"`` (the published one,
``NORMALISE_EPS`` added to the range) and ``"relative"`` (this project's scale-free
variant, the range scaled by ``1 + NORMALISE_EPS``); see docs/design.md, "AdaFisher"."""

FACTOR_INITS = ("zeros", "ones")
"""What the Fisher factors start at: ``"zeros"`` (the default, this project's variant: under
``ema="reference"`` the first refresh puts each factor near its settled scale, so the step
does not grow at the second refresh) or ``"ones"`` (the published seed); see
docs/design.md, "AdaFisher"."""

DEFAULT_FACTOR_INIT = "zeros"
"""The factors' seed of the optimizer and of a collector built alone, which must agree."""

NORMALISE_EPS = 1e-6
"""The epsilon of the min-max normalisation of a new Fisher statistic: added to the range
(``"absolute"``) or its relative margin (``"relative"``)."""

NORMALISE_TINY = torch.finfo(torch.float32).tiny
"""The smallest normal float32, added to the relative normalisation's denominator so that
a constant statistic (range 0) normalises to zeros and not to NaN."""


@dataclass(frozen=True)
class FactorLayout:
    """How the flat elements of one parameter index the ``g`` and ``a`` factor vectors.

    Element ``k`` of the flattened parameter uses ``g[(k // g_div) % g_mod]`` and
    ``a[(k // a_div) % a_mod + a_off]``.

    Example:
        >>> layout = FactorLayout(g_div=3, g_mod=2, a_div=1, a_mod=3)  # a (2, 3) weight
        >>> [t.tolist() for t in layout.indices(6, torch.device("cpu"))]
        [[0, 0, 0, 1, 1, 1], [0, 1, 2, 0, 1, 2]]
    """

    g_div: int
    g_mod: int
    a_div: int
    a_mod: int
    a_off: int = 0

    def indices(self, numel: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns the (g index, a index) of every flat element (reference path)."""
        k = torch.arange(numel, device=device)
        return (k // self.g_div) % self.g_mod, (k // self.a_div) % self.a_mod + self.a_off


def check_statistic_out(out: torch.Tensor, n: int, device: torch.device) -> None:
    """Raises ``ValueError`` unless ``out`` can receive a statistic of length ``n`` computed
    on ``device``: the destination contract of every Fisher reduction, reference or kernel
    (a contiguous float32 vector, written in place).

    Example:
        >>> check_statistic_out(torch.zeros(3), 3, torch.device("cpu"))
        >>> check_statistic_out(torch.zeros(2), 3, torch.device("cpu"))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: out must be a contiguous float32 tensor of shape (3,), got ...
    """
    if out.dtype != torch.float32 or out.shape != (n,) or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous float32 tensor of shape ({n},), got {out.dtype} of "
            f"shape {tuple(out.shape)}"
        )
    if out.device != device:
        raise ValueError(f"out is on {out.device}, the input on {device}")


@dataclass(frozen=True)
class ParamFactors:
    """What the update needs for one parameter: its two factor vectors and layout."""

    g: torch.Tensor
    a: torch.Tensor
    layout: FactorLayout


_NORM_TYPES = (
    nn.modules.batchnorm._NormBase,  # BatchNorm*, InstanceNorm*, SyncBatchNorm
    nn.LayerNorm,
    nn.GroupNorm,
    nn.RMSNorm,
    nn.LocalResponseNorm,
)
# normalisation layers of other libraries that do not subclass torch's (LlamaRMSNorm,
# T5LayerNorm, timm's LayerNorm2d and BatchNormAct2d are all covered by the name)
_NORM_NAME = re.compile(r"(Layer|Batch|Group|RMS|Instance)Norm")


def is_normalisation(module: nn.Module) -> bool:
    """Whether ``module`` is a normalisation layer: the one definition the package uses
    (kept in fp32 by the precision policy, never weight-decayed).

    Example:
        >>> is_normalisation(nn.LayerNorm(4)), is_normalisation(nn.Linear(4, 4))
        (True, False)
    """
    return isinstance(module, _NORM_TYPES) or bool(_NORM_NAME.search(type(module).__name__))
