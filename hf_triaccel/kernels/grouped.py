"""Many column sums in one launch: the statistics of a refresh step in a few kernels.

On a step whose pace the host sets, a statistic's launch costs more host time than its
kernel takes on the device, so the collector queues the reductions of several layers
and launches them together (:func:`launch_grouped`): one kernel per input dtype and
block shape reads every queued input, each with its own geometry, destination, scale,
accumulation and tail, through device tables of data pointers. Each input is split over
programs as its own :class:`~hf_triaccel.kernels.reductions.ReductionLaunch` would split it,
and its partial sums are finished the same way (the program that takes an output
block's last ticket adds the block's rows in a fixed order), so the sums are
reproducible from run to run.

The tables: the geometry of each input and the program-to-work map are worked out once
per sequence of reductions and kept with their tickets; what changes from call to call
(the addresses, the accumulation flag, the scale) is one small host-to-device copy,
skipped when nothing changed, and kept for the few sets of addresses a training loop
takes turns with (a new batch's input, allocated while the last one is alive, lands at
one of two or three addresses).

:func:`launch_gathers` does the same for the convolutions' tap gathers that follow their
reductions: one kernel per selector width computes every queued ``sums @ taps``.
"""

from __future__ import annotations

import functools
import struct
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch
import triton
import triton.language as tl

from hf_triaccel.kernels.launch import compiled_kernel, direct_launch_supported, launch_compiled
from hf_triaccel.kernels.reductions import (
    KEPT_PARTIALS,
    ReductionLaunch,
    rows_geometry,
    slab_sums,
    write_tail,
)

# The grouped kernel's settings, its own (it compiles both loops, sums and sums of
# squares, and reads its tables): the fastest on the grouped launches of a CIFAR
# ResNet-18's and EfficientNet-B0's refresh on an H200 (docs/benchmarks_history.md,
# "The row sums' settings"), where the single kernel's larger tile ran at half their
# speed. A plan is cut with the settings of when it was made (forget_plans).
TILE = 4096
NUM_WARPS = 8
PROGRAMS_PER_SM = 2

# Sequences of reductions whose tables are kept: every flush of a refresh step is one (a
# model of hundreds of layers whose gradients are launched a few at a time has hundreds),
# and building the tables again costs their copies; a model whose layers take turns, or
# inputs whose shapes change, must not pile them up either.
_MAX_PLANS = 1024
# Per sequence, the copies of its per-call values kept (see the module).
TABLES_KEPT = 4
_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
# Per task, the static table holds (int64): rows, columns, row stride, rows per split,
# splits, partials offset, tickets offset, tail length, square, tail value (float64 bits);
# the dynamic table: x address, out address, accumulate, scale (float64 bits).


