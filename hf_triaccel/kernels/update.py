"""The fused multi-tensor AdaFisher update (``impl="triton"``).

Over 400 lines: the kernel and the device tables it reads are one unit (the table
columns are the kernel's constants; building, validating and caching the tables is
how the kernel stays free of host work), and the bound and unbound entry points share
that cache.

The arithmetic of the reference update (``hf_triaccel.optim.functional``, float32 for
float32, bfloat16 and float16 parameters: :data:`FUSED_DTYPES`), in one kernel launch
per (parameter dtype, gradient dtype) group, however many tensors the group holds. The
launch grid is the total number of ``BLOCK``-element chunks of the group's tensors; each
program reads, from two small device tables,

- which tensor its chunk belongs to and where the chunk starts (the *chunk table*),
- that tensor's data pointers and factor layout (the *tensor table*),

then updates its chunk: read param, grad and momentum, write param and momentum
(20 bytes per float32 parameter). The preconditioner ``F`` is formed per element from
the two factor vectors of a :class:`~hf_triaccel._types.ParamFactors`
(a few KiB, served from L2), never as a Kronecker product, and the bias correction
``1 - beta^t`` from the step tensor, so nothing is read back to the host.

The tables hold raw pointers, so they are built once and cached, keyed on the
addresses and sizes of the tensors and on the factor objects (see :func:`_plan_key`),
and copied to the device from pinned memory without a sync. Gradients get a table of
their own: ``zero_grad(set_to_none=True)`` may hand out new gradient tensors each
step, and then only that table, one pointer per tensor, is copied again. With cached
tables a call only launches kernels (no allocation, no host-device synchronisation),
so it can be captured in a CUDA graph after one uncaptured warm-up call.

The factor layouts index elements in logical (row-major) order. A ``channels_last``
convolution weight (with its gradient and momentum in the same layout) runs over
(out, kh, kw, in) in memory: it goes to a launch of its own, whose kernel maps each
memory position within an output row back to the factor's (in, kh, kw) index. Tensors
in any other non-contiguous layout are left alone: each call returns their positions,
and the caller (the dispatcher in ``hf_triaccel.optim.functional``) updates them.

:func:`fused_adafisher` finds its tables from the arguments on every call (a key of
every pointer it encodes). :class:`FusedAdaFisher` is the same update bound to one
fixed set of tensors, for a caller that owns them (the optimizer): a call then checks
only the parameters' and gradients' addresses.

This module imports only torch, triton and :mod:`hf_triaccel._types`.
"""

from __future__ import annotations

import contextlib
import operator
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from hf_triaccel._types import ParamFactors
from hf_triaccel.kernels.launch import compiled_kernel, direct_launch_supported, launch_compiled

FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""The parameter dtypes the kernel updates (in float32 arithmetic, float32 momentum).
Others (float64 above all, whose update must stay in float64) are the caller's."""

# Chosen on an H200 over ViT-B/16's 152 float32 tensors: 1024 / 4 warps took 458 us
# (3.8 TB/s at 20 bytes per parameter), 512 / 2 warps the same, 2048 / 8 warps 492 us,
# 4096 / 8 warps 780 us.
BLOCK = 1024
"""Elements per program. Each program first reads two table rows and forms the bias
correction, which 1024 elements amortise; small chunks keep many programs resident,
which hides the latency of the dependent table loads. The last partial chunk of each
tensor wastes at most BLOCK - 1 lanes."""

NUM_WARPS = 4
"""128 threads, 8 elements each: two 16-byte accesses per float32 stream per thread."""

_MAX_PLANS = 8
"""Cached table sets kept (least recently used goes first): one per optimizer param
group and device is the usual need; a bound keeps stale pointer sets from piling up."""

_ALIGN = 16  # bytes: the widest vectorised global access

# Columns of the tensor table (int64, one row per tensor).
_T_PARAM = tl.constexpr(0)  # data pointers ...
_T_MOM = tl.constexpr(1)
_T_STEP = tl.constexpr(2)
_T_G = tl.constexpr(3)  # ... of the two factor vectors (the momentum's when no factors);
_T_A = tl.constexpr(4)  # the a pointer is advanced by a_off, so no column holds it
_T_NUMEL = tl.constexpr(5)
_T_G_DIV = tl.constexpr(6)  # the FactorLayout, sizes clamped to numel (see _layout_row)
_T_G_MOD = tl.constexpr(7)
_T_A_DIV = tl.constexpr(8)
_T_A_MOD = tl.constexpr(9)
_T_HAS_FACTORS = tl.constexpr(10)
_T_A_INNER = tl.constexpr(11)  # channels-last weights: C_in, and kh * kw (else 1 and 1)
_T_A_OUTER = tl.constexpr(12)
_T_COMP = tl.constexpr(13)  # the Kahan compensation buffer (the momentum's when none)
_T_COLS = tl.constexpr(14)

