"""Stopping on a signal at an optimizer-step boundary, with a complete checkpoint.

Schedulers stop jobs with a signal and a grace period: SLURM (``--signal``), Kubernetes
and spot instances (SIGTERM, then SIGKILL after ``terminationGracePeriodSeconds``), a
user's Ctrl-C. :class:`PreemptionHandler` (a ``TrainerCallback``, for
``TriAccelTrainer`` and the stock ``transformers.Trainer`` alike) turns such a signal into
a clean stop:

* the signal only raises a flag; the flag is read at the end of an optimizer step
  (``on_step_end``), so a stop never falls between the gradients and the update, and a
  gradient accumulation in progress is finished first;
* under several processes the flag is combined across them (a maximum over a gloo group
  of its own, every ``agree_every`` steps, without waiting: :class:`FlagAgreement`), so a
  signal that reached one rank only stops every rank at the same step, one exchange after
  the signal;
* the Trainer then saves its checkpoint (model, optimizer with AdaFisher's Fisher factors
  and its controllers, scheduler, grad scaler, every rank's RNG, the data position, the
  elastic batch's state), which
  :class:`~hf_triaccel.integrations.checkpoints.CrashConsistentCheckpoints` marks complete
  after every rank wrote it, and the process exits with :data:`EXIT_PREEMPTED`;
* while training runs the signals are blocked in the main thread and taken by a watcher
  thread (``sigwait``): processes started from the main thread meanwhile (DataLoader
  workers, by fork, spawn or forkserver) inherit the blocked mask, so a signal sent to the
  whole process group does not kill them before the main process can stop cleanly.

A second signal changes nothing (the stop is already on its way). A signal that arrives
during evaluation or a save is acted on at the next step's end. A signal whose stop would
fall on the last step lets the run finish as usual (exit status 0).

Example:
    >>> handler = PreemptionHandler(signals="SIGTERM,SIGUSR1")
    >>> [s.name for s in handler.signals], handler.exit_code
    (['SIGTERM', 'SIGUSR1'], 3)
    >>> PreemptionHandler(signals="SIGTREM")
    Traceback (most recent call last):
    ...
    ValueError: preemption signal 'SIGTREM' is not a signal name; did you mean 'SIGTERM'?
"""

from __future__ import annotations

import difflib
import logging
import signal
import sys
import threading
import time
from collections.abc import Iterable
from typing import Any

import torch
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from hf_triaccel.integrations.checkpoints import CrashConsistentCheckpoints

__all__ = [
    "EXIT_PREEMPTED",
    "FlagAgreement",
    "PreemptionHandler",
    "SignalWatch",
    "add_preemption",
    "parse_signals",
]

logger = logging.getLogger(__name__)

EXIT_PREEMPTED = 3
"""Exit status of a process stopped on a signal after writing a complete checkpoint (2 is
a flag that cannot work, 1 an error): a job script requeues on it."""


def parse_signals(spec: str | int | signal.Signals | Iterable[str | int]) -> list[signal.Signals]:
    """Signals from names (``"SIGTERM"``, ``"TERM"``), numbers, or a comma-separated string.

    Example:
        >>> [s.name for s in parse_signals("TERM, SIGUSR1")]
        ['SIGTERM', 'SIGUSR1']

    Raises:
        ValueError: a name or number that is no signal, or SIGKILL / SIGSTOP (which no
            process can catch).
    """
    if isinstance(spec, str):
        items: list[Any] = [part.strip() for part in spec.split(",") if part.strip()]
    elif isinstance(spec, (int, signal.Signals)):
        items = [spec]
    else:
        items = list(spec)
    names = [s.name for s in signal.Signals]
    found = []
    for item in items:
        try:
            if isinstance(item, (int, signal.Signals)):
                chosen = signal.Signals(item)
            else:
                name = item.upper()
                chosen = signal.Signals[name if name.startswith("SIG") else f"SIG{name}"]
        except (KeyError, ValueError):
            close = difflib.get_close_matches(str(item).upper(), names, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"preemption signal {item!r} is not a signal name{hint}") from None
        if chosen in (signal.SIGKILL, signal.SIGSTOP):
            raise ValueError(f"preemption signal {chosen.name} cannot be caught by a process")
        if chosen not in found:
            found.append(chosen)
    return found


