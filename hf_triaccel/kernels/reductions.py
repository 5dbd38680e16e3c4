"""Triton kernels for the Fisher statistics' sums: column sums and channel sums.

The two reductions read their input once in its own dtype (float32, bfloat16 or
float16) and accumulate in float32. Work is split over rows as well as columns so that
both tall-skinny inputs (Linear: 512K rows, hundreds of columns) and short-wide ones
(conv inputs reduced over a batch of 512, tens of thousands of columns) fill the GPU.
Each split writes its own row of a float32 partials buffer; the program that finishes
an output block last (one atomic ticket per block) adds the block's rows in a fixed
order, so results are bitwise reproducible from run to run. Whichever program produces
the totals also applies the caller's epilogue (scale, write or add into a given
buffer). A :class:`ReductionLaunch`, worked out once per input geometry and kept with
its workspace, makes a Fisher statistic's sums one kernel launch and nothing else
(launched directly after the first time: :mod:`hf_triaccel.kernels.launch`).

The fold of the statistics into the factors is :mod:`hf_triaccel.kernels.fold`; many of
these sums in one launch, :mod:`hf_triaccel.kernels.grouped`.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from hf_triaccel._types import check_statistic_out
from hf_triaccel.kernels.launch import compiled_kernel, direct_launch_supported, launch_compiled

# The row sums' settings, picked on an H200 by a sweep over the row
# sums of a CIFAR ResNet-18's and EfficientNet-B0's refresh (bf16, 4 to 98K columns, 512
# to 524K rows): elements in one loaded tile (128 per thread: many loads in flight from
# few programs), warps per program, and programs a split launch aims for per
# streaming multiprocessor.
TILE = 16384
NUM_WARPS = 4
PROGRAMS_PER_SM = 2
# The channel kernel (inputs laid out (B, C, L)) keeps the settings it was tuned with.
_CHANNEL_TILE = 4096
_CHANNEL_NUM_WARPS = 8
_CHANNEL_PROGRAMS_PER_SM = 4
# Widest column block of the row-sum kernel and longest position block of the channel
# kernel; narrow column blocks give short-wide inputs enough programs without a split.
_MAX_BLOCK_D = 128
_MAX_BLOCK_L = 512
# a split launch keeps partial sums up to this many floats (64 KiB) from launch to launch
KEPT_PARTIALS = 16384
# Under the CPU interpreter every program costs Python time; a handful still exercises
# the split-and-finish path.
_INTERPRETED_PROGRAMS = 8


@triton.jit
def _store_result(out_ptr, offs, mask, total, scale, ACCUMULATE: tl.constexpr):
    """``out[offs] (+)= scale * total``, masked."""
    total = total * scale
    if ACCUMULATE:
        total += tl.load(out_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, total, mask=mask)


@triton.jit
def _load_term(ptrs, mask, SQUARE: tl.constexpr):
    """The masked tile at ``ptrs`` in float32 (0 where masked), squared when ``SQUARE``."""
    v = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    if SQUARE:
        v = v * v
    return v


@triton.jit
def write_tail(out_ptr, start, tail_len, tail_value):
    """``out[start : start + tail_len]``: zeros, then ``tail_value`` in its last entry.

    Its own block width: a norm layer's tail runs to thousands of entries, and the
    reduction's output blocks can be 8 wide.
    """
    for s in range(0, tail_len, 1024):
        offs = s + tl.arange(0, 1024)  # (1024,)
        values = tl.where(offs == tail_len - 1, tail_value, 0.0)
        tl.store(out_ptr + start + offs, values, mask=offs < tail_len)


@triton.jit
def _epilogue(
    out_ptr,
    part_ptr,
    ticket_ptr,
    offs,
    mask,
    total,
    block,
    split,
    n_splits,
    n,
    scale,
    tail_len,
    tail_value,
    SPLIT: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    TAIL: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """A program's sums ``total`` of output block ``block`` (entries ``offs`` of n).

    Unsplit, they are the totals: through the result epilogue into ``out``. Split, they
    go to row ``split`` of the (n_splits, n) float32 partials ``part``, and the program
    that takes the block's last ticket adds the block's rows in a fixed order (so the
    totals do not depend on which program finishes last), writes the totals through the
    epilogue and resets the ticket for the next launch. With ``TAIL``, whoever writes
    block 0's totals also writes ``out[n : n + tail_len]`` (:func:`write_tail`).
    """
    if SPLIT:
        tl.store(part_ptr + split * n + offs, total, mask=mask)
        tl.debug_barrier()  # every thread's partials stored before the ticket is taken
        ticket = tl.atomic_add(ticket_ptr + block, 1, sem="acq_rel")
        if ticket == n_splits - 1:
            acc = tl.zeros((BLOCK_S, BLOCK), dtype=tl.float32)
            for s in range(0, n_splits, BLOCK_S):
                splits = s + tl.arange(0, BLOCK_S)  # (BLOCK_S,)
                tile = (splits < n_splits)[:, None] & mask[None, :]  # (BLOCK_S, BLOCK)
                ptrs = part_ptr + splits[:, None] * n + offs[None, :]
                # past L1: other programs wrote these rows from other multiprocessors
                acc += tl.load(ptrs, mask=tile, other=0.0, cache_modifier=".cg")
            _store_result(out_ptr, offs, mask, tl.sum(acc, axis=0), scale, ACCUMULATE)
            tl.store(ticket_ptr + block, 0)
            if TAIL:  # noqa: SIM102 (a constexpr test, then a run-time one)
                if block == 0:
                    write_tail(out_ptr, n, tail_len, tail_value)
    else:
        _store_result(out_ptr, offs, mask, total, scale, ACCUMULATE)
        if TAIL:  # noqa: SIM102 (a constexpr test, then a run-time one)
            if block == 0:
                write_tail(out_ptr, n, tail_len, tail_value)


@triton.jit
def slab_sums(
    x_ptr,
    cols,
    col_mask,
    row_start,
    row_end,
    stride_row,
    SQUARE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Float32 sums over rows ``row_start:row_end`` of ``x`` (unit column stride) at the
    columns ``cols``, of squares when ``SQUARE``: the body of every row-sum kernel."""
    # A 2-D accumulator keeps the loop free of cross-thread reductions; one at the end.
    acc = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    for r in range(row_start, row_end, BLOCK_N):
        rows = r + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
        mask = (rows < row_end)[:, None] & col_mask[None, :]  # (BLOCK_N, BLOCK_D)
        # int64 row offsets: N * stride can pass 2^31 elements.
        ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_row + cols[None, :]
        acc += _load_term(ptrs, mask, SQUARE)
    return tl.sum(acc, axis=0)