@triton.jit
def _grouped_rows_kernel(
    dynamic_ptr,
    static_ptr,
    tiles_ptr,
    part_ptr,
    ticket_ptr,
    DTYPE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """Column sums of one (rows of a split, BLOCK_D) slab of one task's input.

    ``tiles`` maps the program to (task, column block, split). A task's input is
    (n_rows, n_cols) with unit column stride; its sums (of squares when the task says
    so) are scaled and written into, or added to, its float32 output; with a tail, the
    program that writes column block 0 also writes the zeros and the value after them.
    Split tasks write their partials at the task's offset of ``part`` and finish with
    the task's tickets, as ``_epilogue`` does.
    """
    tile = tiles_ptr + tl.program_id(0) * 3
    task = tl.load(tile)
    block = tl.load(tile + 1)
    split = tl.load(tile + 2)
    dyn = dynamic_ptr + task * 4
    x_ptr = tl.load(dyn).to(tl.pointer_type(DTYPE))
    out_ptr = tl.load(dyn + 1).to(tl.pointer_type(tl.float32))
    accumulate = tl.load(dyn + 2) != 0
    scale = tl.load(dyn + 3).to(tl.float64, bitcast=True).to(tl.float32)
    sta = static_ptr + task * 10
    n_rows = tl.load(sta)
    n_cols = tl.load(sta + 1)
    stride_row = tl.load(sta + 2)
    rows_per_split = tl.load(sta + 3)
    n_splits = tl.load(sta + 4)
    part = part_ptr + tl.load(sta + 5)
    tickets = ticket_ptr + tl.load(sta + 6)
    tail_len = tl.load(sta + 7)
    square = tl.load(sta + 8) != 0
    tail_value = tl.load(sta + 9).to(tl.float64, bitcast=True).to(tl.float32)

    cols = block * BLOCK_D + tl.arange(0, BLOCK_D)  # (BLOCK_D,)
    col_mask = cols < n_cols
    row_start = split * rows_per_split
    row_end = tl.minimum(row_start + rows_per_split, n_rows)
    if square:  # both bodies compiled, one run
        total = slab_sums(
            x_ptr, cols, col_mask, row_start, row_end, stride_row, True, BLOCK_N, BLOCK_D
        )
    else:
        total = slab_sums(
            x_ptr, cols, col_mask, row_start, row_end, stride_row, False, BLOCK_N, BLOCK_D
        )

    finish = n_splits == 1
    if n_splits > 1:
        tl.store(part + split * n_cols + cols, total, mask=col_mask)
        tl.debug_barrier()  # every thread's partials stored before the ticket is taken
        ticket = tl.atomic_add(tickets + block, 1, sem="acq_rel")
        finish = ticket == n_splits - 1
        if finish:
            sums = tl.zeros((BLOCK_S, BLOCK_D), dtype=tl.float32)
            for s in range(0, n_splits, BLOCK_S):
                splits = s + tl.arange(0, BLOCK_S)  # (BLOCK_S,)
                ptrs = part + splits[:, None] * n_cols + cols[None, :]
                both = (splits < n_splits)[:, None] & col_mask[None, :]
                # past L1: other programs wrote these rows from other multiprocessors
                sums += tl.load(ptrs, mask=both, other=0.0, cache_modifier=".cg")
            total = tl.sum(sums, axis=0)
            tl.store(tickets + block, 0)
    if finish:
        total = total * scale
        total += tl.load(out_ptr + cols, mask=col_mask & accumulate, other=0.0)
        tl.store(out_ptr + cols, total, mask=col_mask)
        if (tail_len > 0) & (block == 0):
            write_tail(out_ptr, n_cols, tail_len, tail_value)


@triton.jit
def _grouped_gather_kernel(
    table_ptr,
    tiles_ptr,
    BLOCK_C: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """``out = sums @ taps`` for one block of channels of one task: a convolution's
    per-position sums (C, P), read through their strides, gathered by its 0/1 tap
    selector (P, K) into its (C, K) float32 output.

    ``tiles`` maps the program to (task, channel block); ``table`` holds per task (int64)
    the addresses of the sums, the selector and the output, the sums' channel and position
    strides, the selector's position and tap strides, C, P and K.
    """
    tile = tiles_ptr + tl.program_id(0) * 2
    task = tl.load(tile)
    block = tl.load(tile + 1)
    row = table_ptr + task * 10
    sums_ptr = tl.load(row).to(tl.pointer_type(tl.float32))
    taps_ptr = tl.load(row + 1).to(tl.pointer_type(tl.float32))
    out_ptr = tl.load(row + 2).to(tl.pointer_type(tl.float32))
    stride_c = tl.load(row + 3)
    stride_p = tl.load(row + 4)
    stride_tp = tl.load(row + 5)
    stride_tk = tl.load(row + 6)
    n_c = tl.load(row + 7)
    n_p = tl.load(row + 8)
    n_k = tl.load(row + 9)
    chans = block * BLOCK_C + tl.arange(0, BLOCK_C)  # (BLOCK_C,)
    taps = tl.arange(0, BLOCK_K)  # (BLOCK_K,)
    acc = tl.zeros((BLOCK_C, BLOCK_K), dtype=tl.float32)
    for p in range(0, n_p, BLOCK_P):
        pos = p + tl.arange(0, BLOCK_P)  # (BLOCK_P,)
        s_mask = (chans < n_c)[:, None] & (pos < n_p)[None, :]  # (BLOCK_C, BLOCK_P)
        s_ptrs = sums_ptr + chans[:, None] * stride_c + pos[None, :] * stride_p
        s = tl.load(s_ptrs, mask=s_mask, other=0.0)
        t_mask = (pos < n_p)[:, None] & (taps < n_k)[None, :]  # (BLOCK_P, BLOCK_K)
        t_ptrs = taps_ptr + pos[:, None] * stride_tp + taps[None, :] * stride_tk
        t = tl.load(t_ptrs, mask=t_mask, other=0.0)
        acc += tl.dot(s, t, input_precision="ieee")  # float32 products, as torch.mm's
    o_mask = (chans < n_c)[:, None] & (taps < n_k)[None, :]
    tl.store(out_ptr + chans[:, None] * n_k + taps[None, :], acc, mask=o_mask)


_GATHER_BLOCK_C = 32
_GATHER_BLOCK_P = 32


def gather_key(taps: torch.Tensor) -> int:
    """Which grouped gather takes a tap selector of ``taps.shape[1]`` taps: its
    power-of-two width (16 at least, as the kernel's matrix product needs)."""
    return max(16, 1 << (taps.shape[1] - 1).bit_length())


def launch_gathers(
    block_k: int, entries: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
) -> None:
    """``torch.mm(sums, taps, out=out)`` for every entry (sums, taps, out), all of
    :func:`gather_key` ``block_k``, as one kernel. ``sums`` is a float32 (C, P) view,
    ``taps`` a float32 (P, K) selector (both read through their strides), ``out`` a
    contiguous float32 (C, K) tensor that no entry reads."""
    gathers(block_k, entries)()


def gathers(
    block_k: int, entries: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
) -> Callable[[], None]:
    """:func:`launch_gathers` of ``entries`` as a launch to call, again and again: its
    tables hold the entries' addresses, so the tensors must stay where they are."""
    device = entries[0][0].device
    table = []
    for sums, taps, out in entries:
        table += (sums.data_ptr(), taps.data_ptr(), out.data_ptr(), *sums.stride())
        table += (*taps.stride(), *sums.shape, taps.shape[1])
    key = ("gather", device, tuple(table))
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.popitem(last=False)
        tiles = [
            (task, b)
            for task, (sums, _, _) in enumerate(entries)
            for b in range(-(-sums.shape[0] // _GATHER_BLOCK_C))
        ]
        # the addresses are the key: the tables hold nothing that changes
        plan = _PLANS[key] = _Launch(
            _grouped_gather_kernel,
            (len(tiles),),
            dict(
                table_ptr=_to_device(table, torch.int64, device),
                tiles_ptr=_to_device(tiles, torch.int32, device),
                BLOCK_C=_GATHER_BLOCK_C,
                BLOCK_P=_GATHER_BLOCK_P,
                BLOCK_K=block_k,
            ),
            num_warps=4,
            device=device,
        )
    return plan


class _Launch:
    """One kernel's launch with fixed arguments, the compiled kernel launched directly
    after the first time (:func:`~hf_triaccel.kernels.launch.launch_compiled`), so that a
    grouped launch costs one launch's host time, not Triton's binding of its arguments.

    ``args`` are every argument of the kernel by name, constexprs included; a call may
    replace the tensors among them (their addresses keep the 16-byte alignment that every
    PyTorch allocation has, which is what the compiled kernel was specialised on).
    """

    __slots__ = ("kernel", "grid", "args", "num_warps", "direct", "compiled", "template", "at")

    def __init__(
        self, kernel, grid: tuple[int, ...], args: dict, num_warps: int, device: torch.device
    ) -> None:
        self.kernel = kernel
        self.grid = grid
        self.args = args  # holds the tensors the template has the addresses of
        self.num_warps = num_warps
        self.direct = direct_launch_supported(device)
        self.compiled = None
        # every argument in order, tensors as their addresses, for direct launches
        self.template = [_address(args.get(n)) for n in kernel.arg_names]
        self.at = {name: i for i, name in enumerate(kernel.arg_names)}

    def __call__(self, **changed: torch.Tensor) -> None:
        if self.compiled is not None:
            args = self.template.copy()
            at = self.at
            for name, tensor in changed.items():
                args[at[name]] = tensor.data_ptr()
            launch_compiled(self.compiled, self.grid, args)
            return
        args = {**self.args, **changed} if changed else self.args
        handle = self.kernel[self.grid](**args, num_warps=self.num_warps)
        if self.direct:
            self.compiled = compiled_kernel(handle)


def _address(value: Any) -> Any:
    """A tensor's address (how direct launches pass pointers), anything else as it is."""
    return value.data_ptr() if isinstance(value, torch.Tensor) else value


@functools.lru_cache(maxsize=64)
def _bits(value: float) -> int:
    """The float64 bits of ``value`` as an int64 (how the tables carry floats)."""
    return struct.unpack("<q", struct.pack("<d", value))[0]


def group_key(launch: ReductionLaunch, x: torch.Tensor) -> tuple | None:
    """Which grouped kernel can take ``launch`` on input ``x``: ``(dtype, BLOCK_N,
    BLOCK_D)``, or ``None`` when none can (a channel reduction, an input dtype the
    kernel does not read)."""
    if launch.rows is None or x.dtype not in _DTYPES:
        return None
    geometry = launch.group
    if geometry is None:
        n_rows, n_cols = launch.rows[:2]
        geometry = rows_geometry(n_rows, n_cols, x.device, TILE, PROGRAMS_PER_SM)
        launch.group = geometry
    return (x.dtype, geometry[0], geometry[1])


class _GroupPlan:
    """The device tables of one sequence of reductions of one group key, and its launch."""

    __slots__ = ("launches", "launch", "part_len", "part", "last", "dynamic", "tables")

    def __init__(
        self, key: tuple, launches: Sequence[ReductionLaunch], device: torch.device
    ) -> None:
        # kept alive, so that the ids of the plan's key stay theirs
        self.launches = tuple(launches)
        static, tiles = [], []
        part = ticket = 0
        for task, launch in enumerate(launches):
            n_rows, n_cols, stride_row, square, tail = launch.rows
            _, _, col_blocks, rows_per_split, splits = launch.group  # set by group_key
            tail_len, tail_value = tail if tail is not None else (0, 0.0)
            static.append(
                (n_rows, n_cols, stride_row, rows_per_split, splits, part, ticket,
                 tail_len, int(square), _bits(float(tail_value)))
            )  # fmt: skip
            tiles += [(task, b, s) for b in range(col_blocks) for s in range(splits)]
            if splits > 1:
                part += splits * n_cols
                ticket += col_blocks
        dtype, block_n, block_d = key
        self.part_len = max(part, 1)
        # the partial sums, kept when small (the launches of a sequence run in order)
        self.part = None
        if self.part_len <= KEPT_PARTIALS:
            self.part = torch.empty(self.part_len, dtype=torch.float32, device=device)
        self.last: list[int] | None = None
        self.dynamic: torch.Tensor | None = None
        self.tables: OrderedDict[tuple[int, ...], torch.Tensor] = OrderedDict()
        self.launch = _Launch(
            _grouped_rows_kernel,
            (len(tiles),),
            dict(
                dynamic_ptr=None,
                static_ptr=_to_device(static, torch.int64, device),
                tiles_ptr=_to_device(tiles, torch.int32, device),
                part_ptr=None,
                ticket_ptr=torch.zeros(max(ticket, 1), dtype=torch.int32, device=device),
                DTYPE=_DTYPES[dtype],
                BLOCK_N=block_n,
                BLOCK_D=block_d,
                BLOCK_S=max(1, TILE // block_d),
            ),
            num_warps=NUM_WARPS,
            device=device,
        )


def _to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a tensor on ``device``, copied without waiting for the device (from
    pinned memory: a copy from pageable memory may wait for the work queued before it)."""
    host = torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)


# row-sum plans, and the gathers' launches, keyed by their table
_PLANS: OrderedDict[tuple, _GroupPlan | _Launch] = OrderedDict()


def forget_plans() -> None:
    """Drops every plan kept (their tables and tickets), so that the next launches are cut
    again: after the settings changed (a tuning run)."""
    _PLANS.clear()


def launch_grouped(
    key: tuple,
    entries: Sequence[tuple[ReductionLaunch, torch.Tensor, torch.Tensor, float, bool]],
) -> None:
    """Launches ``entries`` (launch, x, out, scale, accumulate), all of group ``key``
    (:func:`group_key`), as one kernel: the same sums as calling each launch.

    The outputs must be distinct tensors that no entry reads as an input; each ``x``
    must be laid out as its launch expects. Launches of one sequence share tickets, so
    they must run in order (one stream), as a :class:`ReductionLaunch`'s do.
    """
    device = entries[0][1].device
    dynamic = []
    for _, x, out, scale, accumulate in entries:
        dynamic += (x.data_ptr(), out.data_ptr(), int(accumulate), _bits(float(scale)))
    _run(_group_plan(key, [e[0] for e in entries], device), dynamic, device)


def _group_plan(
    key: tuple, launches: Sequence[ReductionLaunch], device: torch.device
) -> _GroupPlan:
    """The kept plan of ``launches`` (made on first use)."""
    plan_key = (key, device, tuple([id(launch) for launch in launches]))
    plan = _PLANS.get(plan_key)
    if plan is None:
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.popitem(last=False)
        plan = _PLANS[plan_key] = _GroupPlan(key, launches, device)
    return plan


def _run(plan: _GroupPlan, dynamic: list[int], device: torch.device) -> None:
    """Launches ``plan`` with the per-task values ``dynamic`` (copied to the device only
    when they differ from the last launch's and from every copy kept)."""
    if dynamic != plan.last:
        key = tuple(dynamic)
        table = plan.tables.pop(key, None)
        if table is None:
            table = _to_device(dynamic, torch.int64, device)
            if len(plan.tables) >= TABLES_KEPT:
                plan.tables.popitem(last=False)
        plan.tables[key] = table  # the most recently used last
        plan.dynamic = table
        plan.last = dynamic
    part = plan.part
    if part is None:  # large: allocated per launch
        part = torch.empty(plan.part_len, dtype=torch.float32, device=device)
    plan.launch(dynamic_ptr=plan.dynamic, part_ptr=part)
