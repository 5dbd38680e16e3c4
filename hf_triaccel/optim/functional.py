"""The AdaFisher update, as one functional with three implementations.

For parameter ``theta`` with gradient ``grad`` (``-grad`` when maximizing), momentum
``m``, step ``t`` (already incremented) and preconditioner ``F`` (see
:mod:`hf_triaccel.curvature.rules`; ``F = 1`` for parameters without factors)::

    AdaFisher  (L2):        g = grad + wd * theta;  m = beta * m + (1 - beta) * g
                            theta = theta - lr / (1 - beta^t) * m / F
    AdaFisherW (decoupled): m = beta * m + (1 - beta) * grad
                            theta = theta - lr * (m / ((1 - beta^t) * F) + wd * theta)

The arithmetic runs at :func:`compute_dtype` of the parameter, the momentum's dtype:
float64 for float64 parameters, float32 for float32, bfloat16 and float16 ones.

- ``reference``: one tensor at a time, F materialised from index arithmetic.
- ``foreach``: torch ``_foreach`` ops over all tensors of one compute dtype, F
  materialised per tensor as a broadcast outer product of the two factor vectors
  (:func:`broadcast_preconditioner`).
- ``triton``: one fused multi-tensor kernel per (dtype, group) that builds F per tile
  from the two factor vectors (``hf_triaccel.kernels.update``), for the parameters of
  its dtypes in the layouts it can walk; this module routes every other tensor to the
  ``foreach`` path.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from hf_triaccel._types import FactorLayout, ParamFactors
from hf_triaccel.dispatch import resolve_impl
from hf_triaccel.optim.config import check_step_hyperparameters

Update = Callable[..., None]
"""An update bound to fixed tensors: ``update(grads, **hyperparameters)``."""


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of a parameter's update arithmetic and of its momentum.

    Example:
        >>> compute_dtype(torch.bfloat16), compute_dtype(torch.float64)
        (torch.float32, torch.float64)
    """
    return torch.float64 if dtype == torch.float64 else torch.float32


def preconditioner(
    param: torch.Tensor,
    factors: ParamFactors | None,
    damping: float,
    dtype: torch.dtype | None = None,
) -> torch.Tensor | None:
    """F for every element of ``param`` (same shape), or ``None`` for F = 1.

    Args:
        param: the parameter.
        factors: its factors, or ``None``.
        damping: lambda added to every entry.
        dtype: the arithmetic's dtype (default: the factors').
    """
    if factors is None:
        return None
    gi, ai = factors.layout.indices(param.numel(), factors.g.device)
    g, a = factors.g[gi], factors.a[ai]
    if dtype is not None:
        g, a = g.to(dtype), a.to(dtype)
    return (g * a + damping).view(param.shape)