@triton.jit
def _sum_rows_kernel(
    x_ptr,
    out_ptr,
    part_ptr,
    ticket_ptr,
    n_rows,
    n_cols,
    stride_row,
    rows_per_split,
    n_splits,
    scale,
    tail_len,
    tail_value,
    SQUARE: tl.constexpr,
    SPLIT: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    TAIL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """Column sums of one (rows_per_split, BLOCK_D) slab of ``x`` (n_rows, n_cols) with
    unit column stride, finished by :func:`_epilogue`.

    Grid: (column blocks, splits).
    """
    pid_d = tl.program_id(0)
    pid_s = tl.program_id(1)
    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)  # (BLOCK_D,)
    col_mask = cols < n_cols
    row_start = pid_s * rows_per_split
    row_end = tl.minimum(row_start + rows_per_split, n_rows)
    total = slab_sums(
        x_ptr, cols, col_mask, row_start, row_end, stride_row, SQUARE, BLOCK_N, BLOCK_D
    )
    _epilogue(
        out_ptr, part_ptr, ticket_ptr, cols, col_mask, total, pid_d, pid_s, n_splits,
        n_cols, scale, tail_len, tail_value, SPLIT, ACCUMULATE, TAIL, BLOCK_D, BLOCK_S,
    )  # fmt: skip


