"""Convolutions: ``nn.Conv1d`` / ``nn.Conv2d`` / ``nn.Conv3d`` (and subclasses such as
timm's ``Conv2dSame``), without ever forming the unfold."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hf_triaccel.curvature.rules.base import FisherRule, out_in_layout, per_entry_layout
from hf_triaccel.curvature.rules.batching import gather_or_mm, then
from hf_triaccel.curvature.rules.finish import Mean
from hf_triaccel.curvature.rules.plans import RowsPlan, ViewOf, as_view, channel_reduce, remember
from hf_triaccel.curvature.rules.reductions import Reducer, reducer
from hf_triaccel.curvature.rules.thirdparty import pads_same_dynamically
from hf_triaccel.dispatch import resolve_impl

# Largest tap-by-position selector formed as one matrix (4 MiB of float32: a 3x3 kernel
# over 224x224 inputs takes 1.7 MiB); past it the taps are gathered one spatial dim at a
# time, in a few more operations.
MAX_SELECTOR_ELEMENTS = 1 << 20

Geometry = tuple[int, int, int, int, int, int]


def conv_geometry(module: nn.Module, spatial: tuple[int, ...]) -> list[Geometry]:
    """Per spatial dim: (input size, kernel, stride, dilation, left pad, output size).

    Example:
        >>> conv_geometry(nn.Conv2d(1, 1, 3, stride=2, padding=1), (5, 4))
        [(5, 3, 2, 1, 1, 3), (4, 3, 2, 1, 1, 2)]
    """
    dims = []
    for i, n in enumerate(spatial):
        k, s, d = module.kernel_size[i], module.stride[i], module.dilation[i]
        if module.padding_mode != "zeros":  # padded before the statistic (see ConvPlan)
            left = right = 0
        elif module.padding == "same":
            total = d * (k - 1)
            left, right = total // 2, total - total // 2
        elif module.padding == "valid":
            left = right = 0
        else:
            left = right = module.padding[i]
        out = (n + left + right - d * (k - 1) - 1) // s + 1
        dims.append((n, k, s, d, left, out))
    return dims


def window_selector(
    n: int, k: int, s: int, d: int, left: int, out: int, device: torch.device
) -> torch.Tensor:
    """(k, n) 0/1 matrix: entry [p, h] says input position h sits at kernel tap p of some
    window.

    Example:
        >>> window_selector(4, 3, 1, 1, 1, 4, torch.device("cpu"))  # 3 taps, padding 1
        tensor([[1., 1., 1., 0.],
                [1., 1., 1., 1.],
                [0., 1., 1., 1.]])
    """
    taps = torch.arange(k, device=device).unsqueeze(1)
    starts = torch.arange(out, device=device).unsqueeze(0) * s - left
    pos = starts + taps * d  # (k, out): the input position each tap of each window reads
    sel = torch.zeros(k, n + 1, device=device, dtype=torch.float32)
    valid = (pos >= 0) & (pos < n)
    # padded positions read zeros: send them to a scratch column that is dropped
    sel.scatter_add_(1, torch.where(valid, pos, n), torch.ones_like(pos, dtype=sel.dtype))
    return sel[:, :n]


@functools.lru_cache(maxsize=64)
def tap_selector(geometry: tuple[Geometry, ...], device: torch.device) -> torch.Tensor:
    """(positions, taps) 0/1 matrix: the Kronecker product of the per-dim window
    selectors, transposed, so that one matrix product gathers every tap of a per-position
    sum.

    Cached because it is large and the same for every layer of one geometry (the blocks
    of a stage): the layers' plans share one copy. Callers must not modify it.
    """
    selectors = [window_selector(*g, device=device) for g in geometry]
    return functools.reduce(torch.kron, selectors).t()


def tf_same_pads(spatial: tuple[int, ...], module: nn.Module) -> list[int]:
    """The TensorFlow 'SAME' zero padding of modules that pad inside their forward (extra
    pixel right/bottom), in ``F.pad`` order.

    Example:
        >>> tf_same_pads((5, 6), nn.Conv2d(1, 1, 3, stride=2))
        [0, 1, 1, 1]
    """
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
class ConvPlan:
    """Everything the activation statistic of a conv needs for one input shape and layout.

    The input (padded first when the module pads inside its forward) is viewed as rows
    of one sample (and group) each; their column sums of x^2 land in ``per_position`` in
    (channel, position) order, or (position, channel) for a channels-last input; one
    matrix product with the tap selector then writes the sums in weight-flattening order
    (C_in/groups, *kernel). ``count`` is the number of rows of the unfold, B L.
    """

    reduce: Reducer  # the per-position sums of x^2 of a (padded) input into per_position
    count: float
    pad: list[int] | None  # F.pad amounts, applied before the reduction
    pad_mode: str
    unsqueeze: bool  # an unbatched input that must be padded as a batch of one
    per_position: torch.Tensor
    by_group: torch.Tensor | None  # channels-last with groups: (positions, groups, C/groups)
    group_sum: torch.Tensor | None  # ... and its sum over the groups
    by_channel: torch.Tensor  # the per-position sums as (C/groups, positions)
    taps: torch.Tensor | None  # (positions, taps) selector; None: gathered per dim
    selectors: list[torch.Tensor] | None  # per-dim window selectors, when taps is None
    spatial: tuple[int, ...]
    head: ViewOf
    grouped: bool  # a gather the Triton statistics batch may launch with others


def conv_plan(module: nn.Module, x: torch.Tensor, impl: str | None) -> ConvPlan | RowsPlan:
    """The plan of ``module``'s activation statistic for inputs shaped and laid out as
    ``x``: a :class:`ConvPlan`, or for a pointwise conv (1x1 kernel, stride 1, no padding,
    one group), whose unfold is the input itself, the per-channel sums of x^2 straight
    into the statistic."""
    nd = len(module.kernel_size)
    unbatched = x.dim() == nd + 1
    shape = (1, *x.shape) if unbatched else tuple(x.shape)
    spatial = shape[2:]
    pad, pad_mode = None, "constant"
    if pads_same_dynamically(module):
        pad = tf_same_pads(spatial, module)
    elif module.padding_mode != "zeros":
        # torch's own F.pad amounts for the padding modes other than zeros
        pad, pad_mode = list(module._reversed_padding_repeated_twice), module.padding_mode
    if pad is not None:
        # F.pad lists the last dim first
        spatial = tuple(n + pad[2 * i] + pad[2 * i + 1] for i, n in enumerate(reversed(spatial)))
        spatial = spatial[::-1]
    geometry = tuple(conv_geometry(module, spatial))
    b, c = shape[:2]
    groups = module.groups
    c_group = c // groups
    positions = math.prod(spatial)
    rows = b * math.prod(g[-1] for g in geometry)
    if pad is None and groups == 1 and all(g[1:3] == (1, 1) and g[4] == 0 for g in geometry):
        view = lambda t: as_view(t, (b, c, positions))  # noqa: E731
        return RowsPlan(reducer(impl, x, view, True), float(rows))
    kernel = math.prod(module.kernel_size)
    patch = c_group * kernel
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
    taps = selectors = None
    if positions * kernel <= MAX_SELECTOR_ELEMENTS:
        taps = tap_selector(geometry, device)
    else:
        selectors = [window_selector(*g, device=device) for g in geometry]
    bias = module.bias is not None
    unsqueeze = unbatched and pad is not None
    if pad is not None:  # the reduction reads the padded copy: work it out on one
        x = F.pad(x.unsqueeze(0) if unsqueeze else x, pad, mode=pad_mode)
    if channels_last:
        view = lambda t: t.permute(0, 2, 3, 1).view(b, -1)  # noqa: E731
    else:
        view = lambda t: as_view(t, (b * groups, c_group * positions))  # noqa: E731
    return ConvPlan(
        reduce=reducer(impl, x, view, True),
        count=float(rows),
        pad=pad,
        pad_mode=pad_mode,
        unsqueeze=unsqueeze,
        per_position=per_position,
        by_group=by_group,
        group_sum=group_sum,
        by_channel=by_channel,
        taps=taps,
        selectors=selectors,
        spatial=spatial,
        head=ViewOf(lambda out: (out[:patch] if bias else out).view(c_group, kernel)),
        grouped=resolve_impl(impl, device) == "triton" and taps is not None and by_group is None,
    )


def gather_taps(plan: ConvPlan, dst: torch.Tensor) -> None:
    """Writes the sums (C_in/groups, taps) from the per-position sums into ``dst``."""
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


class ConvRule(FisherRule):
    """``nn.Conv1d`` / ``nn.Conv2d`` / ``nn.Conv3d``.

    a = sum over batch, output positions and groups of the squared zero-padded patch
    entries, in weight-flattening order (C_in/groups, *kernel), plus the ones column if
    bias, divided by B * L * D (L output positions, D patch length; the published
    scaling). The unfold is never formed: the batch-sum of x^2 is taken once per input
    position (and per group, sharing one reduction), then each kernel tap gathers the
    positions its windows visit through a 0/1 selector, in one matrix product. The hook
    writes these sums; the finish divides by the step's B * L * D and sets the bias entry.
    g = mean over B * L of the squared output gradient, per output channel.

    Example:
        >>> from hf_triaccel.curvature.rules import a_statistic
        >>> conv = nn.Conv1d(1, 1, 2, bias=False)
        >>> a_statistic(ConvRule(), conv, torch.tensor([[[1.0, 2.0, 3.0]]]))  # (1+4, 4+9) / 4
        tensor([1.2500, 3.2500])
    """

    def sizes(self, module):
        d = module.in_channels // module.groups * math.prod(module.kernel_size)
        return d + (module.bias is not None), module.out_channels

    def layouts(self, module):
        d = module.in_channels // module.groups * math.prod(module.kernel_size)
        c_out = module.out_channels
        return {"weight": out_in_layout(c_out, d), "bias": per_entry_layout(c_out, d)}

    def a_finish(self, module):
        # the ones column of the bias, summed over each row's groups: groups / D of the mean
        d = module.in_channels // module.groups * math.prod(module.kernel_size)
        return Mean(scale=1.0 / d, last=module.groups / d if module.bias is not None else None)

    def a_write(self, module, x, out, impl, cache):
        key = ("a", x.shape, x.stride())
        plan = cache.get(key) or remember(cache, key, conv_plan(module, x, impl))
        if isinstance(plan, RowsPlan):
            plan.reduce(x, out)
            return plan.count
        if plan.pad is not None:
            x = F.pad(x.unsqueeze(0) if plan.unsqueeze else x, plan.pad, mode=plan.pad_mode)
        plan.reduce(x, plan.per_position)
        if plan.grouped:
            gather_or_mm(plan.by_channel, plan.taps, plan.head(out))
        else:
            then(gather_taps, plan, plan.head(out))  # after the reduction, if it is queued
        return plan.count

    def input_saved(self, module):
        # a conv that pads its input first keeps the padded copy instead
        padded = module.padding_mode != "zeros" or pads_same_dynamically(module)
        return module.weight.requires_grad and not padded

    def g_write(self, module, grad, out, accumulate, impl, cache):
        unbatched = len(module.kernel_size) + 1
        return channel_reduce(grad, unbatched, out, accumulate, impl, cache, True)
