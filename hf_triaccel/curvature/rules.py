"""Which modules carry Fisher factors, and how their statistics are taken.

A :class:`FisherRule` knows, for one kind of module, the lengths of its two factor
vectors (``a`` from the layer input, ``g`` from the gradient of its output), how to
compute one statistic of each from a forward input / output gradient, and how each
of the module's parameters indexes the two vectors (:class:`FactorLayout`).

The preconditioner entry for flat element ``k`` of a parameter is::

    F[k] = g[(k // g_div) % g_mod] * a[(k // a_div) % a_mod + a_off] + damping

which covers weights stored (out, in) (Linear, Conv), (in, out) (Embedding,
transformers' Conv1D), biases (the last ``a`` entry) and normalisation layers
(``a`` is a 2-vector: entry 0 for the weight, entry 1 for the bias).

Statistics are taken two ways. :meth:`FisherRule.a_stat` / :meth:`FisherRule.g_stat`
return one micro-batch's statistic as a new tensor. The collector uses the fast path
beside them, :meth:`FisherRule.a_write` / :meth:`FisherRule.g_add`, which runs on every
hooked layer of every refresh step and is bound by host time: it writes into the
caller's preallocated float32 buffers through the reductions' epilogue (one or two
kernel launches), keeps whatever does not change from call to call (shapes, scales,
scratch buffers, window selectors) in a cache the caller holds per module, and leaves
an entry that is a constant of the input shape (the bias column of ones, a norm
layer's size entry) to the caller, which sets it once per refresh. The built-in rules
compute ``a_stat`` / ``g_stat`` through their fast path, so both give the same
numbers; a custom rule only needs ``a_stat`` / ``g_stat``.

Rules are looked up along the module's class hierarchy, so subclasses (timm's
``BatchNormAct2d``) are covered. :func:`register_fisher_rule` adds a rule for a
custom module class.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hf_triaccel._types import FactorLayout
from hf_triaccel.curvature.reductions import Reduction, reductions_for


def out_in_layout(d_out: int, d_in: int) -> FactorLayout:
    """Weight stored (d_out, d_in...): g over rows, a over columns."""
    return FactorLayout(g_div=d_in, g_mod=d_out, a_div=1, a_mod=d_in)


def in_out_layout(d_in: int, d_out: int) -> FactorLayout:
    """Weight stored (d_in, d_out): a over rows, g over columns."""
    return FactorLayout(g_div=1, g_mod=d_out, a_div=d_out, a_mod=d_in)


def per_entry_layout(n: int, a_entry: int) -> FactorLayout:
    """A vector parameter: g per entry, one shared ``a`` entry (bias or norm affine)."""
    return FactorLayout(g_div=1, g_mod=n, a_div=1, a_mod=1, a_off=a_entry)


class FisherRule:
    """Statistics of one module kind.

    A subclass overrides :meth:`sizes`, :meth:`layouts`, :meth:`a_stat` and
    :meth:`g_stat` (and :meth:`output_module` when the output gradient is taken
    elsewhere); :meth:`a_write` / :meth:`g_add` then work through those two. Overriding
    the fast path as well saves host time on refresh steps.
    """

    def sizes(self, module: nn.Module) -> tuple[int, int]:
        """Lengths of the (a, g) factor vectors."""
        raise NotImplementedError

    def layouts(self, module: nn.Module) -> dict[str, FactorLayout]:
        """Layout of each direct parameter, by attribute name."""
        raise NotImplementedError

    def a_stat(self, module: nn.Module, x: torch.Tensor, impl: str | None) -> torch.Tensor:
        """Activation statistic (float32, length a) from the module's input."""
        raise NotImplementedError

    def g_stat(self, module: nn.Module, grad: torch.Tensor, impl: str | None) -> torch.Tensor:
        """Gradient statistic (float32, length g) from the gradient of the module's output."""
        raise NotImplementedError

    def output_module(self, module: nn.Module) -> nn.Module:
        """The module whose output gradient ``g_stat`` reads: ``module`` itself, unless
        its forward applies something (an activation) after the parameterised op."""
        return module

    def a_write(
        self,
        module: nn.Module,
        x: torch.Tensor,
        out: torch.Tensor,
        impl: str | None,
        cache: dict[Any, Any],
    ) -> float | None:
        """Writes the activation statistic of one micro-batch into ``out``.

        Args:
            module: the module.
            x: its input, detached from autograd.
            out: contiguous float32 destination of length ``sizes(module)[0]``.
            impl: implementation (see :mod:`hf_triaccel.dispatch`).
            cache: a dict the caller keeps for this module (and empties when the
                module's buffers move), where the rule keeps what it can reuse.

        Returns:
            ``None`` when every entry of ``out`` was written. Otherwise the value of
            the last entry, which was left untouched for the caller to set: it only
            depends on the input's shape.
        """
        with torch.no_grad():
            out.copy_(self.a_stat(module, x, impl))
        return None

    def g_add(
        self,
        module: nn.Module,
        grad: torch.Tensor,
        out: torch.Tensor,
        accumulate: bool,
        impl: str | None,
        cache: dict[Any, Any],
    ) -> None:
        """Writes the gradient statistic of one micro-batch into ``out``, or adds it to
        ``out`` when ``accumulate``. Arguments as for :meth:`a_write`; ``out`` has
        length ``sizes(module)[1]``."""
        with torch.no_grad():
            g = self.g_stat(module, grad, impl)
            if accumulate:
                out.add_(g)
            else:
                out.copy_(g)


