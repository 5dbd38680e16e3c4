"""Batches as the elastic controller cuts them: nested containers of per-sample values,
sliced into pieces, and each piece's share of the batch.

Containers are walked with :mod:`torch.utils._pytree` (dicts, lists, tuples, named
tuples). A top-level mapping of another kind (transformers' ``BatchEncoding``) is read
as a ``dict``; deeper mappings of other kinds are passed whole. A list or tuple that
holds no tensor is one value: the batch's samples when its length is the batch size
(a list of strings), sliced like a tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.utils import _pytree as pytree

Batch = Any  # a tensor, a mapping of tensors, or a tuple / list of them


def _walkable(batch: Batch) -> Batch:
    if isinstance(batch, Mapping) and type(batch) not in pytree.SUPPORTED_NODES:
        return dict(batch)
    return batch


def _is_sample_list(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and not any(
        isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(value)
    )


def batch_size(batch: Batch) -> int:
    """Number of samples: the leading size of the batch's first tensor.

    Example:
        >>> batch_size({"input_ids": torch.zeros(6, 3), "labels": torch.zeros(6)})
        6
    """
    for leaf in pytree.tree_leaves(_walkable(batch)):
        if isinstance(leaf, torch.Tensor) and leaf.dim() >= 1:
            return leaf.shape[0]
    raise ValueError(f"the batch holds no tensor with a batch dimension: {type(batch).__name__}")


def slice_batch(batch: Batch, start: int, stop: int, n: int | None = None) -> Batch:
    """Samples ``start:stop`` of a batch of ``n`` samples (default: :func:`batch_size`).

    Tensors whose leading size is ``n`` are sliced along dim 0, and so are lists of
    ``n`` non-tensor items (see the module doc); anything else is passed whole.

    Example:
        >>> piece = slice_batch({"x": torch.arange(6), "scale": 2.0}, 2, 4)
        >>> piece["x"].tolist(), piece["scale"]
        ([2, 3], 2.0)
    """
    batch = _walkable(batch)
    n = batch_size(batch) if n is None else n

    def cut(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value[start:stop] if value.dim() >= 1 and value.shape[0] == n else value
        if isinstance(value, (list, tuple)) and len(value) == n:
            return value[start:stop]
        return value

    return pytree.tree_map(cut, batch, is_leaf=_is_sample_list)


def piece_weight(
    piece: Batch,
    size: int,
    n: int,
    count: Callable[[Batch], int | torch.Tensor] | None = None,
    total: int | torch.Tensor | None = None,
) -> float | torch.Tensor:
    """A piece's share of its batch, the weight of its mean loss in the batch's mean.

    ``size / n`` for losses averaged over samples; ``count(piece) / total`` for losses
    averaged over other items (tokens), in float64 when the counts are tensors (their
    integer division would round to float32).

    Example:
        >>> piece_weight(None, 3, 12)
        0.25
        >>> labels = torch.tensor([[1, -100], [2, 3]])
        >>> piece_weight(labels[:1], 1, 2, lambda b: (b != -100).sum(), torch.tensor(3)).item()
        0.3333333333333333
    """
    if count is None:
        return size / n
    part = count(piece)
    if torch.is_tensor(part) or torch.is_tensor(total):
        return torch.as_tensor(part, dtype=torch.float64) / torch.as_tensor(
            total, dtype=torch.float64
        )
    return part / total
