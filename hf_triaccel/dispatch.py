"""The one rule that picks an implementation at call time.

Every operation with several implementations (the optimizer update, the Fisher
statistics) asks :func:`resolve_impl` which one to run. Order of precedence:

1. the ``impl`` argument given by the caller,
2. the ``HF_TRIACCEL_IMPL`` environment variable,
3. automatic: ``"triton"`` for CUDA tensors when Triton imports, else ``"foreach"``.

``"reference"`` is the plain per-tensor loop that every fast path is tested against.
Nothing is swapped at import time.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

IMPLS = ("triton", "foreach", "reference")
ENV_VAR = "HF_TRIACCEL_IMPL"


@functools.cache
def triton_available() -> bool:
    """Whether Triton can be imported (checked once, without importing it)."""
    return importlib.util.find_spec("triton") is not None


def triton_interpreted() -> bool:
    """Whether Triton runs kernels on the CPU (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def validate_impl(impl: str | None) -> str | None:
    """Returns ``impl`` lower-cased, or raises ``ValueError`` naming the valid choices."""
    if impl is None:
        return None
    name = str(impl).lower()
    if name not in IMPLS + ("auto",):
        raise ValueError(f"impl={impl!r} is not one of {IMPLS + ('auto',)}")
    return None if name == "auto" else name


def resolve_impl(impl: str | None, device: torch.device) -> str:
    """Picks the implementation for tensors on ``device``.

    Args:
        impl: ``"triton"``, ``"foreach"``, ``"reference"``, ``"auto"`` or ``None``.
        device: where the tensors live.

    Returns:
        One of :data:`IMPLS`.

    Raises:
        ValueError: unknown name, or ``"triton"`` where it cannot run.

    Example:
        >>> resolve_impl("reference", torch.device("cpu"))
        'reference'
    """
    name = validate_impl(impl) or validate_impl(os.environ.get(ENV_VAR) or None)
    if name is None:
        if device.type == "cuda" and triton_available():
            return "triton"
        return "foreach"
    if name == "triton":
        if not triton_available():
            raise ValueError("impl='triton' needs the `triton` package, which is not installed")
        if device.type != "cuda" and not triton_interpreted():
            raise ValueError(
                f"impl='triton' needs CUDA tensors (got {device.type}); "
                "set TRITON_INTERPRET=1 to run the kernels on the CPU for testing"
            )
    return name