def _defined_in(cls: type, name: str) -> type:
    """The class of ``cls``'s hierarchy whose body defines ``name``."""
    return next(c for c in cls.__mro__ if name in vars(c))


def statistic_writers(rule: FisherRule) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """The ``(a_write, g_add)`` a collector calls for ``rule``.

    These are the rule's own unless its class overrides ``a_stat`` (``g_stat``) below
    the class that defines ``a_write`` (``g_add``): then :class:`FisherRule`'s generic
    versions, which go through the overridden statistic, so that a subclass of a
    built-in rule that changes a statistic is not bypassed by its base's fast path.
    """
    cls = type(rule)
    writers = []
    for fast, full in (("a_write", "a_stat"), ("g_add", "g_stat")):
        if issubclass(_defined_in(cls, fast), _defined_in(cls, full)):
            writers.append(getattr(rule, fast))
        else:
            writers.append(functools.partial(getattr(FisherRule, fast), rule))
    return writers[0], writers[1]


class _BuiltinRule(FisherRule):
    """Base of the built-in rules: ``a_stat`` / ``g_stat`` run the fast path into new
    buffers, so that the statistics tested through them are the ones the collector takes."""

    def a_stat(self, module, x, impl):
        out = torch.zeros(self.sizes(module)[0], dtype=torch.float32, device=x.device)
        last = self.a_write(module, x.detach(), out, impl, {})
        if last is not None:
            out[-1] = last
        return out

    def g_stat(self, module, grad, impl):
        out = torch.empty(self.sizes(module)[1], dtype=torch.float32, device=grad.device)
        self.g_add(module, grad.detach(), out, False, impl, {})
        return out