# Columns of the chunk table (int64, one row per program). A chunk starting at flat
# element s has s = q_g * g_div + g_rem; g_qmod = q_g % g_mod (likewise for a), so the
# kernel needs no 64-bit division.
_C_TENSOR = tl.constexpr(0)
_C_START = tl.constexpr(1)
_C_G_REM = tl.constexpr(2)
_C_G_QMOD = tl.constexpr(3)
_C_A_REM = tl.constexpr(4)
_C_A_QMOD = tl.constexpr(5)
_C_COLS = tl.constexpr(6)

_INT32_LIMIT = 2**31 - 1 - 2 * BLOCK  # layout sizes below this keep the index math in 32 bits


@triton.jit
def _round_to(x, dtype: tl.constexpr):
    """float32 ``x`` rounded to nearest-even in ``dtype``, as ``Tensor.copy_`` rounds.

    float32 -> bfloat16 is rounded on the bits: Triton's CPU interpreter truncates that
    cast. The integer version costs a few ALU operations in a memory-bound kernel.
    """
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits += 0x7FFF + ((bits >> 16) & 1)  # half of the dropped range, ties to even
        bits = tl.where(x != x, 0x7FC00000, bits)  # keep NaN a NaN
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dtype)


# How the new weight is stored (ROUNDING), as hf_triaccel.optim.functional.ROUNDINGS names it.
ROUNDING_CODES = {"nearest": 0, "kahan": 1, "stochastic": 2}


