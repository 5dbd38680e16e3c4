"""The recording of a refresh step, and the program that replays it.

:class:`Recorder` is told, while the general path takes a refresh step, each statistic's
event (by the hooks: :mod:`~hf_triaccel.curvature.hooks`) and what the collector's
batches launch, queue and flush (by the batches: :mod:`~hf_triaccel.curvature.batching`);
:meth:`Recorder.program` turns that into a :class:`Program`: per event, per backward end
and for the fold, what to run on the tensors the replayed step's hooks keep
(:mod:`~hf_triaccel.curvature.actions`; :mod:`~hf_triaccel.curvature.steady` runs it).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from hf_triaccel.curvature.actions import Action, Flush, Reduction
from hf_triaccel.curvature.batching import StatisticsBatch
from hf_triaccel.curvature.layer import LayerFactors, PendingStatistic


@dataclass(eq=False)
class Event:
    """One statistic taken in a recorded step: a forward's activation sums (``"a"``) or
    an output gradient's sums (``"g"``), and what ran when it was taken."""

    kind: str
    layer: LayerFactors
    # what the replay checks of a tensor: for "a", (kept until the backward, shape,
    # strides, dtype, the layer's device); for "g", (detached first, shape, strides, dtype)
    key: tuple
    slot: int = 0  # a: the slot its sums went to
    count: float = 0.0  # what its sums ran over
    pair: int = -1  # g: its forward's event
    end: int = -1  # g: the backward end it asked for (index into the ends)
    actions: list = field(default_factory=list)


@dataclass(eq=False)
class _End:
    position: int  # the events taken before this backward ended
    actions: list = field(default_factory=list)


@dataclass(eq=False)
class Program:
    """A recorded refresh step, ready to replay: its events, the backward ends and the
    fold, each with what runs there."""

    events: list[Event]
    ends: list[_End]
    fold: list
    generation: int  # the collector's, when recorded: its buffers' addresses

    def __post_init__(self) -> None:
        self.counts = _count(self.events)  # what the whole step counts, per layer
        # one gradient per forward and one forward per layer, into its first slot: the
        # fold reads the counts from here, and the layers need no merge and no reset
        self.simple = all(slots == [0] for _, slots, *_ in self.counts)
        self.ready: list[LayerFactors] = []  # the counted layers, in the collector's order
        self.plans: list | None = None  # the collector's fold plans of ready, once asked
        self._plan_counts: list[tuple[float, ...]] = []  # what each of them reads
        # each tensor is let go by the last action that reads it, in the order they run
        last: dict[int, Action] = {}
        for actions in self.in_order():
            for action in actions:
                for source in action.sources():
                    last[source] = action
        for source, action in last.items():
            action.release += (source,)

    def order(self, layers: list[LayerFactors]) -> None:
        """Puts :attr:`ready` in the order of ``layers`` (the collector's)."""
        counted = {id(c[0]) for c in self.counts}
        self.ready = [ly for ly in layers if id(ly) in counted]

    def add_counts(self) -> None:
        """Adds what the whole step counts to the layers."""
        _add_counts(self.counts)

    def hand_over(self, stash: list, taken: int, ends: int) -> None:
        """For a step that leaves the replay after ``taken`` events and ``ends`` backward
        ends: counts the gradients taken in their layers, and queues in the batches what
        those events queued for flushes that have not run."""
        _add_counts(_count(self.events[:taken]))
        for actions in self.in_order(taken, ends):
            for action in actions:
                if isinstance(action, Flush):
                    action.hand_over(stash, taken)

    def fold_factors(
        self, plans: Callable[[list], list], mode: str, gamma: float, normalise: str
    ) -> None:
        """Folds a step replayed whole into the factors, in one process without a loss
        scale: the fold plans of :attr:`ready` (``plans(ready)``: the collector's
        ``DevicePlan`` objects, asked once) read the counts from here, not from the
        layers; with one forward per layer, into its first slot (:attr:`simple`), the
        layers have nothing to merge or reset."""
        if not self.ready:
            return
        if self.plans is None:  # a recording is of one generation: so are its plans
            self.plans = plans(self.ready)
            by_layer = {id(c[0]): (c[3], c[4]) for c in self.counts}
            self._plan_counts = [
                tuple(n for ly in plan.layers for n in by_layer[id(ly)]) for plan in self.plans
            ]
        for plan, counts in zip(self.plans, self._plan_counts, strict=True):
            plan.finish_and_fold(mode, gamma, normalise, counts)

    def in_order(self, events: int = 0, ends: int = 0) -> list[list]:
        """The actions of every event from ``events`` on and every end from ``ends`` on,
        and of the fold, in the order they run."""
        out, waiting = [], list(self.ends[ends:])
        for i in range(events, len(self.events) + 1):
            while waiting and waiting[0].position <= i:
                out.append(waiting.pop(0).actions)
            if i < len(self.events):
                out.append(self.events[i].actions)
        return [*out, self.fold]