class _ViewOf:
    """A view of a caller's buffer, made again only when the buffer changes: making a
    view costs about as much host time as the launch it feeds.

    The view holds the buffer's storage, so an unchanged address means the same buffer.
    """

    __slots__ = ("make", "ptr", "view")

    def __init__(self, make: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.make = make
        self.ptr = -1
        self.view: torch.Tensor | None = None

    def __call__(self, out: torch.Tensor) -> torch.Tensor:
        ptr = out.data_ptr()
        if ptr != self.ptr:
            self.view = self.make(out)
            self.ptr = ptr
        return self.view


def _view(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``t`` viewed as ``shape``, copied only when no view exists (``reshape`` costs a
    second dispatch even when it returns a view)."""
    try:
        return t.view(shape)
    except RuntimeError:
        return t.reshape(shape)


# Input shapes a module keeps plans for: an input shape that keeps changing (multi-scale
# images, dynamic sequence lengths) must not pile up buffers; past this the oldest goes.
_MAX_PLANS_PER_MODULE = 16


def _remember(cache: dict[Any, Any], key: Any, plan: Any) -> Any:
    """Stores ``plan`` under ``key`` in a module's cache and returns it."""
    if len(cache) >= _MAX_PLANS_PER_MODULE:
        del cache[next(iter(cache))]
    cache[key] = plan
    return plan


def _inverse(n: float) -> float:
    """1 / n, NaN for an empty input (the mean over nothing)."""
    return 1.0 / n if n else math.nan


@dataclass
class _RowsPlan:
    """A statistic that is a scaled sum over rows of the input viewed as (rows, d)."""

    reduce: Reduction
    rows: int
    d: int
    scale: float
    head: _ViewOf | None = None  # the part of ``out`` the sums go to, when not all of it


def _rows_plan(shape: torch.Size, impl: str | None, device: torch.device, bias: bool) -> _RowsPlan:
    """The plan of a mean over rows of an input of ``shape`` (its last dim kept)."""
    d = shape[-1] if shape else 1
    rows = math.prod(shape) // d if d else 0
    reduce, _ = reductions_for(impl, device)
    head = _ViewOf(lambda out: out[:d]) if bias else None
    return _RowsPlan(reduce, rows, d, _inverse(rows), head)


def _mean_square_rows(
    t: torch.Tensor,
    out: torch.Tensor,
    accumulate: bool,
    impl: str | None,
    cache: dict[Any, Any],
    key: str,
    bias: bool = False,
) -> None:
    """Mean over rows (every dim but the last) of ``t**2`` into ``out`` (its first
    ``t.shape[-1]`` entries when ``bias``)."""
    plan = cache.get((key, t.shape))
    if plan is None:
        plan = _remember(cache, (key, t.shape), _rows_plan(t.shape, impl, t.device, bias))
    dst = out if plan.head is None else plan.head(out)
    plan.reduce(
        _view(t, (plan.rows, plan.d)), True, out=dst, scale=plan.scale, accumulate=accumulate
    )


class LinearRule(_BuiltinRule):
    """``nn.Linear``: a = mean over rows of x^2 (+1 for the bias), g = mean of grad^2."""

    def sizes(self, module):
        return module.in_features + (module.bias is not None), module.out_features

    def layouts(self, module):
        d_out, d_in = module.out_features, module.in_features
        return {"weight": out_in_layout(d_out, d_in), "bias": per_entry_layout(d_out, d_in)}

    def a_write(self, module, x, out, impl, cache):
        bias = module.bias is not None
        _mean_square_rows(x, out, False, impl, cache, "a", bias)
        return 1.0 if bias else None

    def g_add(self, module, grad, out, accumulate, impl, cache):
        _mean_square_rows(grad, out, accumulate, impl, cache, "g")


class HFConv1DRule(LinearRule):
    """transformers' ``Conv1D``: a Linear whose weight is stored (d_in, d_out)."""

    def sizes(self, module):
        d_in, d_out = module.weight.shape
        return d_in + (module.bias is not None), d_out

    def layouts(self, module):
        d_in, d_out = module.weight.shape
        return {"weight": in_out_layout(d_in, d_out), "bias": per_entry_layout(d_out, d_in)}


def _conv_geometry(module: nn.Module, spatial: tuple[int, ...]):
    """Per spatial dim: (input size, kernel, stride, dilation, left pad, output size)."""
    dims = []
    for i, n in enumerate(spatial):
        k, s, d = module.kernel_size[i], module.stride[i], module.dilation[i]
        if module.padding == "same":
            total = d * (k - 1)
            left, right = total // 2, total - total // 2
        elif module.padding == "valid":
            left = right = 0
        else:
            left = right = module.padding[i]
        out = (n + left + right - d * (k - 1) - 1) // s + 1
        dims.append((n, k, s, d, left, out))
    return dims


@functools.lru_cache(maxsize=512)
def _window_selector(
    n: int, k: int, s: int, d: int, left: int, out: int, device, dtype=torch.float32
) -> torch.Tensor:
    """(k, n) 0/1 matrix: entry [p, h] says input position h sits at kernel tap p of some window.

    Cached: it depends only on the geometry, and building it takes several small
    launches that would otherwise repeat for every conv layer on every refresh step.
    The returned tensor is shared: callers must not modify it.
    """
    taps = torch.arange(k, device=device).unsqueeze(1)
    starts = torch.arange(out, device=device).unsqueeze(0) * s - left
    pos = starts + taps * d  # (k, out): the input position each tap of each window reads
    sel = torch.zeros(k, n + 1, device=device, dtype=dtype)
    valid = (pos >= 0) & (pos < n)
    # padded positions read zeros: send them to a scratch column that is dropped
    sel.scatter_add_(1, torch.where(valid, pos, n), torch.ones_like(pos, dtype=sel.dtype))
    return sel[:, :n]


# Largest tap-by-position selector formed as one matrix (4 MiB of float32: a 3x3 kernel
# over 224x224 inputs takes 1.7 MiB); past it the taps are gathered one spatial dim at a
# time, in a few more operations.
_MAX_SELECTOR_ELEMENTS = 1 << 20


@functools.lru_cache(maxsize=64)
def _tap_selector(geometry: tuple[tuple[int, ...], ...], device) -> torch.Tensor:
    """(positions, taps) 0/1 matrix: the Kronecker product of the per-dim window
    selectors, transposed, so that one matrix product gathers every tap of a per-position
    sum. Shared and cached like :func:`_window_selector`."""
    selectors = [_window_selector(*g, device=device) for g in geometry]
    return functools.reduce(torch.kron, selectors).t()


def _pads_same_dynamically(module: nn.Module) -> bool:
    """timm's ``Conv2dSame`` (always) and ``StdConv2dSame`` / ``ScaledStdConv2dSame`` (when
    ``same_pad``) zero-pad their input TensorFlow-style inside ``forward``."""
    if type(module).__name__ == "Conv2dSame":
        return True
    return getattr(module, "same_pad", False) is True


def _tf_same_pads(spatial: tuple[int, ...], module: nn.Module) -> list[int]:
    """The TensorFlow 'SAME' zero padding those modules apply (extra pixel right/bottom),
    in ``F.pad`` order."""
    pads = []
    for n, k, s, d in zip(
        reversed(spatial),
        reversed(module.kernel_size),
        reversed(module.stride),
        reversed(module.dilation),
        strict=True,
    ):
        total = max((-(-n // s) - 1) * s + (k - 1) * d + 1 - n, 0)
        pads += [total // 2, total - total // 2]
    return pads


@dataclass
class _ConvPlan:
    """Everything the activation statistic of a conv needs for one input shape and layout.

    The input (padded first when the module pads inside its forward) is viewed as rows
    of one sample (and group) each; their column sums of x^2, scaled by 1 / (B L D),
    land in ``per_position`` in (channel, position) order, or (position, channel) for a
    channels-last input; one matrix product with the tap selector then writes the
    statistic in weight-flattening order (C_in/groups, *kernel).
    """

    reduce: Reduction
    scale: float
    pad: list[int] | None  # F.pad amounts, applied before the reduction
    pad_mode: str
    unsqueeze: bool  # an unbatched input that must be padded as a batch of one
    row_shape: tuple[int, ...] | None  # view of a contiguous input; None: channels-last
    batch: int
    per_position: torch.Tensor
    channels_last: bool
    by_group: torch.Tensor | None  # channels-last with groups: (positions, groups, C/groups)
    group_sum: torch.Tensor | None  # ... and its sum over the groups
    by_channel: torch.Tensor  # the per-position sums as (C/groups, positions)
    taps: torch.Tensor | None  # (positions, taps) selector; None: gathered per dim
    selectors: list[torch.Tensor]  # per-dim window selectors (the fallback gather)
    spatial: tuple[int, ...]
    head: _ViewOf
    bias: float | None


def _conv_plan(module: nn.Module, x: torch.Tensor, impl: str | None) -> _ConvPlan:
    nd = len(module.kernel_size)
    unbatched = x.dim() == nd + 1
    shape = (1, *x.shape) if unbatched else tuple(x.shape)
    spatial = shape[2:]
    pad, pad_mode = None, "constant"
    if _pads_same_dynamically(module):
        pad = _tf_same_pads(spatial, module)
    elif module.padding_mode != "zeros":
        pad, pad_mode = list(module._reversed_padding_repeated_twice), module.padding_mode
    if pad is not None:
        # F.pad lists the last dim first
        spatial = tuple(n + pad[2 * i] + pad[2 * i + 1] for i, n in enumerate(reversed(spatial)))
        spatial = spatial[::-1]
    if module.padding_mode != "zeros":
        geometry = [
            (n, k, s, d, 0, (n - d * (k - 1) - 1) // s + 1)
            for n, k, s, d in zip(
                spatial, module.kernel_size, module.stride, module.dilation, strict=True
            )
        ]
    else:
        geometry = _conv_geometry(module, spatial)
    b, c = shape[:2]
    groups = module.groups
    c_group = c // groups
    positions = math.prod(spatial)
    kernel = math.prod(module.kernel_size)
    patch = c_group * kernel
    rows = b * math.prod(g[-1] for g in geometry)
    channels_last = pad is None and nd == 2 and not unbatched and not x.is_contiguous()
    channels_last = channels_last and x.is_contiguous(memory_format=torch.channels_last)
    device = x.device
    # the contiguous layout sums the groups in the reduction itself (one row per group)
    per_position_len = (c if channels_last else c_group) * positions
    per_position = torch.empty(per_position_len, dtype=torch.float32, device=device)
    by_group = group_sum = None
    if not channels_last:
        by_channel = per_position.view(c_group, positions)
    elif groups == 1:
        by_channel = per_position.view(positions, c_group).t()
    else:
        by_group = per_position.view(positions, groups, c_group)
        group_sum = torch.empty(positions, c_group, dtype=torch.float32, device=device)
        by_channel = group_sum.t()
    geometry = tuple(tuple(g) for g in geometry)
    selectors = [_window_selector(*g, device=device) for g in geometry]
    taps = None
    if positions * kernel <= _MAX_SELECTOR_ELEMENTS:
        taps = _tap_selector(geometry, device)
    bias = module.bias is not None
    return _ConvPlan(
        reduce=reductions_for(impl, device)[0],
        scale=_inverse(rows * patch),
        pad=pad,
        pad_mode=pad_mode,
        unsqueeze=unbatched and pad is not None,
        row_shape=None if channels_last else (b * groups, c_group * positions),
        batch=b,
        per_position=per_position,
        channels_last=channels_last,
        by_group=by_group,
        group_sum=group_sum,
        by_channel=by_channel,
        taps=taps,
        selectors=selectors,
        spatial=spatial,
        head=_ViewOf(lambda out: (out[:patch] if bias else out).view(c_group, kernel)),
        bias=groups / patch if bias else None,
    )


def _gather_taps(plan: _ConvPlan, dst: torch.Tensor) -> None:
    """Writes the statistic (C_in/groups, taps) from the per-position sums into ``dst``."""
    if plan.by_group is not None:
        torch.sum(plan.by_group, 1, out=plan.group_sum)
    if plan.taps is not None:
        # out= also keeps the product in float32 under autocast, which leaves out= alone
        torch.mm(plan.by_channel, plan.taps, out=dst)
        return
    nd = len(plan.spatial)
    letters, taps = "xyz"[:nd], "ijk"[:nd]
    spec = f"c{letters}," + ",".join(f"{t}{s}" for t, s in zip(taps, letters, strict=True))
    per_position = plan.by_channel.reshape(-1, *plan.spatial)
    with torch.autocast(dst.device.type, enabled=False):
        gathered = torch.einsum(f"{spec}->c{taps}", per_position, *plan.selectors)
    # einsum's result may come back permuted (on CUDA it does): view the destination instead
    dst.view(gathered.shape).copy_(gathered)


class ConvRule(_BuiltinRule):
    """``nn.Conv1d`` / ``nn.Conv2d`` / ``nn.Conv3d``.

    a = sum over batch, output positions and groups of the squared zero-padded patch
    entries, in weight-flattening order (C_in/groups, *kernel), plus the ones column if
    bias, divided by B * L * D (L output positions, D patch length; the published
    scaling). The unfold is never formed: the batch-sum of x^2 is taken once per input
    position (and per group, sharing one reduction), then each kernel tap gathers the
    positions its windows visit through a cached 0/1 selector, in one matrix product.
    g = mean over B * L of the squared output gradient, per output channel.
    """

    def sizes(self, module):
        d = module.in_channels // module.groups * math.prod(module.kernel_size)
        return d + (module.bias is not None), module.out_channels

    def layouts(self, module):
        d = module.in_channels // module.groups * math.prod(module.kernel_size)
        c_out = module.out_channels
        return {"weight": out_in_layout(c_out, d), "bias": per_entry_layout(c_out, d)}

    def a_write(self, module, x, out, impl, cache):
        key = ("a", x.shape, x.stride())
        plan = cache.get(key)
        if plan is None:
            plan = _remember(cache, key, _conv_plan(module, x, impl))
        if plan.pad is not None:
            x = F.pad(x.unsqueeze(0) if plan.unsqueeze else x, plan.pad, mode=plan.pad_mode)
        if plan.channels_last:
            rows = x.permute(0, 2, 3, 1).view(plan.batch, -1)
        else:
            rows = _view(x, plan.row_shape)
        plan.reduce(rows, True, out=plan.per_position, scale=plan.scale)
        _gather_taps(plan, plan.head(out))
        return plan.bias

    def g_add(self, module, grad, out, accumulate, impl, cache):
        _channel_reduce(grad, len(module.kernel_size) + 1, out, accumulate, impl, cache, True)


@dataclass
class _ChannelPlan:
    """A per-channel statistic of an input viewed as (B, C, L)."""

    reduce: Reduction
    shape: tuple[int, int, int]
    scale: float


def _channel_reduce(
    t: torch.Tensor,
    unbatched_dim: int,
    out: torch.Tensor,
    accumulate: bool,
    impl: str | None,
    cache: dict[Any, Any],
    square: bool,
) -> None:
    """Per-channel (dim 1) statistic of ``t`` into ``out``: with ``square``, the mean over
    batch and positions of ``t**2``; otherwise (sum over all dims but 1)^2 / B. A
    ``t`` with ``unbatched_dim`` dims is a batch of one."""
    key = ("channel", t.shape)
    plan = cache.get(key)
    if plan is None:
        shape = (1, *t.shape) if t.dim() == unbatched_dim else tuple(t.shape)
        b, c = shape[:2]
        length = math.prod(shape[2:])
        scale = _inverse(b * length) if square else _inverse(b)
        reduce = reductions_for(impl, t.device)[1]
        plan = _remember(cache, key, _ChannelPlan(reduce, (b, c, length), scale))
    plan.reduce(
        _view(t, plan.shape),
        square,
        out=out,
        scale=plan.scale,
        accumulate=accumulate,
        square_result=not square,
    )


@dataclass
class _NormPlan:
    """The a statistic of a normalisation layer for one input shape."""

    reduce: Reduction
    shape: tuple[int, int, int]
    scale: float
    sums: torch.Tensor  # scratch: the scaled per-channel sums u
    row: torch.Tensor  # u as (1, C)
    column: torch.Tensor  # u as (C, 1)
    first: _ViewOf
    size_entry: float


def _norm_a_write(
    x: torch.Tensor, out: torch.Tensor, impl: str | None, cache: dict[Any, Any]
) -> float:
    """Normalisation layers' a (published reference mode): a 2-vector.

    Reduce over every dim except dim 1: u_j = sum / R^2, R the product of the reduced
    dims other than dim 0; a = [sum_j u_j^2, size of dim 1] / B^2. Writes entry 0 (the
    reduction, scaled by 1 / (R^2 B), then the sum of squares) and returns entry 1.
    """
    key = ("a", x.shape)
    plan = cache.get(key)
    if plan is None:
        shape = (1, *x.shape) if x.dim() == 1 else tuple(x.shape)
        b, c = shape[:2]
        length = math.prod(shape[2:])
        sums = torch.empty(c, dtype=torch.float32, device=x.device)
        plan = _NormPlan(
            reduce=reductions_for(impl, x.device)[1],
            shape=(b, c, length),
            scale=_inverse(float(length) ** 2 * b),
            sums=sums,
            row=sums.view(1, c),
            column=sums.view(c, 1),
            first=_ViewOf(lambda out: out[:1].view(1, 1)),
            size_entry=c / float(b) ** 2 if b else math.nan,
        )
        _remember(cache, key, plan)
    plan.reduce(_view(x, plan.shape), False, out=plan.sums, scale=plan.scale)
    # a (1, C) x (C, 1) product: one dispatch, where dot with out= takes two and a copy
    # (and with out=, a float32 product under autocast too)
    torch.mm(plan.row, plan.column, out=plan.first(out))
    return plan.size_entry


def _affine_numel(module: nn.Module) -> int:
    """Number of affine elements of a normalisation layer, whether or not it has them."""
    shape = getattr(module, "normalized_shape", None)
    if shape is not None:
        return math.prod(shape)
    for attr in ("num_features", "num_channels"):
        n = getattr(module, attr, None)
        if isinstance(n, int):
            return n
    p = module.weight if getattr(module, "weight", None) is not None else module.bias
    return p.numel()


# timm's LayerNorm subclasses that normalise dim 1 of (B, C, H, W) inputs
_CHANNELS_FIRST_LAYER_NORMS = frozenset(
    {"LayerNorm2d", "LayerNormAct2d", "LayerNorm2dFp32", "LayerNormAct2dFp32", "LayerNorm3d"}
)


def _channels_first(module: nn.Module, shape: torch.Size) -> bool:
    """Whether a LayerNorm-like module normalises dim 1 (affine per channel of (B, C, ...))
    rather than the trailing dims: transformers' ``data_format="channels_first"`` layers,
    timm's ``LayerNorm2d`` family, or an input whose trailing dims do not fit while dim 1 does.
    """
    fmt = getattr(module, "data_format", None)
    if fmt in ("channels_first", "channels_last"):
        return fmt == "channels_first"
    if type(module).__name__ in _CHANNELS_FIRST_LAYER_NORMS:
        return True
    ns = tuple(module.normalized_shape)
    return len(ns) == 1 and len(shape) >= 3 and tuple(shape[-1:]) != ns and shape[1] == ns[0]


def _before_activation(module: nn.Module) -> nn.Module:
    """timm's norm-act layers (``BatchNormAct2d``, ``GroupNormAct``...) run
    norm -> ``drop`` -> ``act`` in one forward: the norm's output gradient is the
    gradient of ``drop``'s output, not of the module's."""
    act, drop = getattr(module, "act", None), getattr(module, "drop", None)
    if (
        isinstance(act, nn.Module)
        and not isinstance(act, nn.Identity)
        and isinstance(drop, nn.Module)
    ):
        return drop
    return module


class ChannelNormRule(_BuiltinRule):
    """BatchNorm (1d/2d/3d, and subclasses such as timm's BatchNormAct2d) and GroupNorm.

    a: see :func:`_norm_a_write`; g_c = (sum over all dims but 1 of the output gradient)^2 / B.
    Without affine parameters the layer has nothing to precondition (no factors).
    """

    def sizes(self, module):
        return 2, _affine_numel(module)

    def layouts(self, module):
        c = _affine_numel(module)
        return {"weight": per_entry_layout(c, 0), "bias": per_entry_layout(c, 1)}

    def a_write(self, module, x, out, impl, cache):
        return _norm_a_write(x, out, impl, cache)

    def g_add(self, module, grad, out, accumulate, impl, cache):
        _channel_reduce(grad, 1, out, accumulate, impl, cache, False)

    def output_module(self, module):
        return _before_activation(module)


# LastDimNormRule's plan for channels-first layers: g per channel, as ChannelNormRule's
_PER_CHANNEL = object()


class LastDimNormRule(_BuiltinRule):
    """LayerNorm and RMSNorm (affine over the trailing ``normalized_shape`` dims).

    a: see :func:`_norm_a_write`; g = (sum over the leading, non-normalised dims of the
    output gradient)^2 / B, one entry per affine element. Channels-first subclasses
    (timm's ``LayerNorm2d``, transformers' ``data_format="channels_first"``), which
    normalise dim 1 of (B, C, ...) inputs, take g per channel as :class:`ChannelNormRule`.
    Without affine parameters the layer has nothing to precondition (no factors).
    """

    def sizes(self, module):
        return 2, _affine_numel(module)

    def layouts(self, module):
        n = _affine_numel(module)
        return {"weight": per_entry_layout(n, 0), "bias": per_entry_layout(n, 1)}

    def a_write(self, module, x, out, impl, cache):
        return _norm_a_write(x, out, impl, cache)

    def g_add(self, module, grad, out, accumulate, impl, cache):
        key = ("g", grad.shape)
        plan = cache.get(key)
        if plan is None:
            plan = _remember(cache, key, self._g_plan(module, grad, impl))
        if plan is _PER_CHANNEL:
            _channel_reduce(grad, 1, out, accumulate, impl, cache, False)
            return
        plan.reduce(
            _view(grad, (plan.rows, plan.d)),
            False,
            out=out,
            scale=plan.scale,
            accumulate=accumulate,
            square_result=True,
        )

    @staticmethod
    def _g_plan(module: nn.Module, grad: torch.Tensor, impl: str | None):
        if _channels_first(module, grad.shape):
            return _PER_CHANNEL
        ns = tuple(module.normalized_shape)
        if tuple(grad.shape[grad.dim() - len(ns) :]) != ns:
            raise ValueError(
                f"{type(module).__name__} with normalized_shape {ns} got an output of shape "
                f"{tuple(grad.shape)}, whose trailing dims do not match"
            )
        n = math.prod(ns)
        batch = grad.shape[0] if grad.dim() > len(ns) else 1
        reduce, _ = reductions_for(impl, grad.device)
        return _RowsPlan(reduce, grad.numel() // n if n else 0, n, _inverse(batch))

    def output_module(self, module):
        return _before_activation(module)


@dataclass
class _EmbeddingPlan:
    ones: torch.Tensor  # one per looked-up row: index_add_ counts them exactly
    scale: float


class EmbeddingRule(_BuiltinRule):
    """``nn.Embedding`` (a Linear on one-hot inputs, weight stored (V, D)).

    a_v = share of the input rows that look up row v (the mean of the squared one-hot);
    g = mean over rows of the squared output gradient.
    """

    def sizes(self, module):
        return module.num_embeddings, module.embedding_dim

    def layouts(self, module):
        return {"weight": in_out_layout(module.num_embeddings, module.embedding_dim)}

    def a_write(self, module, x, out, impl, cache):
        key = ("a", x.shape)
        plan = cache.get(key)
        if plan is None:
            n = x.numel()
            ones = torch.ones(n, dtype=torch.float32, device=x.device)
            plan = _remember(cache, key, _EmbeddingPlan(ones, _inverse(n)))
        # index_add_ rather than bincount: bincount sizes its output on the host (a sync)
        out.zero_().index_add_(0, _view(x, (-1,)), plan.ones).mul_(plan.scale)
        return None

    def g_add(self, module, grad, out, accumulate, impl, cache):
        _mean_square_rows(grad, out, accumulate, impl, cache, "g")


_RULES: dict[type, FisherRule] = {
    nn.Linear: LinearRule(),
    nn.Conv1d: ConvRule(),
    nn.Conv2d: ConvRule(),
    nn.Conv3d: ConvRule(),
    nn.modules.batchnorm._BatchNorm: ChannelNormRule(),
    nn.GroupNorm: ChannelNormRule(),
    nn.LayerNorm: LastDimNormRule(),
    nn.RMSNorm: LastDimNormRule(),
    nn.Embedding: EmbeddingRule(),
}
_HF_CONV1D = HFConv1DRule()


def register_fisher_rule(module_type: type, rule: FisherRule) -> None:
    """Registers ``rule`` for ``module_type`` and its subclasses.

    Example:
        >>> class MyLinear(nn.Linear): ...
        >>> register_fisher_rule(MyLinear, LinearRule())
    """
    if not (isinstance(module_type, type) and issubclass(module_type, nn.Module)):
        raise TypeError(f"module_type must be an nn.Module subclass, got {module_type!r}")
    if not isinstance(rule, FisherRule):
        raise TypeError(f"rule must be a FisherRule, got {type(rule).__name__}")
    _RULES[module_type] = rule


# nn.MultiheadAttention's out_proj: a Linear whose weight the attention reads directly,
# never calling the module, so its hooks would never fire and its factors never refresh
_NEVER_CALLED = getattr(nn.modules.linear, "NonDynamicallyQuantizableLinear", None)


def rule_for(module: nn.Module) -> FisherRule | None:
    """The rule for ``module``'s class or its nearest registered base, else ``None``.

    ``nn.MultiheadAttention``'s ``out_proj`` gets ``None``: the attention uses its
    weight without calling it, so no statistic can be taken there.
    """
    if _NEVER_CALLED is not None and type(module) is _NEVER_CALLED:
        return None
    for cls in type(module).__mro__:
        if cls in _RULES:
            return _RULES[cls]
    # transformers' Conv1D, recognised without importing transformers
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):
        return _HF_CONV1D
    return None