@functools.cache
def _digit_shapes(layout: FactorLayout, numel: int) -> tuple[tuple[int, ...], ...] | None:
    """The shapes of ``g`` and ``a`` that broadcast to the parameter's flat index ``k``
    split into mixed-radix digits (``None``: the layout has none). Factor ``x`` reads
    ``k``'s range ``[x_div, x_div * x_mod)`` (one entry when ``x_mod == 1``): where these
    bounds and ``numel`` each divide the next, each factor spans a run of digits.

    Example:
        >>> _digit_shapes(FactorLayout(g_div=3, g_mod=2, a_div=1, a_mod=3), 6)  # (2, 3) weight
        ((2, 1), (1, 3))
    """
    ranges = [(layout.g_div, layout.g_mod), (layout.a_div, layout.a_mod)]
    bounds = sorted({1, numel, *(b for d, m in ranges if m > 1 for b in (d, d * m))})
    if bounds[-1] != numel or any(hi % lo for lo, hi in zip(bounds, bounds[1:], strict=False)):
        return None
    digits = list(zip(bounds, bounds[1:], strict=False))[::-1]  # most significant first
    return tuple(
        tuple(hi // lo if m > 1 and d <= lo and hi <= d * m else 1 for lo, hi in digits) or (1,)
        for d, m in ranges
    )


def broadcast_preconditioner(
    param: torch.Tensor,
    factors: ParamFactors | None,
    damping: float,
    dtype: torch.dtype | None = None,
) -> torch.Tensor | None:
    """:func:`preconditioner`'s values from the factor vectors broadcast against each other,
    without per-element indices (a layout with no broadcast form takes its index path).

    Example:
        >>> from hf_triaccel.curvature.rules.base import out_in_layout
        >>> fac = ParamFactors(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 3.0, 5.0]),
        ...                    out_in_layout(2, 3))
        >>> broadcast_preconditioner(torch.zeros(2, 3), fac, damping=0.5)
        tensor([[ 1.5000,  3.5000,  5.5000],
                [ 2.5000,  6.5000, 10.5000]])
    """
    if factors is None:
        return None
    layout, shapes = factors.layout, _digit_shapes(factors.layout, param.numel())
    if shapes is None:
        return preconditioner(param, factors, damping, dtype)
    g = factors.g[: layout.g_mod].view(shapes[0])
    a = factors.a[layout.a_off : layout.a_off + layout.a_mod].view(shapes[1])
    if dtype is not None:
        g, a = g.to(dtype), a.to(dtype)
    return (g * a + damping).reshape(param.shape)


def _reference_update(
    params,
    grads,
    moms,
    factors,
    steps,
    *,
    lr,
    beta,
    weight_decay,
    damping,
    decoupled,
    maximize=False,
) -> None:
    for p, grad, m, fac, step in zip(params, grads, moms, factors, steps, strict=True):
        dtype = m.dtype
        theta = p.to(dtype)
        g = grad.to(dtype)
        if maximize:
            g = -g
        bias_correction = 1.0 - beta ** step.to(dtype)
        if not decoupled and weight_decay:
            g = g + weight_decay * theta
        m.mul_(beta).add_(g, alpha=1.0 - beta)
        fisher = preconditioner(p, fac, damping, dtype)
        direction = m / bias_correction if fisher is None else m / (bias_correction * fisher)
        if decoupled and weight_decay:
            direction = direction + weight_decay * theta
        p.copy_(theta - lr * direction)


def _foreach_update(
    params,
    grads,
    moms,
    factors,
    steps,
    *,
    lr,
    beta,
    weight_decay,
    damping,
    decoupled,
    maximize=False,
) -> None:
    """The ``_foreach`` update of tensors that share one compute dtype (their momenta's)."""
    dtype = moms[0].dtype
    thetas = [p.to(dtype) for p in params]
    gs = [g.to(dtype) for g in grads]
    if maximize:
        gs = torch._foreach_neg(gs)
    if not decoupled and weight_decay:
        gs = torch._foreach_add(gs, thetas, alpha=weight_decay)
    torch._foreach_mul_(moms, beta)
    torch._foreach_add_(moms, gs, alpha=1.0 - beta)
    # bias_correction * F, one tensor per parameter (F = 1 where a parameter has no factors)
    exponents = steps if dtype == torch.float32 else [s.to(dtype) for s in steps]
    bias_corrections = torch._foreach_neg(torch._foreach_pow(beta, exponents))
    torch._foreach_add_(bias_corrections, 1.0)
    denoms = [
        bc if f is None else f * bc
        for bc, f in zip(
            bias_corrections,
            (
                broadcast_preconditioner(p, fac, damping, dtype)
                for p, fac in zip(params, factors, strict=True)
            ),
            strict=True,
        )
    ]
    directions = torch._foreach_div(moms, denoms)
    if decoupled and weight_decay:
        torch._foreach_add_(directions, thetas, alpha=weight_decay)
    if isinstance(lr, torch.Tensor):
        torch._foreach_mul_(directions, lr.to(dtype))
        torch._foreach_sub_(thetas, directions)
    else:
        torch._foreach_add_(thetas, directions, alpha=-lr)
    torch._foreach_copy_(params, thetas)


def _pick(tensors: list, positions: tuple[int, ...] | list[int]) -> list:
    return [tensors[i] for i in positions]


def _bind(run: Callable[..., None], params, moms, factors, steps) -> Update:
    """``run`` (the reference or ``foreach`` update) bound to these tensors."""

    def update(grads: list[torch.Tensor], **hyperparameters) -> None:
        with torch.no_grad():
            run(params, grads, moms, factors, steps, **hyperparameters)

    return update


def _bind_fused(params, moms, factors, steps) -> Update:
    """The fused kernel bound to these tensors, then the ``foreach`` path on any it
    leaves for their memory layout (their positions come back from each call)."""
    from hf_triaccel.kernels.update import FusedAdaFisher

    kernel = FusedAdaFisher(params, moms, factors, steps)

    def update(grads: list[torch.Tensor], **hyperparameters) -> None:
        left = kernel(grads, **hyperparameters)
        if left:
            with torch.no_grad():
                tensors = (params, grads, moms, factors, steps)
                _foreach_update(*(_pick(t, left) for t in tensors), **hyperparameters)

    return update


def _routed(parts: list[tuple[list[int], Update]], n: int) -> Update:
    """One update over ``n`` tensors from updates bound to subsets of them."""
    if len(parts) == 1 and len(parts[0][0]) == n:
        return parts[0][1]  # the usual case: nothing to split per call

    def update(grads: list[torch.Tensor], **hyperparameters) -> None:
        for positions, part in parts:
            part(_pick(grads, positions), **hyperparameters)

    return update


def _route(params: list[torch.Tensor], name: str) -> list[tuple[str, list[int]]]:
    """Which implementation updates which tensors: ``reference`` takes all; ``foreach``
    runs once per compute dtype; ``triton`` takes the kernel's dtypes and leaves the
    others to ``foreach``."""
    if name == "reference":
        return [("reference", list(range(len(params))))]
    fused: tuple[torch.dtype, ...] = ()
    if name == "triton":
        from hf_triaccel.kernels.update import FUSED_DTYPES

        fused = FUSED_DTYPES
    routes: dict[str | torch.dtype, list[int]] = {}
    for i, p in enumerate(params):
        routes.setdefault("triton" if p.dtype in fused else compute_dtype(p.dtype), []).append(i)
    return [("triton" if k == "triton" else "foreach", pos) for k, pos in routes.items()]


def _check_tensors(params, moms, factors, steps) -> None:
    """What the updates take for granted: matching lists, momenta of the compute dtype
    and shape, one-element step tensors; complex parameters are refused."""
    if not (len(params) == len(moms) == len(factors) == len(steps)):
        raise ValueError("params, moms, factors and steps must have the same length")
    for i, (p, m, s) in enumerate(zip(params, moms, steps, strict=True)):
        if not p.is_floating_point():
            raise TypeError(
                f"params[{i}]: AdaFisher updates real floating-point tensors, got {p.dtype}"
            )
        if m.dtype != compute_dtype(p.dtype) or m.shape != p.shape:
            raise ValueError(
                f"moms[{i}]: momentum must be {compute_dtype(p.dtype)} of the parameter's "
                f"shape {tuple(p.shape)} (got {m.dtype}, {tuple(m.shape)})"
            )
        if not isinstance(s, torch.Tensor) or s.numel() != 1:
            raise ValueError(f"steps[{i}]: a step must be a one-element tensor")


_BINDERS = {
    "reference": lambda *tensors: _bind(_reference_update, *tensors),
    "foreach": lambda *tensors: _bind(_foreach_update, *tensors),
    "triton": _bind_fused,
}


def prepare_adafisher(
    params: list[torch.Tensor],
    moms: list[torch.Tensor],
    factors: list[ParamFactors | None],
    steps: list[torch.Tensor],
    *,
    impl: str | None = None,
) -> Update:
    """:func:`adafisher` bound to one fixed set of tensors, for a caller that updates
    the same tensors on every step (the optimizer).

    The returned callable takes ``grads`` and the keyword hyperparameters of
    :func:`adafisher`. The tensors are routed here, once: with the Triton
    implementation, parameters of the kernel's dtypes go to a
    :class:`~hf_triaccel.kernels.update.FusedAdaFisher` (which checks only the
    parameters' and gradients' addresses per call), the others, and any the kernel
    leaves for their memory layout, to the ``foreach`` path, which runs once per compute
    dtype. The caller prepares again when the momenta, steps or factor vectors change.
    The hyperparameters are not validated on each call: that is left to the caller
    (:func:`~hf_triaccel.optim.config.check_step_hyperparameters`).

    Example:
        >>> p = torch.ones(3); m = torch.zeros(3)
        >>> update = prepare_adafisher([p], [m], [None], [torch.tensor(1.0)], impl="reference")
        >>> update([torch.full((3,), 0.5)], lr=0.1, beta=0.9, weight_decay=0.0,
        ...        damping=1e-3, decoupled=False, maximize=False)
        >>> p
        tensor([0.9500, 0.9500, 0.9500])
    """
    if not params:
        raise ValueError("prepare_adafisher needs at least one parameter")
    _check_tensors(params, moms, factors, steps)
    tensors = (params, moms, factors, steps)
    parts = [
        (positions, _BINDERS[name](*(_pick(t, positions) for t in tensors)))
        for name, positions in _route(params, resolve_impl(impl, params[0].device))
    ]
    return _routed(parts, len(params))


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
    maximize: bool = False,
    impl: str | None = None,
) -> None:
    """Applies one AdaFisher step to ``params`` in place (see the module docstring).

    Args:
        params: real floating-point parameters, all on one device.
        grads: their gradients (same shapes).
        moms: momentum buffers, of :func:`compute_dtype` of their parameter.
        factors: per parameter, its :class:`ParamFactors` or ``None`` (F = 1).
        steps: per parameter, a one-element float32 tensor holding the step count
            *after* this step's increment.
        lr: learning rate, a float or a one-element tensor on the params' device.
        beta: momentum coefficient.
        weight_decay: L2 coefficient (``decoupled=False``) or decoupled decay.
        damping: lambda added to every preconditioner entry.
        decoupled: AdaFisherW's decoupled weight decay.
        maximize: ascend instead of descend (the gradient's sign is flipped).
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
    check_step_hyperparameters(lr, beta, weight_decay, damping, owner="adafisher")
    _check_tensors(params, moms, factors, steps)
    if len(grads) != len(params):
        raise ValueError(f"expected {len(params)} gradients, got {len(grads)}")
    hyperparameters = dict(
        lr=lr,
        beta=beta,
        weight_decay=weight_decay,
        damping=damping,
        decoupled=decoupled,
        maximize=maximize,
    )
    for name, positions in _route(params, resolve_impl(impl, params[0].device)):
        tensors = (params, grads, moms, factors, steps)
        if len(positions) != len(params):
            tensors = tuple(_pick(t, positions) for t in tensors)
        if name == "triton":
            from hf_triaccel.kernels.update import fused_adafisher

            left = fused_adafisher(*tensors, **hyperparameters)
            if not left:
                continue
            tensors = tuple(_pick(t, left) for t in tensors)
            name = "foreach"
        with torch.no_grad():
            run = _foreach_update if name == "foreach" else _reference_update
            run(*tensors, **hyperparameters)
