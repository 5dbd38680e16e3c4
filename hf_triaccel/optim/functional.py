"""The AdaFisher update, as one functional with three implementations.

Over 400 lines: the three implementations, their routing and the storage rules of narrow
weights are one contract (the arithmetic below), each implementation tested against it.

For parameter ``theta`` with gradient ``grad`` (``-grad`` when maximizing), momentum
``m``, step ``t`` (already incremented) and preconditioner ``F`` (see
:mod:`hf_triaccel.curvature.rules`; ``F = 1`` for parameters without factors)::

    AdaFisher  (L2):        g = grad + wd * theta;  m = beta * m + (1 - beta) * g
                            theta = theta - lr / (1 - beta^t) * m / F
    AdaFisherW (decoupled): m = beta * m + (1 - beta) * grad
                            theta = theta - lr * (m / ((1 - beta^t) * F) + wd * theta)

The arithmetic runs at :func:`compute_dtype` of the parameter: float64 for float64
parameters, float32 for float32, bfloat16 and float16 ones. The momentum is stored in its
own dtype (the compute dtype, or a narrower ``state_dtype``), rounded to nearest. The new
weight ``theta + delta`` (``delta = -lr * direction``) is stored by one of
:data:`~hf_triaccel.optim.config.ROUNDINGS`:

- ``"nearest"``: rounded to nearest-even in the parameter's dtype (torch's ``copy_``);
  on a bfloat16 weight an update below half a unit in the last place is lost.
- ``"kahan"``: compensated summation with a buffer ``c`` of the parameter's dtype that
  carries what the rounding dropped (``y = c + delta``; ``theta' = round(theta + y)``;
  ``c' = round(y - (theta' - theta))``), so that ``theta + c`` follows the exact sum.
- ``"stochastic"``: bfloat16 weights (float16 ones are refused): ``theta + delta``
  rounded up or down with probabilities that make its expectation exact (16 random bits
  added to the float32 value's dropped bits).

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
from hf_triaccel.optim.config import ROUNDINGS, check_step_hyperparameters

Update = Callable[..., None]
"""An update bound to fixed tensors: ``update(grads, **hyperparameters)``."""


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of a parameter's update arithmetic and of its momentum.

    Example:
        >>> compute_dtype(torch.bfloat16), compute_dtype(torch.float64)
        (torch.float32, torch.float64)
    """
    return torch.float64 if dtype == torch.float64 else torch.float32


def is_narrow(dtype: torch.dtype) -> bool:
    """Whether a weight of ``dtype`` is stored narrower than its update's arithmetic, so
    that storing it rounds (and ``weight_rounding`` applies).

    Example:
        >>> is_narrow(torch.bfloat16), is_narrow(torch.float32)
        (True, False)
    """
    return compute_dtype(dtype) != dtype


