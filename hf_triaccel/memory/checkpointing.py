"""Activation checkpointing switched on and off at run time.

The last resort of the elastic batch controller before it gives up: a checkpointed
block keeps only its inputs during the forward and recomputes its activations in the
backward, trading one extra forward of that block for its activation memory.

:func:`enable_activation_checkpointing` uses the model's own switch when it has one
(transformers' ``activation_checkpointing_enable`` / ``gradient_checkpointing_enable``,
timm's ``set_grad_checkpointing``), and otherwise wraps the model's largest blocks here
(:func:`checkpoint_largest_blocks`).

Blocks are the repeated units of a model: the children of ``nn.Sequential`` and
``nn.ModuleList`` containers (transformer layers, ResNet blocks), or the root's
children when a model has no container. They are ranked by parameter count, a proxy
for their compute and activation size.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from hf_triaccel.memory.rollback import RunningStatsRollback

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


def _checkpointed(
    module: nn.Module, original: Callable[..., Any], preserve_rng_state: bool
) -> Callable[..., Any]:
    # the recompute runs BatchNorm layers a second time: their running statistics are
    # restored after it, so that each sample updates them once, as without checkpointing
    rollback = RunningStatsRollback(module)

    def contexts() -> tuple[contextlib.AbstractContextManager, RunningStatsRollback]:
        return contextlib.nullcontext(), rollback

    def forward(*args: Any, **kwargs: Any) -> Any:
        # evaluation and no-grad passes store no activations: nothing to save there
        if not (module.training and torch.is_grad_enabled()):
            return original(*args, **kwargs)
        return checkpoint(
            original,
            *args,
            use_reentrant=False,
            preserve_rng_state=preserve_rng_state,
            context_fn=contexts,
            **kwargs,
        )

    setattr(forward, _MARK, True)
    return forward


class CheckpointedBlocks:
    """What :func:`checkpoint_largest_blocks` or :func:`enable_activation_checkpointing`
    switched on; :meth:`remove` switches it off again.

    Attributes:
        names: the blocks wrapped here (as in ``named_modules()``), largest first; empty
            when the model's own checkpointing was used.
        method: ``"blocks"`` (wrapped here) or the model's own method that was called.
    """

    def __init__(self, method: str = "blocks", undo: Callable[[], object] | None = None) -> None:
        self.names: list[str] = []
        self.method = method
        self._undo = undo
        # (module, the wrapper, the instance-level forward it replaced, if any)
        self._wrapped: list[tuple[nn.Module, Callable[..., Any], Callable[..., Any] | None]] = []

    def _wrap(self, name: str, module: nn.Module, preserve_rng_state: bool) -> None:
        previous = module.__dict__.get("forward")
        wrapper = _checkpointed(module, module.forward, preserve_rng_state)
        module.forward = wrapper
        self.names.append(name)
        self._wrapped.append((module, wrapper, previous))

    def remove(self) -> None:
        """Restores every wrapped block's forward, or switches the model's own
        checkpointing off when it was switched on here (safe to call twice)."""
        if self._undo is not None:
            self._undo()
            self._undo = None
        for module, wrapper, previous in reversed(self._wrapped):
            if module.__dict__.get("forward") is not wrapper:
                continue  # replaced again since: leave the newer wrapper in place
            if previous is None:
                del module.__dict__["forward"]
            else:
                module.forward = previous
        self._wrapped.clear()
        self.names = []

    @property
    def switched_on(self) -> bool:
        """Whether this handle switched checkpointing on (``False`` when the model's own
        was already on: then :meth:`remove` leaves it on)."""
        return bool(self._wrapped) or self._undo is not None

    def __len__(self) -> int:
        return len(self._wrapped)

    def __enter__(self) -> CheckpointedBlocks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        return f"CheckpointedBlocks({self.names if self.method == 'blocks' else self.method})"


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


def _own_switch(model: nn.Module) -> tuple[str, Callable[[bool], object], bool] | None:
    """The model's own activation checkpointing: (method name, a setter, whether it is
    on now), or ``None``."""
    # transformers 5 names first: there the 4.x names are deprecated aliases
    for on, off, state in (
        (
            "activation_checkpointing_enable",
            "activation_checkpointing_disable",
            "is_activation_checkpointing",
        ),
        (
            "gradient_checkpointing_enable",
            "gradient_checkpointing_disable",
            "is_gradient_checkpointing",
        ),
    ):
        if hasattr(model, on) and getattr(model, "supports_gradient_checkpointing", False):

            def set_(enable: bool, on: str = on, off: str = off) -> object:
                return getattr(model, on if enable else off)()

            return on, set_, bool(getattr(model, state, False))
    if callable(getattr(model, "set_grad_checkpointing", None)):  # timm
        return (
            "set_grad_checkpointing",
            model.set_grad_checkpointing,
            bool(getattr(model, "grad_checkpointing", False)),
        )
    return None


def enable_activation_checkpointing(
    model: nn.Module, n: int | None = None, *, preserve_rng_state: bool = True
) -> CheckpointedBlocks:
    """Switches activation checkpointing on: the model's own, else its largest blocks.

    The model's own switch knows its layers and their arguments (attention masks, caches):
    transformers' ``activation_checkpointing_enable`` (``gradient_checkpointing_enable``
    in older releases) on a model that supports it, or timm's ``set_grad_checkpointing``.
    A model without one, or whose switch refuses (some timm models assert), gets
    :func:`checkpoint_largest_blocks`. Already on: nothing changes, and ``remove()``
    leaves it on. The model's own recompute may update BatchNorm running statistics a
    second time (timm's does); the blocks wrapped here update them once.

    Args:
        model: the model (unwrapped: not the DDP wrapper).
        n: how many blocks :func:`checkpoint_largest_blocks` wraps, when it is used
            (default: all of them); the model's own switch takes no count.
        preserve_rng_state: passed to :func:`checkpoint_largest_blocks`.

    Returns:
        A :class:`CheckpointedBlocks` handle; ``remove()`` switches it off.

    Example:
        >>> import timm
        >>> model = timm.create_model("resnet10t")
        >>> handle = enable_activation_checkpointing(model)
        >>> handle.method, model.grad_checkpointing
        ('set_grad_checkpointing', True)
        >>> handle.remove(); model.grad_checkpointing
        False
        >>> enable_activation_checkpointing(nn.Sequential(nn.Linear(4, 4))).names
        ['0']
    """
    own = _own_switch(model)
    if own is not None:
        method, set_, already = own
        if already:
            return CheckpointedBlocks(method)
        try:
            set_(True)
        except (AssertionError, NotImplementedError, ValueError):
            pass  # not supported by this model: wrap its blocks here
        else:
            return CheckpointedBlocks(method, undo=lambda: set_(False))
    return checkpoint_largest_blocks(model, n, preserve_rng_state=preserve_rng_state)
