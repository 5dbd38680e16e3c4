"""The AdaFisher update, as one functional with three implementations.

For parameter ``theta`` with gradient ``grad``, momentum ``m``, step ``t`` (already
incremented) and preconditioner ``F`` (see :mod:`hf_triaccel.curvature.rules`;
``F = 1`` for parameters without factors)::

    AdaFisher  (L2):        g = grad + wd * theta;  m = beta * m + (1 - beta) * g
                            theta = theta - lr / (1 - beta^t) * m / F
    AdaFisherW (decoupled): m = beta * m + (1 - beta) * grad
                            theta = theta - lr * (m / ((1 - beta^t) * F) + wd * theta)

Arithmetic is float32 whatever the parameter dtype; ``m`` is float32.

- ``reference``: one tensor at a time, F materialised from index arithmetic.
- ``foreach``: torch ``_foreach`` ops over all tensors, F materialised per tensor.
- ``triton``: one fused multi-tensor kernel per (dtype, group) that builds F per tile
  from the two factor vectors (``hf_triaccel.kernels.update``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hf_triaccel._types import ParamFactors
from hf_triaccel.dispatch import resolve_impl


def preconditioner(param: torch.Tensor, factors: ParamFactors | None, damping: float):
    """F for every element of ``param`` (float32, same shape), or ``None`` for F = 1."""
    if factors is None:
        return None
    gi, ai = factors.layout.indices(param.numel(), factors.g.device)
    return (factors.g[gi] * factors.a[ai] + damping).view(param.shape)


def _check_args(lr, beta: float, weight_decay: float, damping: float) -> None:
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1:
            raise ValueError("a tensor lr must have one element")
    elif lr < 0.0:
        raise ValueError(f"invalid learning rate: {lr}")
    if not 0.0 <= beta < 1.0:
        raise ValueError(f"invalid beta: {beta} (needs 0 <= beta < 1)")
    if weight_decay < 0.0:
        raise ValueError(f"invalid weight_decay: {weight_decay}")
    if damping <= 0.0:
        raise ValueError(f"invalid damping: {damping} (needs > 0)")


def _reference_adafisher(
    params, grads, moms, factors, steps, *, lr, beta, weight_decay, damping, decoupled
) -> None:
    for p, grad, m, fac, step in zip(params, grads, moms, factors, steps, strict=True):
        theta = p.float()
        g = grad.float()
        bias_correction = 1.0 - beta**step
        if not decoupled and weight_decay:
            g = g + weight_decay * theta
        m.mul_(beta).add_(g, alpha=1.0 - beta)
        fisher = preconditioner(p, fac, damping)
        direction = m / bias_correction if fisher is None else m / (bias_correction * fisher)
        if decoupled and weight_decay:
            direction = direction + weight_decay * theta
        p.copy_(theta - lr * direction)


def _foreach_adafisher(
    params, grads, moms, factors, steps, *, lr, beta, weight_decay, damping, decoupled
) -> None:
    thetas = [p.float() for p in params]
    gs = [g.float() for g in grads]
    if not decoupled and weight_decay:
        gs = torch._foreach_add(gs, thetas, alpha=weight_decay)
    torch._foreach_mul_(moms, beta)
    torch._foreach_add_(moms, gs, alpha=1.0 - beta)
    # bias_correction * F, one tensor per parameter (F = 1 where a parameter has no factors)
    bias_corrections = torch._foreach_neg(torch._foreach_pow(beta, steps))
    torch._foreach_add_(bias_corrections, 1.0)
    denoms = [
        bc if f is None else f * bc
        for bc, f in zip(
            bias_corrections,
            (preconditioner(p, fac, damping) for p, fac in zip(params, factors, strict=True)),
            strict=True,
        )
    ]
    directions = torch._foreach_div(moms, denoms)
    if decoupled and weight_decay:
        torch._foreach_add_(directions, thetas, alpha=weight_decay)
    if isinstance(lr, torch.Tensor):
        torch._foreach_mul_(directions, lr)
        torch._foreach_sub_(thetas, directions)
    else:
        torch._foreach_add_(thetas, directions, alpha=-lr)
    torch._foreach_copy_(params, thetas)


def adafisher(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    moms: list[torch.Tensor],
    factors: list[ParamFactors | None],
    steps: list[torch.Tensor],
    *,
    lr: float | torch.Tensor,
    beta: float,
    weight_decay: float,
    damping: float,
    decoupled: bool,
    impl: str | None = None,
) -> None:
    """Applies one AdaFisher step to ``params`` in place (see the module docstring).

    Args:
        params: parameters, all on one device (fp32, bf16 or fp16).
        grads: their gradients (same shapes).
        moms: float32 momentum buffers.
        factors: per parameter, its :class:`ParamFactors` or ``None`` (F = 1).
        steps: per parameter, a float32 scalar tensor holding the step count
            *after* this step's increment.
        lr: learning rate, a float or a one-element tensor on the params' device.
        beta: momentum coefficient.
        weight_decay: L2 coefficient (``decoupled=False``) or decoupled decay.
        damping: lambda added to every preconditioner entry.
        decoupled: AdaFisherW's decoupled weight decay.
        impl: ``"triton"``, ``"foreach"``, ``"reference"`` or ``None`` (automatic).

    Example:
        >>> p = torch.ones(3); g = torch.full((3,), 0.5); m = torch.zeros(3)
        >>> adafisher([p], [g], [m], [None], [torch.tensor(1.0)], lr=0.1, beta=0.9,
        ...           weight_decay=0.0, damping=1e-3, decoupled=False, impl="reference")
        >>> p
        tensor([0.9500, 0.9500, 0.9500])
    """
    if not params:
        return
    _check_args(lr, beta, weight_decay, damping)
    name = resolve_impl(impl, params[0].device)
    kwargs = dict(lr=lr, beta=beta, weight_decay=weight_decay, damping=damping, decoupled=decoupled)
    with torch.no_grad():
        if name == "triton":
            from hf_triaccel.kernels.update import fused_adafisher

            fused_adafisher(params, grads, moms, factors, steps, **kwargs)
        elif name == "foreach":
            _foreach_adafisher(params, grads, moms, factors, steps, **kwargs)
        else:
            _reference_adafisher(params, grads, moms, factors, steps, **kwargs)


def prepare_adafisher(
    params: list[torch.Tensor],
    moms: list[torch.Tensor],
    factors: list[ParamFactors | None],
    steps: list[torch.Tensor],
    *,
    impl: str | None = None,
) -> Callable[..., None]:
    """:func:`adafisher` bound to one fixed set of tensors, for a caller that updates
    the same tensors on every step (the optimizer).

    The returned callable takes ``grads`` and the keyword hyper-parameters of
    :func:`adafisher`. With the Triton implementation it is a
    :class:`~hf_triaccel.kernels.update.FusedAdaFisher`, which checks only the
    parameters' and gradients' addresses per call instead of recognising every tensor;
    the caller prepares again when the momenta, steps or factor vectors change. The
    implementation is resolved once, here; the hyper-parameters are not validated on
    each call, which is left to the caller (``_check_args``).

    Example:
        >>> p = torch.ones(3); m = torch.zeros(3)
        >>> update = prepare_adafisher([p], [m], [None], [torch.tensor(1.0)], impl="reference")
        >>> update([torch.full((3,), 0.5)], lr=0.1, beta=0.9, weight_decay=0.0,
        ...        damping=1e-3, decoupled=False)
        >>> p
        tensor([0.9500, 0.9500, 0.9500])
    """
    if not params:
        raise ValueError("prepare_adafisher needs at least one parameter")
    name = resolve_impl(impl, params[0].device)
    if name == "triton":
        from hf_triaccel.kernels.update import FusedAdaFisher

        return FusedAdaFisher(params, moms, factors, steps)
    run = _foreach_adafisher if name == "foreach" else _reference_adafisher

    def update(grads: list[torch.Tensor], **hyperparameters) -> None:
        with torch.no_grad():
            run(params, grads, moms, factors, steps, **hyperparameters)

    return update
