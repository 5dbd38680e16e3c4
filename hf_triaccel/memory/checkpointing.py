"""Activation checkpointing of a model's largest blocks, applied and removed at run time.

The last resort of the elastic batch controller before it gives up: a checkpointed
block keeps only its inputs during the forward and recomputes its activations in the
backward, trading one extra forward of that block for its activation memory.

Blocks are the repeated units of a model: the children of ``nn.Sequential`` and
``nn.ModuleList`` containers (transformer layers, ResNet blocks), or the root's
children when a model has no container. They are ranked by parameter count, a proxy
for their compute and activation size.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase
from torch.utils.checkpoint import checkpoint

_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)
_MARK = "_hf_triaccel_checkpointed"


def _num_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def find_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's repeated blocks, in ``named_modules()`` order.

    Example:
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> [name for name, _ in find_blocks(model)]
        ['0', '1', '2']
    """
    blocks = []
    for parent_name, parent in model.named_modules():
        if not isinstance(parent, (nn.Sequential, nn.ModuleList)):
            continue
        for child_name, child in parent.named_children():
            if not isinstance(child, _CONTAINERS):
                blocks.append((f"{parent_name}.{child_name}" if parent_name else child_name, child))
    if not blocks:
        blocks = [(n, m) for n, m in model.named_children() if not isinstance(m, _CONTAINERS)]
    return blocks


class _KeepRunningStats:
    """Recompute context that undoes the recompute's second update of BatchNorm running
    statistics, so that each sample updates them once, as without checkpointing."""

    def __init__(self, norms: list[_NormBase]) -> None:
        self.buffers = [
            b
            for m in norms
            for b in (m.running_mean, m.running_var, m.num_batches_tracked)
            if b is not None
        ]
        self.saved: list[torch.Tensor] = []

    def __enter__(self) -> None:
        self.saved = [b.clone() for b in self.buffers]

    def __exit__(self, *exc: object) -> None:
        with torch.no_grad():
            for buffer, saved in zip(self.buffers, self.saved, strict=True):
                buffer.copy_(saved)
        self.saved = []


def _contexts(norms: list[_NormBase]) -> tuple[contextlib.AbstractContextManager, Any]:
    return contextlib.nullcontext(), _KeepRunningStats(norms)


def _checkpointed(
    module: nn.Module, original: Callable[..., Any], preserve_rng_state: bool
) -> Callable[..., Any]:
    norms = [m for m in module.modules() if isinstance(m, _NormBase) and m.track_running_stats]
    extra = {"context_fn": functools.partial(_contexts, norms)} if norms else {}

    def forward(*args: Any, **kwargs: Any) -> Any:
        # evaluation and no-grad passes store no activations: nothing to save there
        if not (module.training and torch.is_grad_enabled()):
            return original(*args, **kwargs)
        return checkpoint(
            original,
            *args,
            use_reentrant=False,
            preserve_rng_state=preserve_rng_state,
            **extra,
            **kwargs,
        )

    setattr(forward, _MARK, True)
    return forward


class CheckpointedBlocks:
    """The blocks :func:`checkpoint_largest_blocks` wrapped; :meth:`remove` unwraps them.

    Attributes:
        names: the wrapped blocks' names (as in ``named_modules()``), largest first.
    """

    def __init__(self) -> None:
        self.names: list[str] = []
        # (module, the wrapper, the instance-level forward it replaced, if any)
        self._wrapped: list[tuple[nn.Module, Callable[..., Any], Callable[..., Any] | None]] = []

    def _wrap(self, name: str, module: nn.Module, preserve_rng_state: bool) -> None:
        previous = module.__dict__.get("forward")
        wrapper = _checkpointed(module, module.forward, preserve_rng_state)
        module.forward = wrapper
        self.names.append(name)
        self._wrapped.append((module, wrapper, previous))

    def remove(self) -> None:
        """Restores every wrapped block's forward (safe to call twice)."""
        for module, wrapper, previous in reversed(self._wrapped):
            if module.__dict__.get("forward") is not wrapper:
                continue  # replaced again since: leave the newer wrapper in place
            if previous is None:
                del module.__dict__["forward"]
            else:
                module.forward = previous
        self._wrapped.clear()
        self.names = []

    def __len__(self) -> int:
        return len(self._wrapped)

    def __enter__(self) -> CheckpointedBlocks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        return f"CheckpointedBlocks({self.names})"


def checkpoint_largest_blocks(
    model: nn.Module, n: int | None = None, *, preserve_rng_state: bool = True
) -> CheckpointedBlocks:
    """Wraps the forward of the ``n`` largest blocks with ``torch.utils.checkpoint``.

    Blocks come from :func:`find_blocks`, ranked by parameter count; a block nested in
    one already chosen is skipped (its activations are already recomputed), and so is
    a block that is already checkpointed. Checkpointing is non-reentrant, keeps the
    RNG state (dropout masks repeat exactly), applies only in training mode with
    autograd on, and keeps BatchNorm running statistics updated once per sample.
    Gradients are unchanged.

    Args:
        model: the model (unwrapped: not the DDP wrapper).
        n: how many blocks (default: all of them).
        preserve_rng_state: replay the RNG state in the recompute; ``False`` is
            faster for models without dropout.

    Returns:
        A :class:`CheckpointedBlocks` handle; ``remove()`` restores the model.

    Example:
        >>> model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 8))
        >>> handle = checkpoint_largest_blocks(model, 1)
        >>> handle.names
        ['0']
        >>> handle.remove()
    """
    if n is not None and n < 1:
        raise ValueError(f"n={n} must be >= 1 (or None for every block)")
    ranked = sorted(find_blocks(model), key=lambda item: -_num_params(item[1]))
    handle = CheckpointedBlocks()
    for name, module in ranked:
        if n is not None and len(handle) >= n:
            break
        if _num_params(module) == 0 or getattr(module.forward, _MARK, False):
            continue
        if any(_nested(name, other) for other in handle.names):
            continue
        handle._wrap(name, module, preserve_rng_state)
    return handle


def _nested(a: str, b: str) -> bool:
    """Whether module names ``a`` and ``b`` are the same or one contains the other."""
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")