class SignalWatch:
    """Records the first arrival of ``signals`` while it is started, without ever running
    code in the interrupted thread beyond a flag.

    :meth:`start` (main thread only) installs a handler that raises the flag and blocks
    the signals in the main thread, so that the processes it starts inherit them blocked;
    a watcher thread takes them with ``sigwait``. :meth:`stop` restores the handlers and
    the mask.

    Attributes:
        received: the first signal caught, or ``None``.
        received_at: its ``time.monotonic()`` time.
        count: how many were caught.
    """

    def __init__(self, signals: Iterable[signal.Signals]) -> None:
        self.signals = list(signals)
        self.received: signal.Signals | None = None
        self.received_at: float | None = None
        self.count = 0
        self._previous: dict[signal.Signals, Any] = {}
        self._mask: set[int] | None = None
        self._thread: threading.Thread | None = None
        self._closing = False

    @property
    def started(self) -> bool:
        """Whether the handlers are installed."""
        return bool(self._previous)

    def _caught(self, signum: int, frame: Any = None) -> None:
        self.count += 1
        if self.received is None:
            self.received, self.received_at = signal.Signals(signum), time.monotonic()

    def _wait(self) -> None:
        while True:
            signum = signal.sigwait(self.signals)
            if self._closing:
                return
            self._caught(signum)

    def start(self) -> bool:
        """Installs the handlers; ``False`` (and nothing installed) outside the main thread,
        where Python cannot set signal handlers."""
        if self.started or not self.signals:
            return self.started
        if threading.current_thread() is not threading.main_thread():
            logger.warning("preemption: not in the main thread, signals are not watched")
            return False
        self._closing = False
        self._previous = {s: signal.signal(s, self._caught) for s in self.signals}
        self._mask = signal.pthread_sigmask(signal.SIG_BLOCK, self.signals)
        self._thread = threading.Thread(target=self._wait, name="signal-watch", daemon=True)
        self._thread.start()
        return True

    def stop(self) -> None:
        """Stops watching: the watcher thread ends, the mask and handlers are restored."""
        if not self.started:
            return
        self._closing = True
        if self._thread is not None and self._thread.is_alive():
            signal.pthread_kill(self._thread.ident, self.signals[0])
            self._thread.join(timeout=5)
        signal.pthread_sigmask(signal.SIG_SETMASK, self._mask)
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}


def _distributed() -> bool:
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class FlagAgreement:
    """The stop flag combined across processes without waiting for it.

    Each :meth:`exchange` starts an all-reduce (maximum) of this process's flag on a gloo
    group of its own, asynchronously, and returns the result of the one started at the
    previous call, which has had a whole step to finish: every rank gets the same answer
    at the same call, a step after the flag was raised, and no step waits for the
    exchange (a blocking all-reduce at each step's end measured about a third of a tiny
    DDP step on a loaded 2-core CPU, BENCHMARKS.md). The own group keeps the exchange
    apart from DDP's gradient all-reduces, and off NCCL (whose all-reduce would wait on
    the GPU's queue).

    Attributes:
        seconds: time spent in the exchanges, in total.
        count: how many exchanges were made.
    """

    def __init__(self) -> None:
        self._group: Any = None
        self._pending: tuple[Any, torch.Tensor] | None = None
        self.seconds = 0.0
        self.count = 0

    def open(self) -> None:
        """Makes the group (a collective: every process calls it, at the same point)."""
        if self._group is None:
            self._group = torch.distributed.new_group(backend="gloo")

    def exchange(self, local: bool) -> bool:
        """Starts combining ``local``; returns the combined flag of the previous call
        (``False`` at the first)."""
        began = time.perf_counter()
        agreed = self.finish()
        flag = torch.tensor([int(local)], dtype=torch.int32)
        work = torch.distributed.all_reduce(
            flag, op=torch.distributed.ReduceOp.MAX, group=self._group, async_op=True
        )
        self._pending = (work, flag)
        self.seconds += time.perf_counter() - began
        self.count += 1
        return agreed

    def finish(self) -> bool:
        """Waits for the exchange in flight, if any, and returns its combined flag."""
        if self._pending is None:
            return False
        work, flag = self._pending
        self._pending = None
        work.wait()
        return bool(flag.item())