def stochastic_bfloat16(x: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """float32 ``x`` rounded to bfloat16 stochastically: 16 uniform random bits added to
    the 16 bits bfloat16 drops, then truncated, so each value rounds to its upper
    neighbour with probability (distance to the lower) / (spacing). Non-finite values
    keep their nearest rounding.

    Example:
        >>> x = torch.full((4096,), 1.0 + 2.0**-9)  # a quarter of the way to the next bf16
        >>> up = stochastic_bfloat16(x, torch.Generator().manual_seed(0)) > 1.0
        >>> 0.2 < up.float().mean().item() < 0.3
        True
    """
    bits = x.view(torch.int32)
    noise = torch.randint(
        0, 1 << 16, x.shape, dtype=torch.int32, device=x.device, generator=generator
    )
    rounded = ((bits + noise) & -65536).view(torch.float32)
    return torch.where(x.isfinite(), rounded, x).to(torch.bfloat16)


def _rounding_generator(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device).manual_seed(seed)


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
    comps=None,
    rounding="nearest",
    seed=0,
) -> None:
    generator = _rounding_generator(params[0].device, seed) if rounding == "stochastic" else None
    comps = comps if comps is not None else [None] * len(params)
    for p, grad, m, fac, step, comp in zip(params, grads, moms, factors, steps, comps, strict=True):
        dtype = compute_dtype(p.dtype)
        theta = p.to(dtype)
        g = grad.to(dtype)
        if maximize:
            g = -g
        bias_correction = 1.0 - beta ** step.to(dtype)
        if not decoupled and weight_decay:
            g = g + weight_decay * theta
        mom = m.to(dtype)
        mom.mul_(beta).add_(g, alpha=1.0 - beta)
        if mom is not m:
            m.copy_(mom)
        fisher = preconditioner(p, fac, damping, dtype)
        direction = mom / bias_correction if fisher is None else mom / (bias_correction * fisher)
        if decoupled and weight_decay:
            direction = direction + weight_decay * theta
        if p.dtype == dtype:  # nothing is rounded away in storing the weight
            p.copy_(theta - lr * direction)
        elif rounding == "kahan":
            y = comp.to(dtype) - lr * direction
            new = (theta + y).to(p.dtype)
            comp.copy_(y - (new.to(dtype) - theta))
            p.copy_(new)
        elif rounding == "stochastic":
            p.copy_(stochastic_bfloat16(theta - lr * direction, generator))
        else:
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
    comps=None,
    rounding="nearest",
    seed=0,
) -> None:
    """The ``_foreach`` update of tensors that share one compute dtype."""
    dtype = compute_dtype(params[0].dtype)
    thetas = [p.to(dtype) for p in params]
    gs = [g.to(dtype) for g in grads]
    # momenta stored narrower than the arithmetic are widened, then stored back
    mom_work = [m.to(dtype) for m in moms]
    narrow = [i for i, (m, w) in enumerate(zip(moms, mom_work, strict=True)) if m is not w]
    if maximize:
        gs = torch._foreach_neg(gs)
    if not decoupled and weight_decay:
        gs = torch._foreach_add(gs, thetas, alpha=weight_decay)
    torch._foreach_mul_(mom_work, beta)
    torch._foreach_add_(mom_work, gs, alpha=1.0 - beta)
    if narrow:
        torch._foreach_copy_(_pick(moms, narrow), _pick(mom_work, narrow))
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
    directions = torch._foreach_div(mom_work, denoms)
    if decoupled and weight_decay:
        torch._foreach_add_(directions, thetas, alpha=weight_decay)
    if rounding == "nearest" or params[0].dtype == dtype:  # routed apart: all or none narrow
        if isinstance(lr, torch.Tensor):
            torch._foreach_mul_(directions, lr.to(dtype))
            torch._foreach_sub_(thetas, directions)
        else:
            torch._foreach_add_(thetas, directions, alpha=-lr)
        torch._foreach_copy_(params, thetas)
        return
    # lr * direction, rounded once, as the reference forms it
    if isinstance(lr, torch.Tensor):
        torch._foreach_mul_(directions, lr.to(dtype))
    else:
        torch._foreach_mul_(directions, lr)
    if rounding == "kahan":
        ys = torch._foreach_sub([c.to(dtype) for c in comps], directions)
        news = [s.to(p.dtype) for s, p in zip(torch._foreach_add(thetas, ys), params, strict=True)]
        kept = torch._foreach_sub([n.to(dtype) for n in news], thetas)
        torch._foreach_copy_(comps, torch._foreach_sub(ys, kept))
        torch._foreach_copy_(params, news)
    else:
        generator = _rounding_generator(params[0].device, seed)
        news = torch._foreach_sub(thetas, directions)
        torch._foreach_copy_(params, [stochastic_bfloat16(n, generator) for n in news])


def _pick(tensors: list, positions: tuple[int, ...] | list[int]) -> list:
    return [tensors[i] for i in positions]


def _bind(run: Callable[..., None], params, moms, factors, steps, comps, rounding) -> Update:
    """``run`` (the reference or ``foreach`` update) bound to these tensors."""

    def update(grads: list[torch.Tensor], **hyperparameters) -> None:
        with torch.no_grad():
            run(
                params,
                grads,
                moms,
                factors,
                steps,
                comps=comps,
                rounding=rounding,
                **hyperparameters,
            )

    return update


def _bind_fused(params, moms, factors, steps, comps, rounding) -> Update:
    """The fused kernel bound to these tensors, then the ``foreach`` path on any it
    leaves for their memory layout (their positions come back from each call)."""
    from hf_triaccel.kernels.update import FusedAdaFisher

    kernel = FusedAdaFisher(params, moms, factors, steps, comps=comps, rounding=rounding)

    def update(grads: list[torch.Tensor], **hyperparameters) -> None:
        left = kernel(grads, **hyperparameters)
        if left:
            with torch.no_grad():
                tensors = (params, grads, moms, factors, steps)
                _foreach_update(
                    *(_pick(t, left) for t in tensors),
                    comps=_pick(comps, left),
                    rounding=rounding,
                    **hyperparameters,
                )

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
    runs once per compute dtype and per kind of weight (narrower than the arithmetic, or
    not); ``triton`` takes the kernel's dtypes and leaves the others to ``foreach``."""
    if name == "reference":
        return [("reference", list(range(len(params))))]
    fused: tuple[torch.dtype, ...] = ()
    if name == "triton":
        from hf_triaccel.kernels.update import FUSED_DTYPES

        fused = FUSED_DTYPES
    routes: dict[object, list[int]] = {}
    for i, p in enumerate(params):
        key = "triton" if p.dtype in fused else (compute_dtype(p.dtype), is_narrow(p.dtype))
        routes.setdefault(key, []).append(i)
    return [("triton" if k == "triton" else "foreach", pos) for k, pos in routes.items()]


