"""A refresh step that repeats the one before it, replayed.

A refresh step takes the statistics of every hooked layer. With many small layers its
pace is the host's, and most of the hooks' host time goes to decisions that come out
the same on every step: which slot and batch each statistic takes, what each rule's plan
launches, how the queued sums are grouped. So :class:`SteadyRefresh` records one refresh
step as the hooks take it (:class:`Recorder`: every statistic's event in order, and what
each queued, launched and flushed) and replays the next ones: a hook checks that its
event is the one recorded next, on a tensor of the same shape, strides, dtype and device,
keeps the tensor, and runs what was launched at that point, on the new tensors
(:class:`~hf_triaccel.kernels.grouped.GroupedSums`). A replayed step launches the same
kernels on the same inputs into the same buffers, grouped the same way, so its factors
are those of the general path, bit for bit.

A step that departs from the recording (another shape, a layer skipped or added, another
micro-batch, an evaluation forward with autograd on) leaves the replay where it departs
(:meth:`SteadyRefresh.leave`): the statistics the replay took so far are handed to the
general path as if it had taken them, and the next refresh step is recorded again.
After :data:`MAX_MISSES` such steps in a row the collector stops recording. A step is
recorded only when its statistics all go through
:mod:`~hf_triaccel.curvature.batching` (Triton, and rules that say so:
:attr:`~hf_triaccel.curvature.rules.FisherRule.replayable`).
"""

from __future__ import annotations

import functools
import weakref
from typing import TYPE_CHECKING

import torch

from hf_triaccel.curvature.hooks import GradientTake
from hf_triaccel.curvature.layer import LayerFactors, PendingStatistic
from hf_triaccel.curvature.recording import Program, Recorder

if TYPE_CHECKING:
    from hf_triaccel.curvature.collector import FisherCollector

# Replays in a row that left their recording before the collector stops recording: steps
# that keep changing (shapes that vary) would pay for a recording each.
MAX_MISSES = 3

# the phases of a step
_IDLE, _RECORDING, _REPLAYING, _GENERAL = range(4)