class PreemptionHandler(TrainerCallback):
    """Stops training at the next optimizer-step boundary after one of ``signals``, saves
    a checkpoint and exits with ``exit_code`` (see the module).

    Use with any ``transformers.Trainer``, together with
    :class:`~hf_triaccel.integrations.checkpoints.CrashConsistentCheckpoints` (which
    ``TriAccelTrainer`` adds itself; there ``preemption_signals`` turns this on)::

        trainer = Trainer(..., callbacks=[PreemptionHandler(), CrashConsistentCheckpoints()])
        trainer.train(resume_from_checkpoint=last_complete_checkpoint(args.output_dir))

    Args:
        signals: the signals that stop training (names, numbers, or ``"SIGTERM,SIGUSR1"``).
        exit_code: the exit status after the checkpoint; ``None`` returns from ``train()``
            instead (:attr:`stopped_at` then says the run was stopped).
        agree_every: under several processes, combine the flag every this many optimizer
            steps (one asynchronous all-reduce of one integer over gloo each time). A stop
            then comes up to ``2 * agree_every`` steps after the signal: keep that many
            steps' duration, plus a checkpoint's, well inside the grace period.

    Attributes:
        watch: the :class:`SignalWatch` (which signal came, and when).
        stopped_at: the global step training stopped at on a signal, else ``None``.
        agreement: the :class:`FlagAgreement` (its time and count).
    """

    def __init__(
        self,
        signals: str | Iterable[str | int] = "SIGTERM",
        exit_code: int | None = EXIT_PREEMPTED,
        agree_every: int = 1,
    ) -> None:
        if agree_every < 1:
            raise ValueError(f"PreemptionHandler.agree_every={agree_every}: needs >= 1")
        self.signals = parse_signals(signals)
        if not self.signals:
            raise ValueError("PreemptionHandler: give at least one signal")
        self.exit_code = exit_code
        self.agree_every = agree_every
        self.watch = SignalWatch(self.signals)
        self.stopped_at: int | None = None
        self.agreement = FlagAgreement()

    @property
    def agreement_seconds(self) -> float:
        """Time spent combining the flag across processes, in total."""
        return self.agreement.seconds

    @property
    def agreements(self) -> int:
        """How many times the flag was combined across processes."""
        return self.agreement.count

    def _agreed(self, step: int) -> bool:
        local = self.watch.received is not None
        if not _distributed():
            return local
        if step % self.agree_every:
            return False
        return self.agreement.exchange(local)

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control, **kwargs):
        self.stopped_at = None
        if _distributed():
            self.agreement.open()
        self.watch.start()

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs
    ):
        if self.stopped_at is not None or not self._agreed(state.global_step):
            return
        if state.max_steps and state.global_step >= state.max_steps:
            logger.warning("preemption signal at the last step: the run finishes as usual")
            return
        self.stopped_at = state.global_step
        control.should_save = True
        control.should_training_stop = True
        control.should_evaluate = False  # the grace period goes to the checkpoint
        if args.process_index == 0:
            caught = self.watch.received.name if self.watch.received else "a signal on a peer"
            print(
                f"preempted: {caught}, stopping at step {state.global_step} with a checkpoint "
                f"in {args.output_dir}",
                file=sys.stderr,
                flush=True,
            )

    def on_epoch_end(self, args, state, control: TrainerControl, **kwargs):
        if self.stopped_at is not None:
            # the step's checkpoint is written: no second save of the same folder
            control.should_save = False
            control.should_evaluate = False

    def on_train_end(self, args, state, control, **kwargs):
        if _distributed():
            self.agreement.finish()  # every rank started the same exchanges: none left over
        self.watch.stop()
        if self.stopped_at is not None and self.exit_code is not None:
            raise SystemExit(self.exit_code)


def add_preemption(
    trainer: Trainer, signals: str | Iterable[str | int]
) -> PreemptionHandler | None:
    """Adds to ``trainer`` a :class:`PreemptionHandler` for ``signals`` (none when empty)
    and a :class:`~hf_triaccel.integrations.checkpoints.CrashConsistentCheckpoints`, in
    that order (what ``TriAccelTrainer`` does with ``preemption_signals``).

    Returns:
        The handler, or ``None`` without signals.
    """
    handler = PreemptionHandler(signals) if signals else None
    for callback in (handler, CrashConsistentCheckpoints()):
        if callback is not None:
            trainer.add_callback(callback)
    return handler
