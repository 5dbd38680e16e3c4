"""Data-parallel agreement for the elastic batch: one micro-batch over all ranks, and DDP's
collectives kept matched when a step is re-run.

Ranks agree on the micro-batch with an all-reduce MIN, so that every rank runs the same
number of pieces and the same collectives. Under ``DistributedDataParallel`` only the
last piece of a step synchronises gradients; an out-of-memory error in that backward
cannot be re-run (the all-reduce was partly launched), and a re-run must not repeat the
buffer broadcast of the step's first forward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hf_triaccel.curvature.collection.sharding import is_sharded


def agree_min(value: int, process_group: Any = None) -> int:
    """The smallest ``value`` over the ranks of ``process_group`` (``value`` itself when
    ``torch.distributed`` is not initialised). Every rank must call it.

    Example:
        >>> agree_min(5)
        5
    """
    if not (dist.is_available() and dist.is_initialized()):
        return value
    if dist.get_world_size(process_group) == 1:
        return value
    backend = dist.get_backend(process_group)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else "cpu"
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=process_group)
    return int(tensor.item())


def sharded_over_processes(model: nn.Module) -> bool:
    """Whether ``model`` has parameters sharded by FSDP2 (DTensors) while several processes
    run: its forward and backward then gather parameters with the other processes, so
    one process cannot re-run a step alone.

    Example:
        >>> sharded_over_processes(nn.Linear(2, 2))
        False
    """
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return False
    return any(is_sharded(p) for p in model.parameters())


def syncs_gradients(model: nn.Module) -> bool:
    """Whether a backward through ``model`` now all-reduces gradients (DDP, sync on).

    Example:
        >>> syncs_gradients(nn.Linear(2, 2))
        False
    """
    return (
        getattr(model, "require_backward_grad_sync", False)
        and dist.is_available()
        and dist.is_initialized()
        and dist.get_world_size() > 1
    )


class DDPBufferSync:
    """Keeps a re-run step to the one buffer broadcast DDP makes per step.

    DDP broadcasts module buffers in the first forward after a synchronised backward.
    If the failed attempt already entered that forward, the re-run must not broadcast
    again: the other ranks would wait on a collective this rank never matches. Does
    nothing for a model that is not a DDP wrapper broadcasting buffers.

    Example:
        >>> sync = DDPBufferSync(nn.Linear(2, 2))
        >>> sync.before_retry(); sync.close()
    """

    def __init__(self, model: nn.Module) -> None:
        will_sync = getattr(model, "will_sync_module_buffers", None)
        self.model = model if callable(will_sync) and will_sync() else None
        self.entered = False
        self._handle = (
            model.register_forward_pre_hook(self._enter) if self.model is not None else None
        )

    def _enter(self, module: nn.Module, args: Any) -> None:
        self.entered = True

    def before_retry(self) -> None:
        """Turns the next forward's buffer broadcast off when this step already made it."""
        if self.model is not None and self.entered:
            self.model.require_forward_param_sync = False

    def close(self) -> None:
        """Removes the hook."""
        if self._handle is not None:
            self._handle.remove()
