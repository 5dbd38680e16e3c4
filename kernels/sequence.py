"""What one flush of queued statistics launches, worked out once: a launch sequence.

A flush (``hf_triaccel.curvature.batching``) launches its queued row sums grouped by
kernel (:mod:`~hf_triaccel.kernels.grouped`), each reduction alone in its group with its
own launch, then the tap gathers, one kernel per selector width. A refresh step flushes
the same queues step after step, so :class:`LaunchSequence` works that out once per
queue (:meth:`LaunchSequence.key`) and keeps it: a flush then writes what changed into
the grouped kernels' tables (:meth:`LaunchSequence.prepare`) and launches
(:meth:`LaunchSequence.run`). Its launches read nothing but tables that stay where they
are and the addresses :meth:`~LaunchSequence.prepare` returns, so the caller may capture
:meth:`~LaunchSequence.run` as a CUDA graph and replay it while those stay the same.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hf_triaccel.kernels.grouped import gather_key, gathers_launch, group_plan

# a queued reduction: (launch, x, out, scale, accumulate, group key); a gather: (sums,
# taps, out)
Entry = tuple
Gather = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class LaunchSequence:
    """The launches of one queue of reductions and gathers, in order.

    Example:
        >>> import torch
        >>> from hf_triaccel.kernels.grouped import group_key
        >>> from hf_triaccel.kernels.stats import reduction_launch
        >>> xs = [torch.ones(6, 8), torch.full((6, 8), 2.0)]
        >>> outs = [torch.zeros(8), torch.zeros(8)]
        >>> entries = []
        >>> for x, out in zip(xs, outs):
        ...     launch = reduction_launch(x, True)
        ...     entries.append((launch, x, out, 1.0, False, group_key(launch, x)))
        >>> sequence = LaunchSequence(entries, [])
        >>> sequence.prepare(entries)  # one grouped kernel: no single reduction's addresses
        ()
        >>> sequence.run(entries)
        >>> outs[0][0].item(), outs[1][0].item()  # sums of squares: 6 x 1, 6 x 4
        (6.0, 24.0)
    """

    __slots__ = ("device", "steps", "gathers", "kept")

    def __init__(self, entries: Sequence[Entry], gathers: Sequence[Gather]) -> None:
        self.device = (entries[0][1] if entries else gathers[0][0]).device
        groups: dict[tuple, list[int]] = {}
        for i, entry in enumerate(entries):
            groups.setdefault(entry[5], []).append(i)
        # per group: its grouped kernel's plan (None: one reduction, launched alone), and
        # where its entries stand in the queue
        self.steps = [
            (
                None if len(at) == 1 else group_plan(key, [entries[i][0] for i in at], self.device),
                at,
            )
            for key, at in groups.items()
        ]
        widths: dict[int, list[Gather]] = {}
        for gather in gathers:
            widths.setdefault(gather_key(gather[1]), []).append(gather)
        self.gathers = [gathers_launch(width, group) for width, group in widths.items()]
        # the objects whose ids make the key, kept so that the ids stay theirs
        self.kept = ([entry[0] for entry in entries], list(gathers))

    @property
    def kernels(self) -> int:
        """The kernels :meth:`run` launches."""
        return len(self.steps) + len(self.gathers)

    @staticmethod
    def key(entries: Sequence[Entry], gathers: Sequence[Gather]) -> tuple:
        """What identifies a queue's sequence: its launches and group keys in order, and
        its gathers' tensors with their addresses (a gather's table holds them)."""
        return (
            tuple([(id(entry[0]), entry[5]) for entry in entries]),
            tuple([(id(t), t.data_ptr()) for gather in gathers for t in gather]),
        )

    def prepare(self, entries: Sequence[Entry]) -> tuple:
        """Writes the grouped kernels' tables for ``entries`` (the queue this sequence
        was made for, at this flush); returns what the launches of :meth:`run` take
        besides: each single reduction's addresses, scale and accumulation."""
        taken: list = []
        for plan, at in self.steps:
            if plan is None:
                entry = entries[at[0]]
                taken += (entry[1].data_ptr(), entry[2].data_ptr(), entry[3], entry[4])
            else:
                plan.write([entries[i] for i in at])
        return tuple(taken)

    def run(self, entries: Sequence[Entry]) -> None:
        """Launches the sequence on ``entries``, after :meth:`prepare`."""
        for plan, at in self.steps:
            if plan is None:
                launch, x, out, scale, accumulate, _ = entries[at[0]]
                launch(x, out, scale, accumulate)
            else:
                plan()
        for launch in self.gathers:
            launch()
