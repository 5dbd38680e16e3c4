"""One optimizer step's statistics, made ready to fold: averaged over its micro-batches and
over the data-parallel processes.

Each layer's activation statistics wait in slots, one per confirmed micro-batch; they are
merged into the first slot (``a_sum``), the entries a rule leaves to the fold (the bias
column, a norm layer's size entry) are written, and the sums are divided by the counts.
When ``torch.distributed`` runs more than one process (DDP, FSDP2), the sums and counts
are first added over the processes in one all-reduce per device.

Under data parallelism each process's loss is a mean over its own share of the batch, so
its output gradients are ``world_size`` times those of the global-batch loss: gradient
statistics are divided by ``world_size**2``, which makes Linear and Conv factors equal to
a single process's on the global batch. (Normalisation layers' statistics are squares of
batch sums: they are averaged over processes, as a single process averages them over
micro-batches, and are not equal to those of one forward of the global batch.)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hf_triaccel.curvature.layer import LayerFactors


def average_statistics(ready: list[LayerFactors]) -> float:
    """Turns the ``ready`` layers' sums into the step's averages, in place (``a_sum``,
    ``g_sum``); returns what the gradient statistics must still be divided by
    (``world_size**2`` under data parallelism, else 1).

    Every process must call it with the same layers, in the same order.
    """
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    merge_slots(ready)
    write_last_entries(ready, force=distributed)
    if distributed:
        return average_over_processes(ready)
    # averages over micro-batches: nothing to do for the usual single one
    several = [ly for ly in ready if ly.a_count > 1 or ly.g_count > 1]
    if several:
        torch._foreach_div_(
            [t for ly in several for t in (ly.a_sum, ly.g_sum)],
            [float(c) for ly in several for c in (ly.a_count, ly.g_count)],
        )
        for ly in several:
            ly.last_written = None
    return 1.0


def merge_slots(ready: list[LayerFactors]) -> None:
    """Gathers each layer's confirmed statistics into slot 0 (``a_sum``): in place when
    the first micro-batch used it, by a copy otherwise, then one batched addition per
    further micro-batch."""
    copies: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
    adds: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []
    for ly in ready:
        order = list(ly.confirmed)
        if order == [0]:
            continue
        if 0 in order:
            order.remove(0)
        else:
            first = order.pop(0)
            copies[0].append(ly.a_sum)
            copies[1].append(ly.slots[first])
            ly.last_written = None  # the copy overwrote the last entry too
        for k, slot in enumerate(order):
            if k == len(adds):
                adds.append(([], []))
            adds[k][0].append(ly.a_sum)
            adds[k][1].append(ly.slots[slot])
    if copies[0]:
        torch._foreach_copy_(*copies)
    for dst, src in adds:
        torch._foreach_add_(dst, src)


def write_last_entries(ready: list[LayerFactors], force: bool) -> None:
    """Sets the last entry of ``a_sum`` where the rule left it to the fold, unless it
    already holds that value (``force``: always)."""
    stale = [ly for ly in ready if ly.has_last and (force or ly.last_written != ly.last_sum)]
    if not stale:
        return
    ends = [ly.a_sum[-1:] for ly in stale]
    torch._foreach_zero_(ends)
    torch._foreach_add_(ends, [ly.last_sum for ly in stale])
    for ly in stale:
        # an all-reduce or an average will change it again
        ly.last_written = None if force or ly.a_count > 1 else ly.last_sum


def average_over_processes(ready: list[LayerFactors]) -> float:
    """Sums the statistics and counts over processes, in one all-reduce per device, and
    divides by the counts; returns ``world_size**2``."""
    by_device: dict[torch.device, list[LayerFactors]] = {}
    for ly in ready:
        by_device.setdefault(ly.a_sum.device, []).append(ly)
    for device, layers in by_device.items():
        counts = torch.tensor(
            [c for ly in layers for c in (ly.a_count, ly.g_count)], dtype=torch.float32
        )
        if device.type == "cuda":  # a pinned source keeps the copy asynchronous
            counts = counts.pin_memory()
        counts = counts.to(device, non_blocking=True)
        sums = [t for ly in layers for t in (ly.a_sum, ly.g_sum)]
        all_reduce_sum(sums + [counts])
        torch._foreach_div_(sums, list(counts.unbind()))
    return float(dist.get_world_size()) ** 2


def all_reduce_sum(tensors: list[torch.Tensor]) -> None:
    """Sums ``tensors`` (on one device) over processes in place, in one bucketed call."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    torch._foreach_copy_(tensors, list(flat.split([t.numel() for t in tensors])))
