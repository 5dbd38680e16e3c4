"""The Triton fold of every Fisher factor of a model in a single launch: one program per
factor, addressed through a device table of data pointers (:func:`fold_table`); the same
result as :func:`hf_triaccel.curvature.collection.fold.fold_reference` on each factor.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_triaccel._types import EMA_MODES, NORMALISE_EPS, NORMALISE_MODES, NORMALISE_TINY

_FOLD_BLOCK = 4096
_FOLD_NUM_WARPS = 16


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

    Same result as :func:`hf_triaccel.curvature.collection.fold.fold_reference` applied to every
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
