"""Triton kernels for the Fisher statistics: column sums, channel sums and factor folding.

The two reductions read their input once in its own dtype (float32, bfloat16 or
float16) and accumulate in float32. Work is split over rows as well as columns so that
both tall-skinny inputs (Linear: 512K rows, hundreds of columns) and short-wide ones
(conv inputs reduced over a batch of 512, tens of thousands of columns) fill the GPU.
Each split writes its own row of a float32 partials buffer and a second small kernel
adds the rows in a fixed order, so results are bitwise reproducible from run to run
(no atomics). Whichever kernel produces the totals also applies the caller's epilogue
(scale, write or add into a given buffer), so that a Fisher statistic's sums are
accumulated with no operation besides the one or two launches.

:func:`fold_triton` folds every Fisher factor of a model in a single launch: one
program per factor, addressed through a device table of data pointers
(:func:`fold_table`).

Over 400 lines: the two reductions, their finishing pass, the epilogue they share and
the launch geometry are one unit of about 400 lines, and the fold kernel, which consumes
what they produce, stays beside them; every kernel keeps its launcher and checks next to
it.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from hf_triaccel._types import (
    EMA_MODES,
    NORMALISE_EPS,
    NORMALISE_MODES,
    NORMALISE_TINY,
    check_statistic_out,
)

# Sizes below were picked by measurement on an H200 (bf16 inputs, 64 to 150K columns).
# Elements in one loaded tile: 16 elements per thread with 8 warps.
_TILE = 4096
_NUM_WARPS = 8
# Widest column block of the row-sum kernel and longest position block of the channel
# kernel; narrow column blocks give short-wide inputs enough programs without a split.
_MAX_BLOCK_D = 128
_MAX_BLOCK_L = 512
# Programs to aim for per streaming multiprocessor, enough loads in flight to saturate HBM.
_PROGRAMS_PER_SM = 4
# Under the CPU interpreter every program costs Python time; a handful still exercises
# the split-and-finish path.
_INTERPRETED_PROGRAMS = 8
# Narrow column blocks in the finishing pass: more programs when D is a few hundred.
_FINISH_BLOCK_N = 128
_FOLD_BLOCK = 4096
_FOLD_NUM_WARPS = 16


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
def _write_totals(
    dst_ptr,
    offs,
    mask,
    total,
    split,
    n,
    scale,
    FINAL: tl.constexpr,
    ACCUMULATE: tl.constexpr,
):
    """A program's sums: through the epilogue into ``dst`` (n,) when ``FINAL``, else into
    row ``split`` of the (splits, n) partials buffer ``dst``."""
    if FINAL:
        _store_result(dst_ptr, offs, mask, total, scale, ACCUMULATE)
    else:
        tl.store(dst_ptr + split * n + offs, total, mask=mask)


@triton.jit
def _sum_rows_kernel(
    x_ptr,
    dst_ptr,
    n_rows,
    n_cols,
    stride_row,
    rows_per_split,
    scale,
    SQUARE: tl.constexpr,
    FINAL: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Partial column sums of one (rows_per_split, BLOCK_D) slab of ``x``.

    Grid: (column blocks, splits). ``x`` is (n_rows, n_cols) with unit column stride.
    With ``FINAL`` (a single split) this program's sums are the column totals and go
    through the result epilogue into ``dst`` (n_cols,); otherwise ``dst`` is the
    (splits, n_cols) float32 partials buffer and this program fills
    ``dst[split, block columns]``.
    """
    pid_d = tl.program_id(0)
    pid_s = tl.program_id(1)
    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)  # (BLOCK_D,)
    col_mask = cols < n_cols
    row_start = pid_s * rows_per_split
    row_end = tl.minimum(row_start + rows_per_split, n_rows)
    # A 2-D accumulator keeps the loop free of cross-thread reductions; one at the end.
    acc = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    for r in range(row_start, row_end, BLOCK_N):
        rows = r + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
        mask = (rows < row_end)[:, None] & col_mask[None, :]  # (BLOCK_N, BLOCK_D)
        # int64 row offsets: N * stride can pass 2^31 elements.
        ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_row + cols[None, :]
        acc += _load_term(ptrs, mask, SQUARE)
    total = tl.sum(acc, axis=0)
    _write_totals(dst_ptr, cols, col_mask, total, pid_s, n_cols, scale, FINAL, ACCUMULATE)


