"""Parameters sharded by rows (FSDP2): the rows a process holds and the factor slice they read.

``torch.distributed.fsdp.fully_shard`` stores each parameter as a DTensor sharded by rows
(placement ``Shard(0)``) with ``torch.chunk``'s split: each process of a mesh dimension of
size ``W`` holds ``ceil(rows / W)`` consecutive rows, the last ones fewer or none. A
process updates only its own rows, so it needs the factor entries those rows read: for a
weight stored ``(out, in)`` the slice ``[start, stop)`` of ``g`` and the whole of ``a``;
for one stored ``(in, out)`` (an embedding) the slice of ``a``; for a vector (a bias, a
normalisation affine) the slice of ``g``. :func:`local_factors` returns those slices as
views of the full factor vectors, so that a fold, which writes the full vectors in
place, reaches every slice.

Every process keeps the full factor vectors: statistics are taken from the unsharded
forward and backward (FSDP2 gathers parameters, not activations), summed over processes
in one all-reduce and folded identically everywhere.
"""

from __future__ import annotations

import math
import sys

import torch

from hf_triaccel._types import FactorLayout, ParamFactors

# DTensors exist only once torch.distributed.tensor is imported (by FSDP2, or by the user):
# looked up there, so that importing this package does not import it (about a second)
_DTENSOR_MODULE = "torch.distributed.tensor"


def is_sharded(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a DTensor (sharded or replicated over a device mesh).

    Example:
        >>> is_sharded(torch.zeros(2))
        False
    """
    module = sys.modules.get(_DTENSOR_MODULE)
    return module is not None and isinstance(tensor, module.DTensor)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The part of ``tensor`` this process holds (``tensor`` itself unless a DTensor).

    Example:
        >>> t = torch.zeros(2)
        >>> local_tensor(t) is t
        True
    """
    return tensor.to_local() if is_sharded(tensor) else tensor


def local_rows(param: torch.Tensor) -> tuple[int, int] | None:
    """The rows ``[start, stop)`` of ``param`` this process holds; ``None`` when ``param``
    is an ordinary tensor (every row).

    Replicated mesh dimensions keep every row; each ``Shard(0)`` dimension splits the rows
    left by the dimensions before it as ``torch.chunk`` does.

    Raises:
        ValueError: a placement other than ``Shard(0)`` and ``Replicate()`` (a parameter
            sharded along another dim, strided or partial), naming it.

    Example:
        >>> local_rows(torch.zeros(5, 3)) is None
        True
    """
    if not is_sharded(param):
        return None
    from torch.distributed.tensor import Replicate, Shard

    rows = param.shape[0] if param.dim() else 1
    mesh = param.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:  # this process is not in the mesh: it holds nothing
        return 0, 0
    start, length = 0, rows
    for mesh_dim, placement in enumerate(param.placements):
        if isinstance(placement, Replicate):
            continue
        if type(placement) is not Shard or placement.dim != 0:
            raise ValueError(
                f"a parameter of shape {tuple(param.shape)} has placement {placement}: "
                "AdaFisher takes parameters sharded by rows (Shard(0), FSDP2's default) or "
                "replicated (Replicate())"
            )
        chunk = math.ceil(length / mesh.size(mesh_dim)) if length else 0
        first = min(coordinate[mesh_dim] * chunk, length)
        start, length = start + first, min(chunk, length - first)
    held = param.to_local().shape[0] if param.dim() else 1
    if held != length:
        raise ValueError(
            f"a parameter of shape {tuple(param.shape)} holds {held} rows here, where "
            f"torch.chunk's split of its placements {param.placements} gives {length}"
        )
    return start, start + length


def _slice_of(
    div: int, mod: int, off: int, vector: torch.Tensor, row_size: int, numel: int, rows
) -> tuple[torch.Tensor, int, int, int] | None:
    """One factor's (vector, div, mod, off) for the rows ``[start, stop)`` of a parameter
    with ``numel`` elements of ``row_size`` each; ``None`` when its index pattern does not
    split by rows."""
    start, stop = rows
    if mod == 1 or row_size % (div * mod) == 0:
        return vector, div, mod, off  # constant, or repeating within every row
    if div == row_size and div * mod == numel:  # one entry per row
        return vector[off + start : off + stop], div, max(stop - start, 1), 0
    return None


def local_factors(
    factors: ParamFactors, shape: torch.Size | tuple[int, ...], rows: tuple[int, int]
) -> ParamFactors:
    """The factors that rows ``[start, stop)`` of a parameter of ``shape`` read, laid out
    for the local shard (flat element ``k`` of the shard is element
    ``start * row_size + k`` of the parameter). The vectors are views of ``factors``'.

    Raises:
        ValueError: a layout whose entries do not split by rows.

    Example:
        >>> from hf_triaccel.curvature.rules.base import out_in_layout
        >>> full = ParamFactors(torch.arange(5.0), torch.ones(3), out_in_layout(5, 3))
        >>> part = local_factors(full, (5, 3), (2, 4))  # rows 2 and 3 of a (5, 3) weight
        >>> part.g, part.layout
        (tensor([2., 3.]), FactorLayout(g_div=3, g_mod=2, a_div=1, a_mod=3, a_off=0))
    """
    row_size = math.prod(shape[1:])
    numel = math.prod(shape)
    lay = factors.layout
    g = _slice_of(lay.g_div, lay.g_mod, 0, factors.g, row_size, numel, rows)
    a = _slice_of(lay.a_div, lay.a_mod, lay.a_off, factors.a, row_size, numel, rows)
    if g is None or a is None:
        raise ValueError(
            f"factor layout {lay} of a parameter of shape {tuple(shape)} does not split by "
            "rows: its rule cannot serve a parameter sharded by rows"
        )
    layout = FactorLayout(g_div=g[1], g_mod=g[2], a_div=a[1], a_mod=a[2], a_off=a[3])
    return ParamFactors(g[0], a[0], layout)
