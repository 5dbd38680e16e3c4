"""Other libraries' module classes that the rules must tell apart, recognised in one place.

None of these libraries is imported: their classes are recognised by name and by the
attributes they carry, so that the rules work whether or not transformers or timm is
installed. (Their normalisation layers are covered by
:func:`hf_triaccel._types.is_normalisation` and, for the statistics, by subclassing
torch's.)
"""

from __future__ import annotations

from torch import nn

# timm's LayerNorm subclasses that normalise dim 1 of (B, C, H, W) inputs
_CHANNELS_FIRST_LAYER_NORMS = frozenset(
    {"LayerNorm2d", "LayerNormAct2d", "LayerNorm2dFp32", "LayerNormAct2dFp32", "LayerNorm3d"}
)


def is_transformers_conv1d(module: nn.Module) -> bool:
    """transformers' ``Conv1D`` (GPT-2's projections): a Linear stored (d_in, d_out).

    Example:
        >>> is_transformers_conv1d(nn.Conv1d(2, 2, 1))
        False
    """
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def pads_same_dynamically(module: nn.Module) -> bool:
    """timm's ``Conv2dSame`` (always) and ``StdConv2dSame`` / ``ScaledStdConv2dSame`` (when
    ``same_pad``), which zero-pad their input TensorFlow-style inside ``forward``.

    Example:
        >>> pads_same_dynamically(nn.Conv2d(2, 2, 3))
        False
    """
    if type(module).__name__ == "Conv2dSame":
        return True
    return getattr(module, "same_pad", False) is True


def declared_channels_first(module: nn.Module) -> bool | None:
    """Whether a LayerNorm-like module says it normalises dim 1 of (B, C, ...) inputs:
    transformers' ``data_format`` attribute, timm's ``LayerNorm2d`` family. ``None`` when
    it says nothing.

    Example:
        >>> declared_channels_first(nn.LayerNorm(4)) is None
        True
    """
    fmt = getattr(module, "data_format", None)
    if fmt in ("channels_first", "channels_last"):
        return fmt == "channels_first"
    if type(module).__name__ in _CHANNELS_FIRST_LAYER_NORMS:
        return True
    return None


def norm_output_module(module: nn.Module) -> nn.Module:
    """Where a normalisation layer's output gradient is taken. timm's norm-act layers
    (``BatchNormAct2d``, ``GroupNormAct``...) run norm -> ``drop`` -> ``act`` in one forward:
    the norm's output gradient is the gradient of ``drop``'s output, not of the module's.

    Example:
        >>> norm = nn.BatchNorm2d(3)
        >>> norm_output_module(norm) is norm
        True
    """
    act, drop = getattr(module, "act", None), getattr(module, "drop", None)
    if (
        isinstance(act, nn.Module)
        and not isinstance(act, nn.Identity)
        and isinstance(drop, nn.Module)
    ):
        return drop
    return module