@triton.jit
def _channel_sum_kernel(
    x_ptr,
    dst_ptr,
    n_chan,
    n_pos,
    stride_b,
    stride_c,
    n_pos_blocks,
    items_per_split,
    n_items,
    scale,
    SQUARE: tl.constexpr,
    FINAL: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_L: tl.constexpr,
):
    """Partial per-channel sums of ``x`` (B, C, L) with unit stride along L.

    Grid: (channel blocks, splits). A work item is one (batch, position block) pair,
    numbered ``b * n_pos_blocks + l_block``; each split takes a contiguous run of items
    so that both a large batch and long rows can be spread over many programs.
    With ``FINAL`` (a single split) the sums go through the result epilogue into
    ``dst`` (C,); otherwise ``dst`` is (splits, C) float32 and this program fills
    ``dst[split, block channels]``.
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
    _write_totals(dst_ptr, chans, chan_mask, total, pid_s, n_chan, scale, FINAL, ACCUMULATE)


@triton.jit
def _finish_kernel(
    part_ptr,
    out_ptr,
    n_splits,
    n_cols,
    scale,
    ACCUMULATE: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """``out[j] (+)= scale * sum_s part[s, j]`` for ``part`` (n_splits, n_cols), summed in a
    fixed order.

    Grid: (column blocks,). Loads (BLOCK_S, BLOCK_N) tiles so that hundreds of splits
    cost a few loop steps rather than one dependent load each.
    """
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    col_mask = cols < n_cols
    acc = tl.zeros((BLOCK_S, BLOCK_N), dtype=tl.float32)
    for s in range(0, n_splits, BLOCK_S):
        splits = s + tl.arange(0, BLOCK_S)  # (BLOCK_S,)
        mask = (splits < n_splits)[:, None] & col_mask[None, :]  # (BLOCK_S, BLOCK_N)
        acc += tl.load(part_ptr + splits[:, None] * n_cols + cols[None, :], mask=mask, other=0.0)
    total = tl.sum(acc, axis=0)
    _store_result(out_ptr, cols, col_mask, total, scale, ACCUMULATE)


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


def _target_programs(device: torch.device) -> int:
    """How many programs a reduction should launch to keep ``device`` busy."""
    if device.type != "cuda":
        return _INTERPRETED_PROGRAMS
    return _PROGRAMS_PER_SM * _sm_count(device)


def _split(n_units: int, n_blocks: int, device: torch.device) -> tuple[int, int]:
    """Splits ``n_units`` of sequential work so ``n_blocks * splits`` nears the target.

    No split when the blocks alone give half the target: the finishing pass would then
    cost more than the extra parallelism gains.

    Returns:
        (units per split, number of splits), every split non-empty.
    """
    target = _target_programs(device)
    if 2 * n_blocks >= target:
        return n_units, 1
    per_split = _cdiv(n_units, min(_cdiv(target, n_blocks), n_units))
    return per_split, _cdiv(n_units, per_split)


# The launch geometry depends only on the sizes: the statistics hooks call the kernels
# with the same few shapes on every refresh step, so it is worked out once per shape.
@functools.lru_cache(maxsize=1024)
def _sum_rows_geometry(n: int, d: int, device: torch.device) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, BLOCK_D, column blocks, rows per split, splits) for an (n, d) input."""
    block_d = min(_pow2(d), _MAX_BLOCK_D)
    block_n = min(max(1, _TILE // block_d), _pow2(n))
    col_blocks = _cdiv(d, block_d)
    blocks_per_split, splits = _split(_cdiv(n, block_n), col_blocks, device)
    return block_n, block_d, col_blocks, blocks_per_split * block_n, splits


@functools.lru_cache(maxsize=1024)
def _channel_sum_geometry(
    b: int, c: int, length: int, device: torch.device
) -> tuple[int, int, int, int, int, int, int]:
    """(BLOCK_C, BLOCK_L, channel blocks, position blocks, items, items per split,
    splits) for a (b, c, length) input."""
    block_l = min(_pow2(length), _MAX_BLOCK_L)
    block_c = min(max(1, _TILE // block_l), _pow2(c))
    chan_blocks = _cdiv(c, block_c)
    pos_blocks = _cdiv(length, block_l)
    n_items = b * pos_blocks
    items_per_split, splits = _split(n_items, chan_blocks, device)
    return block_c, block_l, chan_blocks, pos_blocks, n_items, items_per_split, splits


def _finish(
    part: torch.Tensor, out: torch.Tensor, scale: float = 1.0, accumulate: bool = False
) -> None:
    """Adds the rows of ``part`` (splits, n) and writes (or adds) the scaled total into
    ``out`` (n,)."""
    splits, n = part.shape
    block_n = min(_pow2(n), _FINISH_BLOCK_N)
    block_s = min(_pow2(splits), max(1, _TILE // block_n))
    _finish_kernel[(_cdiv(n, block_n),)](
        part,
        out,
        splits,
        n,
        scale,
        ACCUMULATE=accumulate,
        BLOCK_S=block_s,
        BLOCK_N=block_n,
        num_warps=_NUM_WARPS,
    )


def _flags(square: bool, final: bool, accumulate: bool) -> dict[str, bool]:
    """A reduction kernel's constexpr flags: the epilogue runs in the kernel when its
    single split gives the totals, else in the finishing pass."""
    return {"SQUARE": square, "FINAL": final, "ACCUMULATE": accumulate and final}


def _launch_sum_rows(
    x: torch.Tensor,
    square: bool,
    out: torch.Tensor,
    scale: float,
    accumulate: bool,
) -> None:
    """Column sums of ``x`` (N, D) whose columns have unit stride, into ``out``; N, D >= 1."""
    n, d = x.shape
    block_n, block_d, col_blocks, rows_per_split, splits = _sum_rows_geometry(n, d, x.device)
    final = splits == 1
    dst = out if final else torch.empty(splits, d, dtype=torch.float32, device=x.device)
    _sum_rows_kernel[(col_blocks, splits)](
        x,
        dst,
        n,
        d,
        x.stride(0),
        rows_per_split,
        scale,
        **_flags(square, final, accumulate),
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        num_warps=_NUM_WARPS,
    )
    if not final:
        _finish(dst, out, scale, accumulate)


def _launch_channel_sum(
    x: torch.Tensor,
    square: bool,
    out: torch.Tensor,
    scale: float,
    accumulate: bool,
) -> None:
    """Per-channel sums of ``x`` (B, C, L) with unit stride along L, into ``out``;
    B, C, L >= 1."""
    b, c, length = x.shape
    block_c, block_l, chan_blocks, pos_blocks, n_items, items_per_split, splits = (
        _channel_sum_geometry(b, c, length, x.device)
    )
    final = splits == 1
    dst = out if final else torch.empty(splits, c, dtype=torch.float32, device=x.device)
    _channel_sum_kernel[(chan_blocks, splits)](
        x,
        dst,
        c,
        length,
        x.stride(0),
        x.stride(1),
        pos_blocks,
        items_per_split,
        n_items,
        scale,
        **_flags(square, final, accumulate),
        BLOCK_C=block_c,
        BLOCK_L=block_l,
        num_warps=_NUM_WARPS,
    )
    if not final:
        _finish(dst, out, scale, accumulate)


def _unit_stride(x: torch.Tensor, dim: int) -> bool:
    """Whether stepping along ``dim`` moves one element (always true for a size-1 dim)."""
    return x.shape[dim] == 1 or x.stride(dim) == 1


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


def _empty_result(out: torch.Tensor, accumulate: bool) -> torch.Tensor:
    """The result of a reduction over nothing: zeros (added: nothing changes)."""
    if not accumulate:
        out.zero_()
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
    it when ``accumulate``), so that a caller accumulating statistics needs no other
    operation.

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
    n, d = x.shape
    out = _destination(out, d, x.device, accumulate)
    if n == 0 or d == 0:
        return _empty_result(out, accumulate)
    if _unit_stride(x, 1):
        _launch_sum_rows(x, square, out, scale, accumulate)
    elif _unit_stride(x, 0):
        _launch_channel_sum(x.t().unsqueeze(0), square, out, scale, accumulate)
    else:
        _launch_sum_rows(x.contiguous(), square, out, scale, accumulate)
    return out


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
    b, c, length = x.shape
    if length == 1 or (x.stride(1) == 1 and not _unit_stride(x, 2)):
        # reshape stays a view for channels-last and L == 1; it copies only odd layouts
        rows = x.transpose(1, 2).reshape(b * length, c)
        return sum_rows_triton(rows, square, out=out, scale=scale, accumulate=accumulate)
    out = _destination(out, c, x.device, accumulate)
    if b == 0 or c == 0 or length == 0:
        return _empty_result(out, accumulate)
    if not _unit_stride(x, 2):
        x = x.contiguous()
    _launch_channel_sum(x, square, out, scale, accumulate)
    return out


@triton.jit
def _fold_kernel(
    table_ptr,
    a,
    b,
    PAPER: tl.constexpr,
    RELATIVE: tl.constexpr,
    EPS: tl.constexpr,
    TINY: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Folds factor ``i = program_id(0)``: ``ema = a * ema + b * v`` and refreshes ``used``.

    ``table`` is (factors, 4) int64: addresses of ema, new and used (float32, contiguous)
    and the length n. Reference mode: v = normalise(new) and used <- ema unless used is
    ema. Paper mode: v = new and used <- normalise(ema). ``normalise`` is min-max over the
    finite entries, +inf -> 1, -inf and NaN -> 0, dividing by range + EPS, or with
    ``RELATIVE`` by range * (1 + EPS) + TINY. Two sweeps over the n entries: the
    first finds min and max, the second updates; in paper mode the EMA is recomputed in
    the second sweep rather than re-read, so ``used`` may alias ``ema``.
    """
    row = table_ptr + tl.program_id(0) * 4
    ema_addr = tl.load(row)
    used_addr = tl.load(row + 2)
    ema_ptr = ema_addr.to(tl.pointer_type(tl.float32))
    new_ptr = tl.load(row + 1).to(tl.pointer_type(tl.float32))
    used_ptr = used_addr.to(tl.pointer_type(tl.float32))
    n = tl.load(row + 3)
    separate = used_addr != ema_addr

    lo_acc = tl.full((BLOCK,), float("inf"), dtype=tl.float32)
    hi_acc = tl.full((BLOCK,), float("-inf"), dtype=tl.float32)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)  # (BLOCK,)
        mask = offs < n
        src = tl.load(new_ptr + offs, mask=mask, other=0.0)
        if PAPER:
            src = a * tl.load(ema_ptr + offs, mask=mask, other=0.0) + b * src
        # |x| < inf is false for +-inf and NaN alike
        keep = mask & (tl.abs(src) < float("inf"))
        lo_acc = tl.minimum(lo_acc, tl.where(keep, src, float("inf")))
        hi_acc = tl.maximum(hi_acc, tl.where(keep, src, float("-inf")))
    lo = tl.min(lo_acc, axis=0)
    if RELATIVE:
        denom = (tl.max(hi_acc, axis=0) - lo) * (1.0 + EPS) + TINY
    else:
        denom = tl.max(hi_acc, axis=0) - lo + EPS

    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)  # (BLOCK,)
        mask = offs < n
        src = tl.load(new_ptr + offs, mask=mask, other=0.0)
        ema = tl.load(ema_ptr + offs, mask=mask, other=0.0)
        if PAPER:
            src = a * ema + b * src
        scaled = tl.where(tl.abs(src) < float("inf"), (src - lo) / denom, 0.0)
        scaled = tl.where(src == float("inf"), 1.0, scaled)
        if PAPER:
            tl.store(ema_ptr + offs, src, mask=mask)
            # after the ema store: when used is ema, the normalised value must win
            tl.store(used_ptr + offs, scaled, mask=mask)
        else:
            ema = a * ema + b * scaled
            tl.store(ema_ptr + offs, ema, mask=mask)
            tl.store(used_ptr + offs, ema, mask=mask & separate)


def _check_factors(
    emas: list[torch.Tensor], news: list[torch.Tensor], useds: list[torch.Tensor]
) -> None:
    """Raises ``ValueError`` unless the kernel can address every factor as it assumes."""
    if not (len(emas) == len(news) == len(useds)):
        raise ValueError("emas, news and useds differ in length")
    device = emas[0].device
    for i, group in enumerate(zip(emas, news, useds, strict=True)):
        for t in group:
            if t.dtype != torch.float32 or t.dim() != 1 or not t.is_contiguous():
                raise ValueError(
                    f"factor {i}: fold_triton needs contiguous 1-D float32 tensors, "
                    f"got {t.dtype} of shape {tuple(t.shape)}"
                )
            if t.device != device or t.numel() != group[0].numel():
                raise ValueError(f"factor {i}: tensors differ in device or length")


def fold_table(
    emas: list[torch.Tensor], news: list[torch.Tensor], useds: list[torch.Tensor]
) -> torch.Tensor:
    """The (factors, 4) int64 device table that :func:`fold_triton` reads: the addresses
    of each factor's ema, new and used tensors and their length.

    The table holds addresses, not references: the caller keeps the tensors alive, where
    they are, for as long as it uses the table. Building it checks the tensors and copies
    it to the device, which costs more host time than the kernel, so a caller that folds
    the same tensors again keeps it.

    Raises:
        ValueError: no factors, lists of different lengths, or tensors the kernel cannot
            address (not float32, not contiguous 1-D, lengths or devices that differ
            within a factor).

    Example:
        >>> ema, new = torch.zeros(3), torch.ones(3)
        >>> fold_table([ema], [new], [ema])[0, 3].item()
        3
    """
    if not emas:
        raise ValueError("fold_table needs at least one factor")
    _check_factors(emas, news, useds)
    rows = [
        (e.data_ptr(), w.data_ptr(), u.data_ptr(), e.numel())
        for e, w, u in zip(emas, news, useds, strict=True)
    ]
    device = emas[0].device
    host = torch.tensor(rows, dtype=torch.int64, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)


def fold_triton(table: torch.Tensor, mode: str, gamma: float, normalise: str = "absolute") -> None:
    """Folds every factor of ``table`` (see :func:`fold_table`) in one launch: each new
    statistic into its running factor, refreshing the factor the update uses.

    Same result as :func:`hf_triaccel.curvature.fold.fold_reference` applied to every
    factor; a factor's used tensor may be its ema itself.

    Args:
        table: the factors' table, from :func:`fold_table`.
        mode: ``"reference"`` or ``"paper"``.
        gamma: EMA decay.
        normalise: ``"absolute"`` (the published normalisation) or ``"relative"``.

    Raises:
        ValueError: unknown ``mode`` or ``normalise``.

    Example:
        >>> ema, new = torch.zeros(3), torch.tensor([1.0, 2.0, 3.0])
        >>> fold_triton(fold_table([ema], [new], [ema]), "reference", 1.0)
        >>> ema
        tensor([0.0000, 0.0050, 0.0100])
    """
    if mode not in EMA_MODES:
        raise ValueError(f"ema={mode!r} is not one of {EMA_MODES}")
    if normalise not in NORMALISE_MODES:
        raise ValueError(f"normalise={normalise!r} is not one of {NORMALISE_MODES}")
    paper = mode == "paper"
    a, b = (gamma, 1.0 - gamma) if paper else (0.1 * gamma, 0.01 * gamma)
    _fold_kernel[(table.shape[0],)](
        table,
        a,
        b,
        PAPER=paper,
        RELATIVE=normalise == "relative",
        EPS=NORMALISE_EPS,
        TINY=NORMALISE_TINY,
        BLOCK=_FOLD_BLOCK,
        num_warps=_FOLD_NUM_WARPS,
    )
