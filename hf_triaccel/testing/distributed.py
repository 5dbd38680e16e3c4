"""Running a function in several CPU processes joined by a gloo process group.

Example:
    A function defined at module level (the processes import it by name)::

        def rank_sum(rank: int, world: int) -> int:
            value = torch.tensor([rank])
            torch.distributed.all_reduce(value)
            return int(value)

        run_distributed(rank_sum, 2, tmp_path)  # [1, 1]
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _in_group(rank: int, fn: Callable[[int, int], Any], world: int, folder: str) -> None:
    # the processes share the machine's cores: a thread pool each would oversubscribe them,
    # and small operations would wait on each other's spinning threads
    torch.set_num_threads(1)
    init = f"file://{Path(folder) / 'init'}"
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        torch.save(fn(rank, world), Path(folder) / f"result.{rank}")
        # no rank tears its connections down while another still uses them: gloo aborts
        # the process whose peer went away mid-operation
        dist.barrier()
    finally:
        dist.destroy_process_group()
        # nor does a rank exit, closing its sockets, while another is still tearing down
        _meet(Path(folder), rank, world)


def _meet(folder: Path, rank: int, world: int, timeout: float = 30.0) -> None:
    """Waits (at most ``timeout`` seconds) until every rank has called this, through
    marker files: the process group is gone by then."""
    (folder / f"done.{rank}").touch()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all((folder / f"done.{r}").exists() for r in range(world)):
            return
        time.sleep(0.01)


def run_distributed(fn: Callable[[int, int], Any], world: int, folder: str | Path) -> list[Any]:
    """Runs ``fn(rank, world)`` in ``world`` spawned processes, every one in a gloo process
    group and computing on one thread, and returns what each rank returned, in rank order.

    Args:
        fn: a module-level function (the spawned processes import it by name); what it
            returns must be saveable with ``torch.save`` and loadable with
            ``weights_only=True`` (tensors, numbers, strings, lists, tuples, dicts).
        world: the number of processes.
        folder: an empty folder for the group's rendezvous file and the results.
    """
    mp.spawn(_in_group, args=(fn, world, str(folder)), nprocs=world, join=True)
    return [torch.load(Path(folder) / f"result.{rank}", weights_only=True) for rank in range(world)]