class Recorder:
    """Records a refresh step taken by the general path: each statistic's event (told by
    the hooks), and what the collector's batches launch, queue and flush (told by the
    batches) while it runs. :meth:`program` makes the replay of it, or ``None`` when the
    step cannot be replayed."""

    def __init__(self, generation: int) -> None:
        self.generation = generation
        self.events: list[Event] = []
        self.ends: list[_End] = []
        self.fold: list = []
        self.actions: list | None = None  # where what runs now is recorded
        self.tensor: torch.Tensor | None = None  # the event's tensor, while it is taken
        self.sources: dict[int, tuple[list, list, list]] = {}  # per batch, what queued
        self.forwards: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.backward = -1  # the event that started a backward that has not ended
        self.worked: set[int] = set()  # events whose statistics were seen launched or queued
        self.refused = ""  # why the step cannot be replayed

    def refuse(self, reason: str) -> None:
        self.refused = self.refused or reason

    def _open(self, event: Event, tensor: torch.Tensor) -> None:
        if self.actions is not None:
            self.refuse("a statistic taken while another was")
        self.events.append(event)
        self.actions, self.tensor = event.actions, tensor

    def done(self) -> None:
        """Closes what was open (an event, a backward's end)."""
        self.actions = self.tensor = None

    def activation(
        self, layer: LayerFactors, x: torch.Tensor, device: torch.device, kept: bool
    ) -> None:
        if not layer.rule.replayable:
            self.refuse(f"{type(layer.rule).__name__} is not replayable")
        self._open(Event("a", layer, (kept, x.shape, x.stride(), x.dtype, device)), x)

    def taken(self, pending: PendingStatistic) -> None:
        event = self.events[-1]
        event.slot, event.count = pending.slot, pending.count
        self.forwards[pending] = len(self.events) - 1
        self.done()

    def gradient(
        self, layer: LayerFactors, grad: torch.Tensor, detached: bool, pending: PendingStatistic
    ) -> None:
        pair = self.forwards.get(pending, -1)
        if pair < 0:
            self.refuse("a gradient whose forward was not recorded")
        event = Event("g", layer, (detached, grad.shape, grad.stride(), grad.dtype), pair=pair)
        self._open(event, grad)

    def counted(self, count: float, started: bool) -> None:
        event = self.events[-1]
        event.count = count
        if started:
            if self.backward >= 0:
                self.refuse("a backward inside another")
            event.end = len(self.ends)
            self.backward = len(self.events) - 1
        self.done()

    def backward_ended(self) -> None:
        if self.backward < 0:
            self.refuse("a backward end that was not asked for")
        self.backward = -1
        self.ends.append(_End(len(self.events)))
        self.actions = self.ends[-1].actions

    def folding(self) -> None:
        self.actions = self.fold

    def _source(self, x: torch.Tensor) -> int:
        if self.tensor is None or x is not self.tensor:
            self.refuse("a statistic of a tensor other than its hook's")
        index = len(self.events) - 1
        self.worked.add(index)
        return index

    def _record(self, item: tuple) -> None:
        if self.actions is None:
            self.refuse("statistics launched outside the hooks")
        else:
            self.actions.append(item)

    def launched(self, launch, x, out, scale, accumulate) -> None:
        self._record(("launch", launch, self._source(x), out, scale, accumulate))

    def queued(self, batch: StatisticsBatch, kind: str, tensors: tuple) -> None:
        lists = self.sources.setdefault(id(batch), ([], [], []))
        if kind == "entries":
            lists[0].append(self._source(tensors[0]))
            return
        index = len(self.events) - 1
        at = tuple(i for i, t in enumerate(tensors) if t is self.tensor)
        if self.tensor is None or (at and kind == "gathers"):
            self.refuse("a gather outside a hook, or of its hook's tensor")
        if kind == "gathers":
            lists[1].append(index)
            return
        if at:  # a step that reads the hook's tensor (an embedding's row counts)
            self.worked.add(index)
        lists[2].append((index, at))

    def flushed(self, batch: StatisticsBatch, entries: list, gathers: list, after: list) -> None:
        e_src, g_src, a_src = self.sources.pop(id(batch), ([], [], []))
        if (len(entries), len(gathers), len(after)) != (len(e_src), len(g_src), len(a_src)):
            self.refuse("statistics queued outside the recording")
            return
        # the inputs are not kept: an event's tensor is named by its index
        entries = [(e[0], s, *e[2:]) for e, s in zip(entries, e_src, strict=True)]
        gathers = [(*g, s) for g, s in zip(gathers, g_src, strict=True)]
        after = [
            (fn, tuple(None if i in at else a for i, a in enumerate(args)), s, at)
            for (fn, args), (s, at) in zip(after, a_src, strict=True)
        ]
        self._record(("flush", batch, entries, gathers, after))

    def program(self) -> Program | None:
        """The replay of the recorded step, or ``None`` when it cannot be replayed."""
        if len(self.worked) != len(self.events):
            self.refuse("a statistic whose work the batches did not see")
        if self.refused or not self.events or self.backward >= 0:
            return None
        for actions in (*(e.actions for e in self.events), *(e.actions for e in self.ends)):
            actions[:] = [self._compiled(item) for item in actions]
        self.fold[:] = [self._compiled(item) for item in self.fold]
        return Program(self.events, self.ends, self.fold, self.generation)

    @staticmethod
    def _compiled(item: tuple) -> Action:
        return Reduction(*item[1:]) if item[0] == "launch" else Flush(*item[1:])


def _count(events: list[Event]) -> list[tuple]:
    """Per layer, what the gradients among ``events`` count (their forwards' slots, the
    forwards, what their sums ran over, the gradients), as the general path counts each
    gradient when it arrives: a replay counts a whole step when it is folded."""
    counts: dict[int, list] = {}
    for event in events:
        if event.kind == "g":
            forward = events[event.pair]
            entry = counts.setdefault(id(event.layer), [event.layer, [], 0, 0.0, 0.0, 0])
            entry[1].append(forward.slot)
            entry[2] += 1
            entry[3] += forward.count
            entry[4] += event.count
            entry[5] += 1
    return [tuple(entry) for entry in counts.values()]


def _add_counts(counts: list[tuple]) -> None:
    """Adds :func:`_count`'s counts to their layers."""
    for layer, slots, a_count, a_n, g_n, g_count in counts:
        layer.confirmed += slots
        layer.a_count += a_count
        layer.a_n += a_n
        layer.g_n += g_n
        layer.g_count += g_count