class SteadyRefresh:
    """A collector's recording and replay of its refresh steps (see the module).

    A step runs from one fold to the next. Its first statistic decides: replay the
    recording, when there is one for the collector's buffers as they are; else record
    the step, when the collector starts it with nothing gathered; else take it by the
    general path.

    Attributes:
        enabled: whether steps are recorded and replayed; cleared when a recorded step
            cannot be replayed, or after :data:`MAX_MISSES` replays in a row that left
            their recording.
        replayed: steps replayed to their end.
        refused: why the last recorded step cannot be replayed (empty when it can).

    Example:
        >>> from torch import nn
        >>> from hf_triaccel.curvature.collector import FisherCollector
        >>> model = nn.Linear(3, 2)
        >>> collector = FisherCollector(model)  # the reference statistics on this CPU
        >>> for _ in range(2):
        ...     model(torch.ones(4, 3)).sum().backward()
        ...     collector.fold(0.9)
        >>> collector.steady.enabled, collector.steady.refused
        (False, 'a statistic whose work the batches did not see')
    """

    def __init__(self, collector: FisherCollector) -> None:
        self.collector = collector
        self.enabled = True
        self.replayed = 0
        self.refused = ""
        self.misses = 0
        self.program: Program | None = None
        self.recorder: Recorder | None = None
        self.phase = _IDLE
        self.position = 0  # the events replayed in this step
        self.ends = 0  # the backward ends replayed in this step
        self.stash: list[torch.Tensor | None] = []
        # by forward event, the layer and pending record a step that left the replay
        # gave the forwards it had replayed
        self.handed: dict[int, tuple[LayerFactors, PendingStatistic]] = {}
        self.step = object()  # this step's token

    def _begin(self) -> None:
        collector = self.collector
        self.phase = _GENERAL
        if not self.enabled or not self._clean():
            return
        program = self.program
        if program is not None and program.generation == collector.generation:
            self.phase = _REPLAYING
            self.position = self.ends = 0
            self.stash = [None] * len(program.events)
            return
        self.phase = _RECORDING
        self.recorder = Recorder(collector.generation)
        collector.batches.record(self.recorder)

    def _clean(self) -> bool:
        """Whether nothing is gathered, pending or queued (a step's start)."""
        for ly in self.collector.layers.values():
            # a fold resets the owners to None (a replayed one never sets them)
            if ly.a_count or ly.g_count or ly.confirmed or ly.pending_a or any(ly.owners):
                return False
        batches = self.collector.batches
        return not (len(batches.activations) or len(batches.gradients) or len(batches.now))

    def forward(
        self, layer: LayerFactors, x: torch.Tensor, device: torch.device, kept: bool
    ) -> int | None:
        """A forward's activation statistic, replayed: the index of its event, which its
        gradient hook (:meth:`node_gradient`) is made with, or ``None`` when the general
        path takes it."""
        if self.phase != _REPLAYING:
            if self.phase != _IDLE:
                return None
            self._begin()
            if self.phase != _REPLAYING:
                return None
        k = self.position
        events = self.program.events
        event = events[k] if k < len(events) else None
        if (
            event is None
            or event.layer is not layer
            or event.key != (kept, x.shape, x.stride(), x.dtype, device)
        ):
            self.leave()
            return None
        stash = self.stash
        stash[k] = x
        self.position = k + 1
        for action in event.actions:
            action(stash)
        return k

    def node_gradient(
        self, index: int, step: object, output: int, grads: tuple[torch.Tensor | None, ...]
    ) -> None:
        """The gradient hook of a forward this replay took (``index``: its event), on the
        node that computes the gradient of its ``output``: the replay takes the gradient;
        once the step has left the replay, :class:`~hf_triaccel.curvature.hooks.GradientTake`
        takes it with the record the replay handed over. ``step`` is the forward's step:
        a gradient that arrives after that step's fold (a graph kept and run backward
        again) is not taken, its sums already folded."""
        grad = grads[output]
        if grad is None or step is not self.step:  # no gradient reached it, or folded
            return
        if self.phase == _REPLAYING and self._gradient(index, grad):
            return
        handed = self.handed.get(index)
        if handed is not None:
            GradientTake(self.collector, *handed)(grad)

    def tensor_gradient(self, index: int, step: object, grad: torch.Tensor) -> None:
        """:meth:`node_gradient`, as the hook of the output tensor itself (an output
        without a node, or a forward that torch.compile traces)."""
        self.node_gradient(index, step, 0, (grad,))

    def _gradient(self, index: int, grad: torch.Tensor) -> bool:
        """An output gradient's statistic, replayed; ``False`` when the step leaves the
        replay here and the general path takes it."""
        k = self.position
        events = self.program.events
        event = events[k] if k < len(events) else None
        detach = grad.requires_grad
        if (
            event is None
            or event.pair != index
            or event.key != (detach, grad.shape, grad.stride(), grad.dtype)
        ):
            self.leave()
            return False
        stash = self.stash
        stash[k] = grad.detach() if detach else grad
        self.position = k + 1
        if event.end >= 0:
            ended = functools.partial(self._backward_ended, event.end, self.step)
            torch.autograd.Variable._execution_engine.queue_callback(ended)
        for action in event.actions:
            action(stash)
        return True

    def _backward_ended(self, index: int, step: object) -> None:
        if step is not self.step or self.phase != _REPLAYING:
            return
        end = self.program.ends[index]
        if self.ends != index or self.position != end.position:
            self.leave()
            self.collector.batches.gradients.flush()  # as the general path's end would
            return
        self.ends = index + 1
        for action in end.actions:
            action(self.stash)

    def before_fold(self) -> Program | None:
        """Called by the fold before it flushes: the replay's last launches, or the
        recording of the fold's. Returns the program of a step replayed whole whose
        counts the fold reads from it (:attr:`Program.simple`); otherwise the layers
        hold the step's counts."""
        if self.phase == _RECORDING:
            self.recorder.folding()
        elif self.phase == _REPLAYING:
            program = self.program
            if self.position == len(program.events) and self.ends == len(program.ends):
                for action in program.fold:
                    action(self.stash)
                if program.simple:
                    return program
                program.add_counts()
            else:
                self.leave()
        return None

    def after_fold(self) -> None:
        """Called at the end of the fold: the step is over."""
        if self.phase == _RECORDING:
            self.collector.batches.record(None)
            self.program = self.recorder.program()
            self.refused = self.recorder.refused
            self.enabled = self.program is not None
            if self.program is not None:
                self.program.order(list(self.collector.layers.values()))
        elif self.phase == _REPLAYING:
            self.misses = 0
            self.replayed += 1
        self._next_step()

    def _next_step(self) -> None:
        self.phase = _IDLE
        self.recorder = None
        self.stash, self.handed = [], {}
        self.step = object()

    def abandon(self) -> None:
        """Forgets this step (a failed attempt's statistics, dropped by the collector):
        the next statistic starts the step again."""
        self.collector.batches.record(None)
        self._next_step()

    def leave(self) -> None:
        """Leaves the replay where the step departed from its recording: the forwards
        replayed so far get pending records, as the general path would have given them,
        and what they queued for flushes that have not run is queued in the batches."""
        program, taken = self.program, self.position
        self.phase = _GENERAL
        self.program = None  # the next refresh step is recorded again
        self.misses += 1
        self.enabled = self.misses < MAX_MISSES
        for index, event in enumerate(program.events[:taken]):
            if event.kind == "a":
                pending = PendingStatistic(event.slot, event.count)
                event.layer.owners[event.slot] = weakref.ref(pending)
                self.handed[index] = (event.layer, pending)
        program.hand_over(self.stash, taken, self.ends)
        self.stash = []
