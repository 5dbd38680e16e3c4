"""What a replayed refresh step runs, on the tensors its hooks keep.

Each action is called with the step's tensors by event (``stash``): a reduction
launched on one event's tensor (:class:`Reduction`), several in one grouped launch
(:class:`Grouped`), a step that reads an event's tensor (:class:`Step`), or a batch's
flush as recorded (:class:`Flush`), which can also hand what it holds back to its batch.
An action lets go of the tensors it was the last to read (:attr:`Action.release`), as
the general path's batches do once they launched them.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from hf_triaccel.curvature.batching import StatisticsBatch


class Action:
    """Something a replay runs, given the step's tensors by event (``stash``); it lets go
    of the tensors it was the last to read, as the general path's batches do."""

    __slots__ = ("release",)

    def __init__(self) -> None:
        self.release: tuple[int, ...] = ()

    def sources(self) -> list[int]:
        """The events whose tensors it reads."""
        return []

    def run(self, stash: list) -> None:
        """Runs it, keeping the tensors."""
        raise NotImplementedError

    def __call__(self, stash: list) -> None:
        self.run(stash)
        for source in self.release:
            stash[source] = None


class Reduction(Action):
    """One reduction launched on one event's tensor."""

    __slots__ = ("launch", "source", "out", "scale", "accumulate")

    def __init__(self, launch, source, out, scale, accumulate) -> None:
        super().__init__()
        self.launch, self.source, self.out = launch, source, out
        self.scale, self.accumulate = scale, accumulate

    def sources(self) -> list[int]:
        return [self.source]

    def run(self, stash: list) -> None:
        self.launch(stash[self.source], self.out, self.scale, self.accumulate)


class Grouped(Action):
    """Several reductions in one grouped launch (``GroupedSums``)."""

    __slots__ = ("sums", "source_list")

    def __init__(self, sums: Any, sources: list[int]) -> None:
        super().__init__()
        self.sums, self.source_list = sums, sources

    def sources(self) -> list[int]:
        return self.source_list

    def run(self, stash: list) -> None:
        self.sums([stash[s] for s in self.source_list])


class Step(Action):
    """A step queued after the reductions (``batching.then``) that reads its event's
    tensor, at the argument positions ``at``."""

    __slots__ = ("fn", "args", "source", "at")

    def __init__(self, fn: Any, args: tuple, source: int, at: tuple[int, ...]) -> None:
        super().__init__()
        self.fn, self.args, self.source, self.at = fn, args, source, at

    def sources(self) -> list[int]:
        return [self.source]

    def run(self, stash: list) -> None:
        self.fn(*_given(self.args, self.at, stash[self.source]))


class Flush(Action):
    """A batch's flush, as recorded: its launches, gathers and what followed, and, to
    hand them over to the batch when a step leaves the replay before this flush, what
    each event had queued."""

    __slots__ = ("batch", "entries", "gathers", "after", "runs")

    def __init__(self, batch: StatisticsBatch, entries: list, gathers: list, after: list):
        from hf_triaccel.kernels import grouped  # only Triton's statistics are recorded

        super().__init__()
        self.batch, self.entries, self.gathers, self.after = batch, entries, gathers, after
        groups: dict[tuple, list[tuple]] = {}
        for entry in entries:  # grouped as StatisticsBatch.flush groups them
            groups.setdefault(entry[5], []).append(entry)
        self.runs: list[Any] = []
        for key, group in groups.items():
            if len(group) == 1:
                self.runs.append(Reduction(*group[0][:5]))
                continue
            device = group[0][2].device
            sums = grouped.GroupedSums(key, [(e[0], e[2], e[3], e[4]) for e in group], device)
            self.runs.append(Grouped(sums, [e[1] for e in group]))
        by_width: dict[int, list[tuple]] = {}
        for sums, taps, out, _ in gathers:
            by_width.setdefault(grouped.gather_key(taps), []).append((sums, taps, out))
        self.runs += [grouped.gathers(width, group) for width, group in by_width.items()]
        self.runs += [
            Step(fn, args, source, at) if at else functools.partial(fn, *args)
            for fn, args, source, at in after
        ]

    def sources(self) -> list[int]:
        return [e[1] for e in self.entries] + [a[2] for a in self.after if a[3]]

    def run(self, stash: list) -> None:
        for run in self.runs:
            if isinstance(run, Action):
                run.run(stash)
            else:
                run()

    def hand_over(self, stash: list, taken: int) -> None:
        """Queues in the batch what the events before ``taken`` queued for this flush."""
        batch = self.batch
        for launch, source, out, scale, accumulate, _ in self.entries:
            if source < taken:
                batch.add(launch, stash[source], out, scale, accumulate)
        for sums, taps, out, source in self.gathers:
            if source < taken:
                batch.gather(sums, taps, out)
        for fn, args, source, at in self.after:
            if source < taken:
                batch.then(fn, _given(args, at, stash[source]))


def _given(args: tuple, at: tuple[int, ...], tensor: torch.Tensor) -> tuple:
    """``args`` with ``tensor`` at the positions ``at`` (where an event's tensor was)."""
    args = list(args)
    for i in at:
        args[i] = tensor
    return tuple(args)
