"""The tensors inside a module's inputs and outputs: the one walker the precision hooks
use, and the casts built on it.

Inputs and outputs nest tensors in tuples (named ones too), lists and dicts (transformers'
``ModelOutput`` among them). This walker is hand-written rather than
``torch.utils._pytree``'s, for host time: it runs in the forward hooks of every module
whose precision differs from the surrounding autocast, on steps bound by host time. It
also walks dict subclasses that torch's pytree does not know (their copy is updated in
place).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

import torch

HALF = (torch.float16, torch.bfloat16)

# Measured reason for not using torch.utils._pytree: mapping and collecting the tensors of
# a hook's small containers takes a fraction of tree_map_only's / tree_leaves' host time
# (BENCHMARKS.md, "Container walker of the precision hooks": figures and commands).


def tensors(obj: Any) -> Iterator[torch.Tensor]:
    """The tensors in ``obj``, depth first.

    Example:
        >>> [t.tolist() for t in tensors(([torch.ones(1)], {"x": torch.zeros(1)}, "text"))]
        [[1.0], [0.0]]
    """
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            yield from tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from tensors(item)


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``obj`` with ``fn`` applied to each of its tensors, containers (named tuples, dict
    subclasses such as ModelOutput) keeping their type.

    Example:
        >>> map_tensors({"x": torch.ones(2), "n": 3}, lambda t: t * 2)
        {'x': tensor([2., 2.]), 'n': 3}
    """
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple):
        items = [map_tensors(x, fn) for x in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    if isinstance(obj, list):
        return [map_tensors(x, fn) for x in obj]
    if isinstance(obj, dict):
        out = copy.copy(obj)
        for key, value in obj.items():
            out[key] = map_tensors(value, fn)
        return out
    return obj


def cast_floating(obj: Any, source: tuple[torch.dtype, ...], dtype: torch.dtype) -> Any:
    """``obj`` with its tensors of a ``source`` dtype cast to ``dtype``.

    Example:
        >>> cast_floating((torch.ones(1, dtype=torch.float16),), HALF, torch.float32)[0].dtype
        torch.float32
    """
    return map_tensors(obj, lambda t: t.to(dtype) if t.dtype in source else t)


def to_float32(obj: Any) -> Any:
    """``obj`` with its half-precision floating tensors cast to float32."""
    return cast_floating(obj, HALF, torch.float32)


def float32_sum(obj: Any) -> torch.Tensor | None:
    """Sum of every floating tensor in ``obj``, in float32 (``None`` when there is none).

    Example:
        >>> float32_sum((torch.ones(2, dtype=torch.float16), torch.arange(3)))
        tensor(2.)
    """
    total = None
    for t in tensors(obj):
        if t.is_floating_point():
            s = t.detach().sum(dtype=torch.float32)
            total = s if total is None else total + s.to(total.device)
    return total