def _check_tensors(params, moms, factors, steps, comps, rounding) -> None:
    """What the updates take for granted: matching lists, floating-point momenta of the
    parameter's shape, one-element step tensors, with ``"kahan"`` a compensation buffer
    of the parameter's dtype and shape for each weight narrower than the arithmetic, with
    ``"stochastic"`` no float16 weight; complex parameters are refused."""
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding={rounding!r}: must be one of {ROUNDINGS}")
    if not (len(params) == len(moms) == len(factors) == len(steps) == len(comps)):
        raise ValueError("params, moms, factors, steps and comps must have the same length")
    for i, (p, m, s, c) in enumerate(zip(params, moms, steps, comps, strict=True)):
        if not p.is_floating_point():
            raise TypeError(
                f"params[{i}]: AdaFisher updates real floating-point tensors, got {p.dtype}"
            )
        if not m.is_floating_point() or m.shape != p.shape:
            raise ValueError(
                f"moms[{i}]: momentum must be a floating-point tensor of the parameter's "
                f"shape {tuple(p.shape)} (got {m.dtype}, {tuple(m.shape)})"
            )
        if not isinstance(s, torch.Tensor) or s.numel() != 1:
            raise ValueError(f"steps[{i}]: a step must be a one-element tensor")
        if not is_narrow(p.dtype):
            continue
        if rounding == "kahan" and (c is None or c.dtype != p.dtype or c.shape != p.shape):
            raise ValueError(
                f"comps[{i}]: rounding='kahan' needs a compensation buffer of the "
                f"parameter's dtype {p.dtype} and shape {tuple(p.shape)}"
            )
        if rounding == "stochastic" and p.dtype != torch.bfloat16:
            raise ValueError(
                f"params[{i}]: rounding='stochastic' rounds bfloat16 weights, got {p.dtype} "
                "(use rounding='kahan' for float16 weights)"
            )


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
    comps: list[torch.Tensor | None] | None = None,
    rounding: str = "nearest",
) -> Update:
    """:func:`adafisher` bound to one fixed set of tensors, for a caller that updates
    the same tensors on every step (the optimizer).

    The returned callable takes ``grads`` and the keyword hyperparameters of
    :func:`adafisher` (``seed`` included). The tensors are routed here, once: with the
    Triton implementation, parameters of the kernel's dtypes go to a
    :class:`~hf_triaccel.kernels.update.FusedAdaFisher` (which checks only the
    parameters' and gradients' addresses per call), the others, and any the kernel
    leaves for their memory layout, to the ``foreach`` path, which runs once per compute
    dtype. The caller prepares again when the momenta, steps, compensation buffers or
    factor vectors change. The hyperparameters are not validated on each call: that is
    left to the caller (:func:`~hf_triaccel.optim.config.check_step_hyperparameters`).

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
    comps = [None] * len(params) if comps is None else list(comps)
    _check_tensors(params, moms, factors, steps, comps, rounding)
    tensors = (params, moms, factors, steps, comps)
    parts = [
        (positions, _BINDERS[name](*(_pick(t, positions) for t in tensors), rounding))
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
    comps: list[torch.Tensor | None] | None = None,
    rounding: str = "nearest",
    seed: int = 0,
) -> None:
    """Applies one AdaFisher step to ``params`` in place (see the module docstring).

    Args:
        params: real floating-point parameters, all on one device.
        grads: their gradients (same shapes).
        moms: momentum buffers (same shapes), of any floating dtype: the arithmetic runs
            in :func:`compute_dtype` of the parameter, and the momentum is stored back
            rounded to nearest in its own dtype.
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
        comps: per parameter, its compensation buffer (parameter dtype and shape) for
            ``rounding="kahan"``; ignored otherwise.
        rounding: how the new weight is stored, one of :data:`ROUNDINGS`.
        seed: the random stream of ``rounding="stochastic"`` (the caller changes it
            every step).

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
    comps = [None] * len(params) if comps is None else list(comps)
    _check_tensors(params, moms, factors, steps, comps, rounding)
    if len(grads) != len(params):
        raise ValueError(f"expected {len(params)} gradients, got {len(grads)}")
    hyperparameters = dict(
        lr=lr,
        beta=beta,
        weight_decay=weight_decay,
        damping=damping,
        decoupled=decoupled,
        maximize=maximize,
        rounding=rounding,
        seed=seed,
    )
    for name, positions in _route(params, resolve_impl(impl, params[0].device)):
        tensors = (params, grads, moms, factors, steps, comps)
        if len(positions) != len(params):
            tensors = tuple(_pick(t, positions) for t in tensors)
        if name == "triton":
            from hf_triaccel.kernels.update import fused_adafisher

            left = fused_adafisher(*tensors[:5], comps=tensors[5], **hyperparameters)
            if not left:
                continue
            tensors = tuple(_pick(t, left) for t in tensors)
            name = "foreach"
        with torch.no_grad():
            run = _foreach_update if name == "foreach" else _reference_update
            run(*tensors[:5], comps=tensors[5], **hyperparameters)