@triton.jit
def _channel_sum_kernel(
    x_ptr,
    out_ptr,
    part_ptr,
    ticket_ptr,
    n_chan,
    n_pos,
    stride_b,
    stride_c,
    n_pos_blocks,
    items_per_split,
    n_items,
    n_splits,
    scale,
    tail_len,
    tail_value,
    SQUARE: tl.constexpr,
    SPLIT: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    TAIL: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """Per-channel sums of ``x`` (B, C, L) with unit stride along L over one split's work
    items, finished by :func:`_epilogue`.

    Grid: (channel blocks, splits). A work item is one (batch, position block) pair,
    numbered ``b * n_pos_blocks + l_block``; each split takes a contiguous run of items
    so that both a large batch and long rows can be spread over many programs.
    """
    pid_c = tl.program_id(0)
    pid_s = tl.program_id(1)
    chans = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)  # (BLOCK_C,)
    chan_mask = chans < n_chan
    chan_off = chans.to(tl.int64) * stride_c  # (BLOCK_C,)
    item_start = pid_s * items_per_split
    item_end = tl.minimum(item_start + items_per_split, n_items)
    acc = tl.zeros((BLOCK_C, BLOCK_L), dtype=tl.float32)
    for t in range(item_start, item_end):
        b = t // n_pos_blocks
        pos = (t - b * n_pos_blocks) * BLOCK_L + tl.arange(0, BLOCK_L)  # (BLOCK_L,)
        mask = chan_mask[:, None] & (pos < n_pos)[None, :]  # (BLOCK_C, BLOCK_L)
        ptrs = x_ptr + b.to(tl.int64) * stride_b + chan_off[:, None] + pos[None, :]
        acc += _load_term(ptrs, mask, SQUARE)
    total = tl.sum(acc, axis=1)
    _epilogue(
        out_ptr, part_ptr, ticket_ptr, chans, chan_mask, total, pid_c, pid_s, n_splits,
        n_chan, scale, tail_len, tail_value, SPLIT, ACCUMULATE, TAIL, BLOCK_C, BLOCK_S,
    )  # fmt: skip