@triton.jit
def _stochastic_bfloat16(x, seed, offsets):
    """float32 ``x`` rounded to bfloat16 stochastically: 16 random bits added to the 16
    bits bfloat16 drops, then truncated (non-finite values are rounded to nearest)."""
    bits = x.to(tl.uint32, bitcast=True)
    noise = tl.randint(seed, offsets) & 0xFFFF
    rounded = ((bits + noise) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    finite = tl.abs(x) < float("inf")
    return tl.where(finite, rounded, _round_to(x, tl.bfloat16))


# the seed changes every step: specialising on its value (1, multiples of 16) would
# compile again and mismatch the kernels launched directly
@triton.jit(do_not_specialize=["seed"])
def _adafisher_kernel(
    tensor_table,  # int64 [n_tensors, _T_COLS]
    grad_table,  # int64 [n_tensors]: gradient data pointers
    chunk_table,  # int64 [n_chunks, _C_COLS]; the grid is (n_chunks,)
    lr,  # float32 learning rate (unused when LR_IS_TENSOR)
    lr_ptr,  # one-element learning-rate tensor (None unless LR_IS_TENSOR)
    beta,
    one_minus_beta,  # computed in float64 on the host, as the reference's alpha
    weight_decay,
    damping,
    seed,  # the random stream of stochastic rounding
    PARAM_DTYPE: tl.constexpr,
    GRAD_DTYPE: tl.constexpr,
    MOM_DTYPE: tl.constexpr,  # the momentum's storage; the arithmetic is float32
    ROUNDING: tl.constexpr,  # ROUNDING_CODES: nearest, Kahan-compensated, stochastic
    LR_IS_TENSOR: tl.constexpr,
    MAXIMIZE: tl.constexpr,  # ascend: the gradient's sign is flipped first, as torch does
    L2_DECAY: tl.constexpr,  # weight decay added to the gradient (AdaFisher)
    DECOUPLED_DECAY: tl.constexpr,  # weight decay added to the direction (AdaFisherW)
    ALIGNED: tl.constexpr,  # every param / grad / momentum pointer is 16-byte aligned
    CHANNELS_LAST: tl.constexpr,  # 4-D weights stored (out, kh, kw, in): see below
    BLOCK: tl.constexpr,
):
    chunk = chunk_table + tl.program_id(0) * _C_COLS
    t = tl.load(chunk + _C_TENSOR)
    start = tl.load(chunk + _C_START)  # int64: a tensor may exceed 2**31 elements
    row = tensor_table + t * _T_COLS

    p_ptr = tl.load(row + _T_PARAM).to(tl.pointer_type(PARAM_DTYPE))
    g_ptr = tl.load(grad_table + t).to(tl.pointer_type(GRAD_DTYPE))
    m_ptr = tl.load(row + _T_MOM).to(tl.pointer_type(MOM_DTYPE))
    if ALIGNED:
        # Pointers made from integers carry no alignment Triton can see; with these hints
        # (and start a multiple of BLOCK) the three streams move in 16-byte accesses.
        p_ptr = tl.multiple_of(p_ptr, 16)
        g_ptr = tl.multiple_of(g_ptr, 16)
        m_ptr = tl.multiple_of(m_ptr, 16)
        start = tl.multiple_of(start, BLOCK)
    # 64-bit pointer arithmetic once per program; the per-element offsets are int32
    p_ptr += start
    g_ptr += start
    m_ptr += start
    n_left = tl.minimum(tl.load(row + _T_NUMEL) - start, BLOCK).to(tl.int32)

    # 1 - beta^step as torch computes it: beta^step rounded to float32, then subtracted.
    # float64 exp2/log2 make that rounding agree with pow for any step; once per program.
    step = tl.load(tl.load(row + _T_STEP).to(tl.pointer_type(tl.float32)))
    beta_t = tl.exp2(step.to(tl.float64) * tl.log2(tl.cast(beta, tl.float64)))
    bias_correction = 1.0 - beta_t.to(tl.float32)
    if LR_IS_TENSOR:
        lr = tl.load(lr_ptr).to(tl.float32)

    j = tl.arange(0, BLOCK)  # [BLOCK] int32: element j of the chunk is flat index start + j
    mask = j < n_left
    full = n_left == BLOCK
    # Masks of unknown constancy stop Triton from vectorising: full chunks (all but at
    # most one per tensor) load and store without one.
    if full:
        theta = tl.load(p_ptr + j).to(tl.float32)
        grad = tl.load(g_ptr + j).to(tl.float32)
        mom = tl.load(m_ptr + j).to(tl.float32)
    else:
        theta = tl.load(p_ptr + j, mask=mask).to(tl.float32)
        grad = tl.load(g_ptr + j, mask=mask).to(tl.float32)
        mom = tl.load(m_ptr + j, mask=mask).to(tl.float32)

    # F[k] = g[(k // g_div) % g_mod] * a[(k // a_div) % a_mod + a_off] + damping with
    # k = start + j. With start = q * g_div + g_rem and g_qmod = q % g_mod from the chunk
    # table, (k // g_div) % g_mod = (g_qmod + (g_rem + j) // g_div) % g_mod: 32-bit
    # arithmetic on small numbers (likewise for a; a_off is folded into a's pointer).
    has_factors = tl.load(row + _T_HAS_FACTORS) != 0
    g_div = tl.load(row + _T_G_DIV).to(tl.uint32)
    g_mod = tl.load(row + _T_G_MOD).to(tl.uint32)
    a_div = tl.load(row + _T_A_DIV).to(tl.uint32)
    a_mod = tl.load(row + _T_A_MOD).to(tl.uint32)
    g_rem = tl.load(chunk + _C_G_REM).to(tl.uint32)
    g_qmod = tl.load(chunk + _C_G_QMOD).to(tl.uint32)
    a_rem = tl.load(chunk + _C_A_REM).to(tl.uint32)
    a_qmod = tl.load(chunk + _C_A_QMOD).to(tl.uint32)
    # Unsigned: its division sequence is shorter than the signed one (the whole kernel
    # measured 5% faster); every value is below 2**31 (sizes are checked on the host).
    k = j.to(tl.uint32)
    g_idx = ((g_qmod + (g_rem + k) // g_div) % g_mod).to(tl.int32)  # [BLOCK]
    a_idx = (a_qmod + (a_rem + k) // a_div) % a_mod  # [BLOCK]
    if CHANNELS_LAST:
        # The layout is out_in over rows of a_mod = C_in * kh * kw entries, so a_idx is the
        # position within the row in memory order, (kh, kw, C_in); a is in (C_in, kh, kw).
        inner = tl.load(row + _T_A_INNER).to(tl.uint32)
        outer = tl.load(row + _T_A_OUTER).to(tl.uint32)
        a_idx = (a_idx % inner) * outer + a_idx // inner
    a_idx = a_idx.to(tl.int32)
    factor_mask = mask & has_factors
    g_fac = tl.load(tl.load(row + _T_G).to(tl.pointer_type(tl.float32)) + g_idx, mask=factor_mask)
    a_fac = tl.load(tl.load(row + _T_A).to(tl.pointer_type(tl.float32)) + a_idx, mask=factor_mask)
    fisher = tl.where(has_factors, g_fac * a_fac + damping, 1.0)

    if MAXIMIZE:
        grad = -grad
    if L2_DECAY:
        grad = grad + weight_decay * theta
    mom = beta * mom + one_minus_beta * grad
    direction = mom / (bias_correction * fisher)
    if DECOUPLED_DECAY:
        direction = direction + weight_decay * theta
    if ROUNDING == 1:
        # Kahan: the buffer carries what rounding the weight dropped (functional.py's
        # arithmetic: y = c - lr * d; theta' = round(theta + y); c' = y - (theta' - theta))
        c_ptr = tl.load(row + _T_COMP).to(tl.pointer_type(PARAM_DTYPE)) + start
        comp = tl.load(c_ptr + j, mask=mask).to(tl.float32)
        y = comp - lr * direction
        new = _round_to(theta + y, PARAM_DTYPE)
        tl.store(c_ptr + j, _round_to(y - (new.to(tl.float32) - theta), PARAM_DTYPE), mask=mask)
    elif ROUNDING == 2:
        # one random stream per element of the launch
        offsets = tl.program_id(0) * BLOCK + j
        new = _stochastic_bfloat16(theta - lr * direction, seed, offsets)
    else:
        new = _round_to(theta - lr * direction, PARAM_DTYPE)
    if full:
        tl.store(p_ptr + j, new)
        tl.store(m_ptr + j, _round_to(mom, MOM_DTYPE))
    else:
        tl.store(p_ptr + j, new, mask=mask)
        tl.store(m_ptr + j, _round_to(mom, MOM_DTYPE), mask=mask)


# Gradient dtypes the kernel reads (float64 gradients are read and rounded to float32,
# as the reference rounds them for a float32 parameter); parameters: FUSED_DTYPES only.
_TL_DTYPES = {
    torch.float32: tl.float32,
    torch.bfloat16: tl.bfloat16,
    torch.float16: tl.float16,
    torch.float64: tl.float64,
}


@dataclass
class _Group:
    """The tensors of one launch: one (param dtype, grad dtype, memory layout) triple."""

    members: list[int]  # positions in the argument lists
    numels: list[int]
    param_dtype: tl.dtype
    grad_dtype: tl.dtype
    mom_dtype: tl.dtype
    channels_last: bool
    tensor_table: torch.Tensor
    chunk_table: torch.Tensor
    n_chunks: int
    aligned: bool  # every param and momentum pointer is 16-byte aligned
    grad_table: torch.Tensor | None = None
    grads_aligned: bool = False
    # Compiled kernels by the constexprs and alignments of a call: launched directly after
    # the first call of each (binding the arguments again costs more host time than the
    # update takes on the device).
    compiled: dict[tuple, object] = field(default_factory=dict)


@dataclass
class _Plan:
    """Everything one argument set needs, built once and reused while its key matches."""

    device: torch.device
    groups: list[_Group]
    fallback: tuple[int, ...]  # positions of tensors in other layouts: left to the caller
    grad_signature: tuple  # the gradients' dtypes and strides the groups assume
    # The ParamFactors whose id() is in the key: holding them keeps the ids unique.
    keep_alive: list[ParamFactors] = field(default_factory=list)
    grad_ptrs: tuple[int, ...] | None = None


_TORCH_DTYPES = {v: k for k, v in _TL_DTYPES.items()}

_PLANS: OrderedDict[tuple, _Plan] = OrderedDict()
_STATS = {"plans": 0, "grad_tables": 0}

_data_ptr = torch.Tensor.data_ptr
_numel = torch.Tensor.numel
_stride = torch.Tensor.stride
_dtype = operator.attrgetter("dtype")
_g_of = operator.attrgetter("g")
_a_of = operator.attrgetter("a")


def _plan_key(params, moms, factors, steps, comps) -> tuple:
    """What the tensor and chunk tables encode, from C-level calls only: this runs every
    step. A tensor is taken to keep its strides while its address and size are unchanged;
    the dtypes are part of the key, since memory freed by one tensor can come back at the
    same address as another of a different dtype (a momentum reloaded in another dtype).

    A ParamFactors' id() stands for its frozen layout (the plan keeps it alive, so the
    id cannot be reused); its vectors' pointers change when they are moved.
    """
    present = [f for f in factors if f is not None]
    return (
        params[0].device,
        tuple(map(_data_ptr, params)),
        tuple(map(_numel, params)),
        tuple(map(_dtype, params)),
        tuple(map(_data_ptr, moms)),
        tuple(map(_dtype, moms)),
        tuple(map(_data_ptr, steps)),
        tuple(0 if c is None else c.data_ptr() for c in comps),
        tuple(None if c is None else c.dtype for c in comps),
        tuple(map(id, factors)),
        tuple(map(_data_ptr, map(_g_of, present))),
        tuple(map(_data_ptr, map(_a_of, present))),
    )


def _grad_signature(grads) -> tuple:
    """What the grouping assumes of the gradients; checked when their pointers change."""
    return tuple(map(_dtype, grads)), tuple(map(_stride, grads))


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copies a table to ``device`` without a host sync (from pinned memory on CUDA)."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def _layout_row(factors: ParamFactors, numel: int, i: int) -> list[int]:
    """(g_div, g_mod, a_div, a_mod) for the kernel, checked against the vectors.

    Sizes past ``numel`` are clamped to it (for flat indices below ``numel`` the
    indices are unchanged), which keeps the per-element arithmetic in 32 bits.
    """
    lay = factors.layout
    g_div, g_mod = min(lay.g_div, numel), min(lay.g_mod, numel)
    a_div, a_mod = min(lay.a_div, numel), min(lay.a_mod, numel)
    if min(g_div, g_mod, a_div, a_mod) < 1 or lay.a_off < 0:
        raise ValueError(f"tensor {i}: invalid factor layout {lay}")
    if max(g_div, g_mod, a_div, a_mod) > _INT32_LIMIT:
        raise ValueError(f"tensor {i}: factor layout {lay} too large for the fused kernel")
    # largest index each vector is read at
    g_last = min(g_mod, -(-numel // g_div)) - 1
    a_last = min(a_mod, -(-numel // a_div)) - 1 + lay.a_off
    if g_last >= factors.g.numel() or a_last >= factors.a.numel():
        raise ValueError(
            f"tensor {i}: layout {lay} reads past its factor vectors "
            f"(g has {factors.g.numel()} entries, a has {factors.a.numel()})"
        )
    return [g_div, g_mod, a_div, a_mod]


def _chunk_rows(t: int, numel: int, layout: list[int]) -> torch.Tensor:
    """Chunk-table rows (int64 [n_chunks, _C_COLS]) of the group's tensor ``t``."""
    g_div, g_mod, a_div, a_mod = layout
    starts = torch.arange(0, numel, BLOCK, dtype=torch.int64)
    g_q = starts // g_div
    a_q = starts // a_div
    return torch.stack(
        [
            torch.full_like(starts, t),
            starts,
            starts - g_q * g_div,
            g_q % g_mod,
            starts - a_q * a_div,
            a_q % a_mod,
        ],
        dim=1,
    )


def _check(
    i: int,
    p: torch.Tensor,
    m: torch.Tensor,
    fac: ParamFactors | None,
    step: torch.Tensor,
    device: torch.device,
) -> None:
    """Validates what the kernel would otherwise read wrongly: dtypes, sizes, devices."""
    if p.device != device or m.device != device or step.device != device:
        raise ValueError(f"tensor {i}: params, momenta and steps must all be on {device}")
    if p.dtype not in FUSED_DTYPES:
        raise TypeError(
            f"tensor {i}: parameter dtype {p.dtype} is not one of {FUSED_DTYPES} "
            "(the dispatcher, hf_triaccel.optim.functional, updates the others)"
        )
    if m.dtype not in FUSED_DTYPES or m.shape != p.shape:
        raise ValueError(
            f"tensor {i}: momentum must be one of {FUSED_DTYPES} of the parameter's shape"
        )
    if step.dtype != torch.float32 or step.numel() != 1:
        raise ValueError(f"tensor {i}: step must be a one-element float32 tensor")
    if fac is not None:
        for v in (fac.g, fac.a):
            if v.device != device or v.dtype != torch.float32 or not v.is_contiguous():
                raise ValueError(f"tensor {i}: factors must be contiguous float32 on {device}")


def _memory_order(
    p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, fac: ParamFactors | None
) -> str | None:
    """How the kernel can walk the three tensors: ``"contiguous"``, ``"channels_last"``
    (its own launch: the factor index is permuted), or ``None`` (left to the caller)."""
    if p.is_contiguous() and g.is_contiguous() and m.is_contiguous():
        return "contiguous"
    cl = torch.channels_last
    if not (
        p.dim() == 4
        and g.shape == p.shape
        and p.is_contiguous(memory_format=cl)
        and g.is_contiguous(memory_format=cl)
        and m.is_contiguous(memory_format=cl)
    ):
        return None
    if fac is None:  # F = 1: an element-wise update, in whatever order memory runs
        return "contiguous"
    lay, row = fac.layout, p.shape[1] * p.shape[2] * p.shape[3]
    # the layout must be a conv weight's: g over output channels, a over the (C_in, kh, kw) row
    if lay.g_div == row and lay.a_div == 1 and lay.a_mod == row:
        return "channels_last"
    return None


def _build_group(
    members, dtypes, channels_last, params, moms, factors, steps, comps, device
) -> _Group:
    """The tensor and chunk tables of one launch, copied to ``device``."""
    rows, chunks = [], []
    for t, i in enumerate(members):
        p, m, fac = params[i], moms[i], factors[i]
        numel = p.numel()
        if fac is None:
            # F = 1: the factor loads are masked off; any valid pointer will do
            pointers, layout, has_factors = [m.data_ptr()] * 2, [1, 1, 1, 1], 0
        else:
            a_off = fac.layout.a_off * fac.a.element_size()
            pointers = [fac.g.data_ptr(), fac.a.data_ptr() + a_off]
            layout, has_factors = _layout_row(fac, numel, i), 1
        inner, outer = (p.shape[1], p.shape[2] * p.shape[3]) if channels_last else (1, 1)
        rows.append([p.data_ptr(), m.data_ptr(), steps[i].data_ptr(), *pointers, numel, *layout])
        comp = m if comps[i] is None else comps[i]
        rows[-1] += [has_factors, inner, outer, comp.data_ptr()]
        chunks.append(_chunk_rows(t, numel, layout))
    chunk_table = torch.cat(chunks)
    return _Group(
        members=members,
        numels=[row[5] for row in rows],
        param_dtype=_TL_DTYPES[dtypes[0]],
        grad_dtype=_TL_DTYPES[dtypes[1]],
        mom_dtype=_TL_DTYPES[dtypes[2]],
        channels_last=channels_last,
        tensor_table=_to_device(torch.tensor(rows, dtype=torch.int64), device),
        chunk_table=_to_device(chunk_table, device),
        n_chunks=chunk_table.shape[0],
        aligned=all(row[0] % _ALIGN == 0 and row[1] % _ALIGN == 0 for row in rows),
    )


def _build_plan(params, grads, moms, factors, steps, comps, grad_signature) -> _Plan:
    """Validates the tensors and groups them by dtypes and memory order (tensors in
    other layouts aside)."""
    device = params[0].device
    by_kind: dict[tuple[tuple[torch.dtype, ...], bool], list[int]] = {}
    fallback = []
    for i, (p, g, m, fac, step) in enumerate(zip(params, grads, moms, factors, steps, strict=True)):
        _check(i, p, m, fac, step, device)
        comp = comps[i]
        if comp is not None and (comp.dtype != p.dtype or comp.device != device):
            raise ValueError(f"tensor {i}: the compensation must be {p.dtype} on {device}")
        if g.dtype not in _TL_DTYPES:
            raise TypeError(f"tensor {i}: unsupported gradient dtype {g.dtype}")
        order = _memory_order(p, g, m, fac)
        if order is None or (comp is not None and comp.stride() != p.stride()):
            fallback.append(i)
        elif p.numel():
            kind = ((p.dtype, g.dtype, m.dtype), order == "channels_last")
            by_kind.setdefault(kind, []).append(i)
    groups = [
        _build_group(members, dtypes, cl, params, moms, factors, steps, comps, device)
        for (dtypes, cl), members in by_kind.items()
    ]
    _STATS["plans"] += 1
    keep_alive = [f for f in factors if f is not None]
    return _Plan(device, groups, tuple(fallback), grad_signature, keep_alive)


def _load_grads(plan: _Plan, grads: list[torch.Tensor], grad_ptrs: tuple[int, ...]) -> None:
    """(Re)builds the gradient pointer tables: gradients may be new tensors each step."""
    for group in plan.groups:
        for i, numel in zip(group.members, group.numels, strict=True):
            g = grads[i]
            if g.device != plan.device or g.numel() != numel:
                raise ValueError(f"tensor {i}: gradient must match its parameter's size and device")
        ptrs = [grad_ptrs[i] for i in group.members]
        group.grad_table = _to_device(torch.tensor(ptrs, dtype=torch.int64), plan.device)
        group.grads_aligned = all(ptr % _ALIGN == 0 for ptr in ptrs)
    plan.grad_ptrs = grad_ptrs
    _STATS["grad_tables"] += 1


def _get_plan(params, grads, moms, factors, steps, comps) -> _Plan:
    """The cached plan for these tensors, built or updated as needed."""
    key = _plan_key(params, moms, factors, steps, comps)
    grad_ptrs = tuple(map(_data_ptr, grads))
    plan = _PLANS.get(key)
    if plan is not None:
        _PLANS.move_to_end(key)
        if grad_ptrs == plan.grad_ptrs:
            return plan  # the steady state: nothing to check or copy
    signature = _grad_signature(grads)
    if plan is None or signature != plan.grad_signature:
        plan = _PLANS[key] = _build_plan(params, grads, moms, factors, steps, comps, signature)
        if len(_PLANS) > _MAX_PLANS:
            _PLANS.popitem(last=False)
    _load_grads(plan, grads, grad_ptrs)
    return plan


def _on_device(device: torch.device) -> contextlib.AbstractContextManager:
    """Triton launches on the current CUDA device: make it the params' one."""
    if device.type == "cuda" and device.index != torch.cuda.current_device():
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def cache_info() -> dict[str, int]:
    """How many table sets are cached, and how many were built since the last clear."""
    return {"cached": len(_PLANS), **_STATS}


def clear_cache() -> None:
    """Drops every cached table (they are rebuilt on the next call)."""
    _PLANS.clear()
    for k in _STATS:
        _STATS[k] = 0


def _launch(
    plan: _Plan, lr, beta, weight_decay, damping, decoupled, maximize, rounding, seed
) -> tuple[int, ...]:
    """Runs one step with ``plan``'s tables; returns the positions it left alone."""
    lr_is_tensor = isinstance(lr, torch.Tensor)
    if lr_is_tensor and lr.device != plan.device:
        raise ValueError(f"a tensor lr must be on the params' device ({plan.device})")
    decay = bool(weight_decay)
    constexprs = (lr_is_tensor, bool(maximize), decay and not decoupled, decay and decoupled)
    lr_ptr = lr.data_ptr() if lr_is_tensor else None
    rounding_code = ROUNDING_CODES[rounding]
    # 31 bits: Triton passes a Python int below 2**31 as int32 whatever its value
    scalars = (float(beta), 1.0 - beta, float(weight_decay), float(damping), seed & 0x7FFFFFFF)
    direct = direct_launch_supported(plan.device)
    with _on_device(plan.device):
        for group in plan.groups:
            aligned = group.aligned and group.grads_aligned
            tables = (group.tensor_table, group.grad_table, group.chunk_table)
            # direct launches pass addresses (see launch_compiled); the compiled code is
            # specialised on the constexprs and on the pointers' 16-byte alignment
            ptrs = [t.data_ptr() for t in tables]
            # a float32 weight is stored as computed: nothing to compensate or round
            code = rounding_code if group.param_dtype != tl.float32 else 0
            key = (*constexprs, code, aligned, *(p % 16 == 0 for p in ptrs))
            if lr_is_tensor:
                key += (lr_ptr % 16 == 0,)
            compiled = group.compiled.get(key)
            if compiled is not None:
                dtypes = (group.param_dtype, group.grad_dtype, group.mom_dtype, code)
                meta = (*dtypes, *constexprs, aligned)
                args = [*ptrs, 0.0 if lr_is_tensor else float(lr), lr_ptr, *scalars, *meta]
                launch_compiled(compiled, (group.n_chunks,), [*args, group.channels_last, BLOCK])
                continue
            handle = _adafisher_kernel[(group.n_chunks,)](
                *tables,
                0.0 if lr_is_tensor else float(lr),
                lr if lr_is_tensor else None,
                *scalars,
                PARAM_DTYPE=group.param_dtype,
                GRAD_DTYPE=group.grad_dtype,
                MOM_DTYPE=group.mom_dtype,
                ROUNDING=code,
                LR_IS_TENSOR=lr_is_tensor,
                MAXIMIZE=bool(maximize),
                L2_DECAY=decay and not decoupled,
                DECOUPLED_DECAY=decay and decoupled,
                ALIGNED=aligned,
                CHANNELS_LAST=group.channels_last,
                BLOCK=BLOCK,
                num_warps=NUM_WARPS,
            )
            if direct:
                group.compiled[key] = compiled_kernel(handle)
    return plan.fallback


def fused_adafisher(
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
    comps: list[torch.Tensor | None] | None = None,
    rounding: str = "nearest",
    seed: int = 0,
) -> tuple[int, ...]:
    """Applies one AdaFisher step in place with one kernel launch per dtype group.

    Arguments are those of :func:`hf_triaccel.optim.functional.adafisher` (which
    validates the hyper-parameters and routes the tensors): contiguous and
    channels-last tensors are updated by the fused kernel; tensors in other layouts
    are left unchanged and their positions returned. The first call for a set of
    tensors builds and caches the device tables; later calls only launch, so a call
    after that first one can be captured in a CUDA graph.

    Args:
        params: parameters on one device, of the :data:`FUSED_DTYPES`.
        grads: their gradients (same sizes; any of those dtypes).
        moms: momentum buffers of the :data:`FUSED_DTYPES` (the arithmetic is float32).
        factors: per parameter, its :class:`ParamFactors` or ``None`` (F = 1).
        steps: per parameter, a one-element float32 tensor, already incremented.
        lr: learning rate: a float, or a one-element tensor on the params' device
            (read by the kernel, so it may change between CUDA-graph replays).
        beta: momentum coefficient.
        weight_decay: L2 (``decoupled=False``) or decoupled weight decay.
        damping: added to every preconditioner entry.
        decoupled: AdaFisherW's decoupled weight decay.
        maximize: ascend instead of descend (the gradient's sign is flipped).
        comps: per parameter, its Kahan compensation buffer (``rounding="kahan"``).
        rounding: ``"nearest"``, ``"kahan"`` or ``"stochastic"`` (bfloat16 weights).
        seed: the random stream of stochastic rounding.

    Returns:
        The positions of the tensors left unchanged (a memory layout the kernel cannot
        walk), for the caller to update; usually empty.

    Raises:
        TypeError: a parameter dtype outside :data:`FUSED_DTYPES`.
        ValueError: mismatched sizes, dtypes or devices, or a layout that reads past
            its factor vectors (checked when tables are built).
    """
    if not params:
        return ()
    comps = [None] * len(params) if comps is None else comps
    plan = _get_plan(params, grads, moms, factors, steps, comps)
    args = (lr, beta, weight_decay, damping, decoupled, maximize, rounding, seed)
    return _launch(plan, *args)


class FusedAdaFisher:
    """:func:`fused_adafisher` bound to one fixed set of tensors.

    For a caller that steps the same tensors every time and owns them (the optimizer):
    where :func:`fused_adafisher` keys its cached tables on every pointer they encode,
    a call here checks only what can change behind the caller's back, the addresses of
    the parameters (a model moved or cast) and of the gradients (new gradient tensors
    after ``zero_grad(set_to_none=True)``). The caller builds a new one when it
    reallocates momenta or steps, or when factor vectors move.

    Args:
        params: parameters on one device.
        moms: their float32 momentum buffers.
        factors: per parameter, its :class:`ParamFactors` or ``None`` (F = 1).
        steps: per parameter, a one-element float32 step tensor.
        comps: per parameter, its Kahan compensation buffer (``rounding="kahan"``).
        rounding: ``"nearest"``, ``"kahan"`` or ``"stochastic"``.

    Example:
        >>> p, m = torch.ones(3), torch.zeros(3)
        >>> update = FusedAdaFisher([p], [m], [None], [torch.ones(())])
        >>> update([torch.full((3,), 0.5)], lr=0.1, beta=0.9, weight_decay=0.0,
        ...        damping=1e-3, decoupled=False)  # doctest: +SKIP
        ()
    """

    def __init__(
        self,
        params: list[torch.Tensor],
        moms: list[torch.Tensor],
        factors: list[ParamFactors | None],
        steps: list[torch.Tensor],
        *,
        comps: list[torch.Tensor | None] | None = None,
        rounding: str = "nearest",
    ) -> None:
        if not (len(params) == len(moms) == len(factors) == len(steps)) or not params:
            raise ValueError("params, moms, factors and steps must be non-empty and match")
        if rounding not in ROUNDING_CODES:
            raise ValueError(f"rounding={rounding!r}: must be one of {tuple(ROUNDING_CODES)}")
        self.comps = [None] * len(params) if comps is None else list(comps)
        self.rounding = rounding
        self.params = list(params)
        self.moms = list(moms)
        self.factors = list(factors)
        self.steps = list(steps)
        self._plan: _Plan | None = None
        self._param_ptrs: tuple[int, ...] | None = None

    def __call__(
        self,
        grads: list[torch.Tensor],
        *,
        lr: float | torch.Tensor,
        beta: float,
        weight_decay: float,
        damping: float,
        decoupled: bool,
        maximize: bool = False,
        seed: int = 0,
    ) -> tuple[int, ...]:
        """One step with these gradients (one per parameter, same order); arguments and
        result as for :func:`fused_adafisher`."""
        if len(grads) != len(self.params):
            raise ValueError(f"expected {len(self.params)} gradients, got {len(grads)}")
        param_ptrs = tuple(map(_data_ptr, self.params))
        grad_ptrs = tuple(map(_data_ptr, grads))
        plan = self._plan
        moved = plan is None or param_ptrs != self._param_ptrs
        if moved or (grad_ptrs != plan.grad_ptrs and _grad_signature(grads) != plan.grad_signature):
            args = (self.params, grads, self.moms, self.factors, self.steps, self.comps)
            plan = self._plan = _build_plan(*args, _grad_signature(grads))
            self._param_ptrs = param_ptrs
        if grad_ptrs != plan.grad_ptrs:
            _load_grads(plan, grads, grad_ptrs)
        args = (lr, beta, weight_decay, damping, decoupled, maximize, self.rounding, seed)
        return _launch(plan, *args)

    @property
    def launches(self) -> list[tuple[torch.dtype, torch.dtype, bool, int]]:
        """Per kernel launch of the last call: (parameter dtype, gradient dtype,
        channels-last, number of tensors)."""
        if self._plan is None:
            return []
        return [
            (
                _TORCH_DTYPES[g.param_dtype],
                _TORCH_DTYPES[g.grad_dtype],
                g.channels_last,
                len(g.members),
            )
            for g in self._plan.groups
        ]
