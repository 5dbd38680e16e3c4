"""Reductions that Fisher statistics are built from, with their dispatch.

Each function takes activations or output gradients in any float dtype and returns
float32 sums. The reference versions here are plain PyTorch; the Triton versions
(``hf_triaccel.kernels.stats``) read the native dtype once and accumulate in float32.
Both are selected through :func:`hf_triaccel.dispatch.resolve_impl`.
"""

from __future__ import annotations

import torch

from hf_triaccel.dispatch import resolve_impl


def sum_rows_reference(x: torch.Tensor, square: bool) -> torch.Tensor:
    """Sum over rows of a 2-D tensor (x^2 if ``square``): (N, D) -> (D,) float32."""
    x = x.float()
    return (x * x).sum(0) if square else x.sum(0)


def channel_sum_reference(x: torch.Tensor, square: bool) -> torch.Tensor:
    """Sum over dims 0 and 2 of a 3-D tensor (x^2 if ``square``): (B, C, L) -> (C,) float32."""
    x = x.float()
    return (x * x).sum((0, 2)) if square else x.sum((0, 2))


def sum_rows(x: torch.Tensor, square: bool, impl: str | None = None) -> torch.Tensor:
    """Column sums of ``x`` (N, D), of its squares when ``square``, in float32.

    Example:
        >>> sum_rows(torch.ones(4, 3), square=True, impl="reference")
        tensor([4., 4., 4.])
    """
    if x.dim() != 2:
        raise ValueError(f"sum_rows expects a 2-D tensor, got shape {tuple(x.shape)}")
    if resolve_impl(impl, x.device) == "triton":
        from hf_triaccel.kernels.stats import sum_rows_triton

        return sum_rows_triton(x, square)
    return sum_rows_reference(x, square)


def channel_sum(x: torch.Tensor, square: bool, impl: str | None = None) -> torch.Tensor:
    """Per-channel sums of ``x`` (B, C, L) over batch and positions, in float32.

    Example:
        >>> channel_sum(torch.ones(2, 3, 5), square=False, impl="reference")
        tensor([10., 10., 10.])
    """
    if x.dim() != 3:
        raise ValueError(f"channel_sum expects a 3-D tensor, got shape {tuple(x.shape)}")
    if resolve_impl(impl, x.device) == "triton":
        from hf_triaccel.kernels.stats import channel_sum_triton

        return channel_sum_triton(x, square)
    return channel_sum_reference(x, square)