def _cdiv(a: int, b: int) -> int:
    """Ceiling division (plain Python: Triton's helper is slow to call from the host)."""
    return -(-a // b)


def _pow2(n: int) -> int:
    """Smallest power of two >= ``n`` (for ``n >= 1``)."""
    return 1 << (n - 1).bit_length()


@functools.cache
def _sm_count(device: torch.device) -> int:
    """Number of streaming multiprocessors of a CUDA device (cached per device)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def _target_programs(device: torch.device, programs_per_sm: int) -> int:
    """How many programs a reduction should launch to keep ``device`` busy."""
    if device.type != "cuda":
        return _INTERPRETED_PROGRAMS
    return programs_per_sm * _sm_count(device)


def _split(
    n_units: int, n_blocks: int, device: torch.device, programs_per_sm: int
) -> tuple[int, int]:
    """Splits ``n_units`` of sequential work so ``n_blocks * splits`` nears the target.

    No split when the blocks alone give half the target: adding the partials would then
    cost more than the extra parallelism gains.

    Returns:
        (units per split, number of splits), every split non-empty.
    """
    target = _target_programs(device, programs_per_sm)
    if 2 * n_blocks >= target:
        return n_units, 1
    per_split = _cdiv(n_units, min(_cdiv(target, n_blocks), n_units))
    return per_split, _cdiv(n_units, per_split)


class ReductionLaunch:
    """One reduction worked out for one input geometry: its kernel, grid and size
    arguments, and, when the work is split over programs, one ticket per output block
    that every later launch reuses.

    Calling it with a tensor of that geometry (the one whose strides it was made from, or
    any tensor starting at the same element of a storage laid out alike) is one kernel
    launch and nothing else: no view or check, and no allocation but the partial sums of
    a split launch over :data:`KEPT_PARTIALS` floats, which go back to PyTorch's caching
    allocator as soon as it is queued (kept, the partials of every layer's statistics
    would add up to tens of MB). Launches of one object must run in order (one stream),
    as they share the tickets and the partials kept.

    A statistic's launch costs Triton's argument binding and specialisation more host
    time than the kernel takes on the device, so after the first launch of each variant
    (accumulating or not, the input's dtype, both pointers' 16-byte alignment: what the
    compiled code was specialised on) the compiled kernel is launched directly, with the
    arguments Triton would pass it.

    With ``tail=(length, value)``, the launch also writes ``out[n : n + length]``: zeros,
    then ``value`` last (where a normalisation layer's sums keep their size entry).
    ``tile`` is the elements its kernel loads at a time, which the program finishing a
    split sum loads too.
    """

    __slots__ = (
        "kernel", "grid", "kwargs", "rows", "group", "part", "tickets", "compiled",
        "template", "at",
    )  # fmt: skip

    def __init__(self, kernel, grid, sizes, meta, splits, n, device, tail, tile):
        self.kernel = kernel
        self.grid = grid
        block = meta[_BLOCK_KEY[kernel]]
        self.kwargs = dict(
            sizes,
            n_splits=splits,
            tail_len=0 if tail is None else int(tail[0]),
            tail_value=0.0 if tail is None else float(tail[1]),
            SPLIT=splits > 1,
            TAIL=tail is not None,
            BLOCK_S=min(_pow2(splits), max(1, tile // block)),
            **meta,
        )
        # a row sum's (rows, columns, row stride, square, tail), which the grouped launches
        # read; None for a channel sum
        self.rows: tuple[int, int, int, bool, tuple[int, float] | None] | None = None
        if kernel is _sum_rows_kernel:
            kw = self.kwargs
            tail = (kw["tail_len"], kw["tail_value"]) if kw["TAIL"] else None
            self.rows = kw["n_rows"], kw["n_cols"], kw["stride_row"], kw["SQUARE"], tail
        # how the grouped kernel cuts this row sum: worked out by kernels.grouped on first use
        self.group: tuple[int, int, int, int, int] | None = None
        # a split launch's partials: kept when small (launches of one object run in order,
        # as for the tickets), else allocated per launch from their shape kept here;
        # unsplit, the kernel never touches partials or tickets: one entry each stands in
        self.part: torch.Tensor | tuple[int] = torch.empty(1, device=device)
        if splits > 1:
            size = splits * n
            self.part = torch.empty(size, device=device) if size <= KEPT_PARTIALS else (size,)
        self.tickets = torch.zeros(grid[0] if splits > 1 else 1, dtype=torch.int32, device=device)
        self.compiled: dict[tuple, object] = {}
        self.template: list | None = None  # every argument in order, for direct launches
        if direct_launch_supported(device):
            # the tickets' address: they live as long as this launch
            values = {"ticket_ptr": self.tickets.data_ptr(), **self.kwargs}
            self.template = [values.get(name) for name in kernel.arg_names]
            self.at = (kernel.arg_names.index("scale"), kernel.arg_names.index("ACCUMULATE"))

    def __call__(
        self, x: torch.Tensor, out: torch.Tensor, scale: float = 1.0, accumulate: bool = False
    ) -> None:
        scale = float(scale)  # an int 1 would be specialised as a constant
        part = self.part
        if not isinstance(part, torch.Tensor):
            part = torch.empty(part, device=out.device)
        if self.template is not None:
            key = (accumulate, x.dtype, x.data_ptr() % 16 == 0, out.data_ptr() % 16 == 0)
            compiled = self.compiled.get(key)
            if compiled is not None:
                self._direct(compiled, x, out, part, scale, accumulate)
                return
        compiled = self.kernel[self.grid](
            x,
            out,
            part,
            self.tickets,
            scale=scale,
            ACCUMULATE=accumulate,
            **self.kwargs,
        )
        if self.template is not None:
            self.compiled[key] = compiled_kernel(compiled)

    def _direct(self, compiled, x, out, part, scale, accumulate) -> None:
        """Launches ``compiled`` with this call's arguments (:func:`launch_compiled`)."""
        args = self.template.copy()
        at_scale, at_accumulate = self.at
        args[0], args[1], args[2] = x.data_ptr(), out.data_ptr(), part.data_ptr()
        args[at_scale], args[at_accumulate] = scale, accumulate
        launch_compiled(compiled, self.grid, args)


_BLOCK_KEY = {_sum_rows_kernel: "BLOCK_D", _channel_sum_kernel: "BLOCK_C"}


def rows_geometry(
    n: int, d: int, device: torch.device, tile: int, programs_per_sm: int
) -> tuple[int, int, int, int, int]:
    """How a row-sum kernel loading ``tile`` elements at a time cuts an (n, d) sum:
    ``(BLOCK_N, BLOCK_D, column blocks, rows per split, splits)``; n, d >= 1."""
    block_d = min(_pow2(d), _MAX_BLOCK_D)
    block_n = min(max(1, tile // block_d), _pow2(n))
    col_blocks = _cdiv(d, block_d)
    blocks_per_split, splits = _split(_cdiv(n, block_n), col_blocks, device, programs_per_sm)
    return block_n, block_d, col_blocks, blocks_per_split * block_n, splits


def rows_launch(
    n: int,
    d: int,
    stride_row: int,
    device: torch.device,
    square: bool,
    tail=None,
    *,
    tile: int = TILE,
    num_warps: int = NUM_WARPS,
    programs_per_sm: int = PROGRAMS_PER_SM,
) -> ReductionLaunch:
    """Column sums of an (n, d) input with unit column stride and row stride
    ``stride_row``; n, d >= 1. ``tile`` (elements a program loads per iteration),
    ``num_warps`` and ``programs_per_sm`` (the programs a split launch aims for) are the
    statistics' settings unless a tuning run (docs/benchmarks_history.md, "The row sums'
    settings") asks for others."""
    block_n, block_d, col_blocks, rows_per_split, splits = rows_geometry(
        n, d, device, tile, programs_per_sm
    )
    args = {"n_rows": n, "n_cols": d, "stride_row": stride_row}
    args["rows_per_split"] = rows_per_split
    meta = {"SQUARE": square, "BLOCK_N": block_n, "BLOCK_D": block_d, "num_warps": num_warps}
    return ReductionLaunch(
        _sum_rows_kernel, (col_blocks, splits), args, meta, splits, d, device, tail, tile
    )


def channels_launch(
    b: int,
    c: int,
    length: int,
    stride_b: int,
    stride_c: int,
    device: torch.device,
    square: bool,
    tail=None,
) -> ReductionLaunch:
    """Per-channel sums of a (b, c, length) input with unit stride along its last dim;
    b, c, length >= 1."""
    block_l = min(_pow2(length), _MAX_BLOCK_L)
    block_c = min(max(1, _CHANNEL_TILE // block_l), _pow2(c))
    chan_blocks = _cdiv(c, block_c)
    pos_blocks = _cdiv(length, block_l)
    n_items = b * pos_blocks
    items_per_split, splits = _split(n_items, chan_blocks, device, _CHANNEL_PROGRAMS_PER_SM)
    args = {"n_chan": c, "n_pos": length, "stride_b": stride_b, "stride_c": stride_c}
    args.update(n_pos_blocks=pos_blocks, items_per_split=items_per_split, n_items=n_items)
    meta = {
        "SQUARE": square, "BLOCK_C": block_c, "BLOCK_L": block_l,
        "num_warps": _CHANNEL_NUM_WARPS,
    }  # fmt: skip
    return ReductionLaunch(
        _channel_sum_kernel, (chan_blocks, splits), args, meta, splits, c, device, tail,
        _CHANNEL_TILE,
    )  # fmt: skip


def reduction_launch(view: torch.Tensor, square: bool, tail=None) -> ReductionLaunch | None:
    """The launch that sums ``view`` as laid out now: a 2-D view over its rows, a 3-D
    view over dims 0 and 2; ``None`` when no kernel reads that layout in place (the
    caller copies it first) or the view is empty.

    A 2-D view with unit row stride is summed as the channels of its transpose, a 3-D
    view with unit channel stride (channels-last) or a single position as the rows of
    its (B * L, C) view, each without a copy.

    Example:
        >>> x = torch.ones(6, 4)
        >>> out = torch.zeros(4)
        >>> reduction_launch(x, square=True)(x, out, scale=0.5); out
        tensor([3., 3., 3., 3.])
    """
    if view.numel() == 0:
        return None
    if view.dim() == 2:
        n, d = view.shape
        if d == 1 or view.stride(1) == 1:
            return rows_launch(n, d, view.stride(0), view.device, square, tail)
        if n == 1 or view.stride(0) == 1:
            return channels_launch(1, d, n, 0, view.stride(1), view.device, square, tail)
        return None
    b, c, length = view.shape
    sb, sc, sl = view.stride()
    if sc == 1 or c == 1:
        # rows of (B * L, C): each position's channels contiguous, positions evenly spaced
        if length == 1:
            return rows_launch(b, c, sb, view.device, square, tail)
        if b == 1 or sb == length * sl:
            return rows_launch(b * length, c, sl, view.device, square, tail)
    if length == 1 or sl == 1:
        return channels_launch(b, c, length, sb, sc, view.device, square, tail)
    return None


def _destination(
    out: torch.Tensor | None, n: int, device: torch.device, accumulate: bool
) -> torch.Tensor:
    """``out`` checked for the kernels' direct writes, or a new float32 vector of ``n``."""
    if out is None:
        if accumulate:
            raise ValueError("accumulate=True needs an out tensor to add to")
        return torch.empty(n, dtype=torch.float32, device=device)
    check_statistic_out(out, n, device)
    return out


def _reduce(
    x: torch.Tensor, square: bool, out: torch.Tensor | None, scale: float, accumulate: bool
) -> torch.Tensor:
    """What :func:`sum_rows_triton` and :func:`channel_sum_triton` share: checks, the
    launch for ``x`` (of a contiguous copy when none reads it in place), the empty case."""
    out = _destination(out, x.shape[1], x.device, accumulate)
    if x.numel() == 0:
        if not accumulate:
            out.zero_()  # the sums over nothing
        return out
    launch = reduction_launch(x, square)
    if launch is None:
        x = x.contiguous()
        launch = reduction_launch(x, square)
    launch(x, out, scale, accumulate)
    return out


def sum_rows_triton(
    x: torch.Tensor,
    square: bool,
    *,
    out: torch.Tensor | None = None,
    scale: float = 1.0,
    accumulate: bool = False,
) -> torch.Tensor:
    """Column sums of ``x`` (N, D), of ``x * x`` when ``square``, as float32 (D,).

    ``x`` is read once in its own dtype. A transposed input (unit row stride) is summed
    as the channels of a (1, D, N) view instead of being copied. The epilogue runs in
    the kernel: the sums are multiplied by ``scale`` and written into ``out`` (or added to
    it when ``accumulate``). Each call works out its launch and workspace again; callers
    that reduce the same geometry repeatedly keep a :class:`ReductionLaunch`
    (:func:`reduction_launch`), which is a single kernel launch.

    Args:
        x: (N, D) input, float32, bfloat16 or float16.
        square: sum ``x * x`` instead of ``x``.
        out: contiguous float32 (D,) destination; a new tensor when ``None``.
        scale: factor applied to the sums.
        accumulate: add into ``out`` instead of overwriting it.

    Returns:
        ``out``, or the new tensor.

    Example:
        >>> sum_rows_triton(torch.ones(4, 3), square=True)
        tensor([4., 4., 4.])
    """
    return _reduce(x, square, out, scale, accumulate)


def channel_sum_triton(
    x: torch.Tensor,
    square: bool,
    *,
    out: torch.Tensor | None = None,
    scale: float = 1.0,
    accumulate: bool = False,
) -> torch.Tensor:
    """Per-channel sums of ``x`` (B, C, L) over dims 0 and 2, as float32 (C,).

    ``x`` is read once in its own dtype. Channels-last input (unit channel stride), and
    any input with L == 1, is summed as the columns of a (B * L, C) view instead. The
    keyword arguments are those of :func:`sum_rows_triton`.

    Example:
        >>> channel_sum_triton(torch.ones(2, 3, 5), square=False)
        tensor([10., 10., 10.])
    """
    return _reduce(x, square, out, scale, accumulate)
