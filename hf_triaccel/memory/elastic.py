"""Memory-elastic batch scaling: the micro-batch follows live device memory.

The effective batch ``E`` (what the caller asked for) never changes. Each step splits
its ``E`` samples into ``ceil(E / m)`` pieces of ``m`` samples (the last may be
smaller), runs forward and backward on each with the loss weighted by its share of
the batch, and so accumulates exactly the gradient of the full-batch mean loss.
Only ``m`` moves:

* **Sizing.** On the first step, three pieces ``p, p, 2p`` (a warm-up, then two
  measured) give the per-sample activation memory (slope) and the fixed part
  (intercept) of the step's peak; ``m`` is the largest size whose predicted peak stays
  under ``target_fraction`` of what the device can give this process
  (:class:`~hf_triaccel.memory.sizing.SizingPolicy`).
* **Shrink before an OOM.** Every ``check_every`` steps the probe is read again and
  the intercept refreshed from the step's measured peak; when free memory dropped
  (another process, a longer sequence, the optimizer state), ``m`` shrinks.
* **OOM inside a step.** Memory is freed, ``m`` halves, and the *same* samples are
  run again from scratch (:func:`~hf_triaccel.memory.retry.run_with_retries`).
  Fatal CUDA errors are never retried. Below ``min_micro_batch``, activation
  checkpointing is switched on once, then the controller gives up with
  :class:`ElasticBatchError`.
* **Grow back.** After ``grow_after`` steps without a shrink, ``m`` grows to what
  the device can give again.
* **Data parallel.** Ranks agree on ``m`` (all-reduce MIN) at every check, and only
  the last piece synchronises gradients (``no_sync()`` for the others).

The controller knows nothing of the Trainer: :meth:`ElasticBatchController.run_step`
takes a batch, a function that computes the loss of a piece, and the model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from hf_triaccel.memory.batches import Batch, batch_size, piece_weight, slice_batch
from hf_triaccel.memory.distributed import agree_min, syncs_gradients
from hf_triaccel.memory.probe import MemoryProbe, default_probe
from hf_triaccel.memory.retry import AttemptProgress, ElasticBatchError, run_with_retries
from hf_triaccel.memory.rollback import RunningStatsRollback, StepRollback
from hf_triaccel.memory.sizing import SizingPolicy


@dataclass(frozen=True)
class ElasticEvent:
    """One micro-batch decision.

    Attributes:
        step: index of the step (0-based) during or after which it was taken.
        old: micro-batch size before.
        new: micro-batch size after (equal to ``old`` for activation checkpointing).
        reason: ``"probe"``, ``"oom"``, ``"low_memory"``, ``"grow"``, ``"agree"``
            (another rank needed a smaller size) or ``"activation_checkpointing"``.
    """

    step: int
    old: int
    new: int
    reason: str


class ElasticBatchController:
    """Chooses the micro-batch of each step from live device memory; see the module doc.

    Args:
        effective_batch: samples per step, ``E`` (fixed).
        min_micro_batch: smallest micro-batch; below it, activation checkpointing is
            tried once, then :class:`ElasticBatchError` is raised.
        max_micro_batch: largest micro-batch (default ``E``).
        target_fraction: share of what the device can give this process that the
            predicted peak may use; the rest is headroom for fragmentation and the
            optimizer step's temporaries.
        check_every: read the probe, and agree across ranks, every this many steps
            (and after the first two steps).
        grow_after: steps without a shrink before the size may grow again.
        probe: memory probe (default: :func:`default_probe` for the current device).
        enable_activation_checkpointing: called once, before giving up, to save
            activation memory (e.g. ``lambda: enable_activation_checkpointing(model)``).
        process_group: group whose ranks must agree (default: the world).

    Example:
        >>> model = nn.Linear(4, 1)
        >>> controller = ElasticBatchController(8, max_micro_batch=3)
        >>> x, y = torch.randn(8, 4), torch.randn(8, 1)
        >>> loss = controller.run_step(
        ...     (x, y), lambda piece: nn.functional.mse_loss(model(piece[0]), piece[1]), model=model
        ... )
        >>> controller.micro_batch, controller.accumulation
        (3, 3)
    """

    def __init__(
        self,
        effective_batch: int,
        *,
        min_micro_batch: int = 1,
        max_micro_batch: int | None = None,
        target_fraction: float = 0.9,
        check_every: int = 10,
        grow_after: int = 100,
        probe: MemoryProbe | None = None,
        enable_activation_checkpointing: Callable[[], object] | None = None,
        process_group: Any = None,
    ) -> None:
        max_micro_batch = effective_batch if max_micro_batch is None else max_micro_batch
        low, high, E = min_micro_batch, max_micro_batch, effective_batch
        checks = [
            ("effective_batch", E >= 1, "needs >= 1"),
            ("min_micro_batch", 1 <= low <= E, "needs 1 <= min <= E"),
            ("max_micro_batch", low <= high <= E, "needs min <= max <= E"),
            ("target_fraction", 0.0 < target_fraction <= 1.0, "needs 0 < fraction <= 1"),
            ("check_every", check_every >= 1, "needs >= 1"),
            ("grow_after", grow_after >= 0, "needs >= 0"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise ValueError(f"ElasticBatchController {name}: {why}")
        self.effective_batch, self.min_micro_batch, self.max_micro_batch = E, low, high
        self.target_fraction, self.check_every = target_fraction, check_every
        self.grow_after, self.probe = grow_after, default_probe() if probe is None else probe
        self.enable_activation_checkpointing = enable_activation_checkpointing
        self.process_group = process_group
        self.sizing = SizingPolicy(
            effective_batch,
            min_micro_batch=min_micro_batch,
            max_micro_batch=max_micro_batch,
            target_fraction=target_fraction,
        )
        self.events: list[ElasticEvent] = []
        self._m = self.sizing.balanced(max_micro_batch)
        self._steps = 0
        self._stable = 0
        self._checkpointing = False
        self._stats_rollback: tuple[nn.Module, RunningStatsRollback] | None = None

    # -- what the rest of the run reads -------------------------------------------------

    @property
    def micro_batch(self) -> int:
        """Current micro-batch size ``m``."""
        return self._m

    @property
    def accumulation(self) -> int:
        """Pieces per step of ``E`` samples: ``ceil(E / m)``."""
        return -(-self.effective_batch // self._m)

    @property
    def steps(self) -> int:
        """Steps completed."""
        return self._steps

    @property
    def activation_checkpointing(self) -> bool:
        """Whether the activation checkpointing fallback was switched on."""
        return self._checkpointing

    def metrics(self) -> dict[str, int]:
        """``{"micro_batch": m, "accumulation": pieces}`` for logs and reports."""
        return {"micro_batch": self._m, "accumulation": self.accumulation}

    def predicted_peak(self, m: int) -> float | None:
        """Predicted peak allocation (bytes) of a step at micro-batch ``m``, once measured."""
        return self.sizing.predicted_peak(m)

    def agree(self, m: int) -> int:
        """The smallest ``m`` over the ranks of the process group (``m`` itself when
        ``torch.distributed`` is not initialised). Every rank must call it.

        Example:
            >>> ElasticBatchController(8).agree(5)
            5
        """
        return agree_min(m, self.process_group)

    # -- decisions ---------------------------------------------------------------------

    def _set(self, new: int, reason: str) -> None:
        if new != self._m or reason == "activation_checkpointing":
            self.events.append(ElasticEvent(self._steps, self._m, new, reason))
        if new < self._m:
            self._stable = 0
        self._m = new

    def _is_check(self, step: int) -> bool:
        # step 0 ends with the probe's choice, step 1 is the first with the optimizer
        # state allocated: both are checked, then every check_every steps
        return step < 2 or (step + 1) % self.check_every == 0

    def _check(self) -> None:
        proposal, reason = self._m, "agree"
        snapshot = self.probe.snapshot() if self.probe.measures else None
        if snapshot is not None and self.sizing.slope is not None:
            fitting = self.sizing.fitting(snapshot)
            if fitting < self._m:
                proposal, reason = fitting, "low_memory"
            elif fitting > self._m and self._stable >= self.grow_after:
                proposal, reason = fitting, "grow"
        agreed = self.agree(proposal)
        self._set(agreed, reason if agreed == proposal else "agree")

    def _on_oom(self, progress: AttemptProgress, message: str) -> None:
        """After an OOM: frees memory, corrects the memory model, and shrinks ``m`` (or
        switches on activation checkpointing, or gives up)."""
        self.probe.release()
        self.sizing.failed(progress.size, self.probe.snapshot())
        failed = progress.size if progress.probing else self._m
        halved = self.sizing.halved(failed)
        if halved is not None:
            self._set(halved, "oom")
            return
        if self.enable_activation_checkpointing is None or self._checkpointing:
            tried = " even with activation checkpointing" if self._checkpointing else ""
            raise ElasticBatchError(
                f"out of memory ({message}) at micro-batch {failed}{tried}; halving would go "
                f"below min_micro_batch={self.min_micro_batch} (effective batch "
                f"{self.effective_batch}). Lower the effective batch, the sequence length "
                "or the model size."
            )
        self.enable_activation_checkpointing()
        self._checkpointing = True
        self.sizing.forget()  # checkpointing changes the memory per sample: measure again
        self._set(failed, "activation_checkpointing")

    # -- the step ----------------------------------------------------------------------

    def run_step(
        self,
        batch: Batch,
        loss_fn: Callable[[Batch], torch.Tensor],
        *,
        model: nn.Module,
        backward: Callable[[torch.Tensor], None] | None = None,
        count: Callable[[Batch], int | torch.Tensor] | None = None,
        normalized: bool = False,
        rollbacks: Sequence[StepRollback] = (),
    ) -> torch.Tensor:
        """Runs forward and backward on ``batch`` in micro-batches; gradients accumulate
        in ``.grad`` exactly as one backward of the whole batch's mean loss would.

        Gradients must be clear (``None`` or from nothing else) when the step starts for
        an out-of-memory error to be recoverable: a re-run drops every gradient.

        Args:
            batch: the step's samples (a tensor, a mapping, or a tuple / list), sliced
                along dim 0 (see :func:`~hf_triaccel.memory.batches.slice_batch`).
            loss_fn: the loss of one piece, a scalar: the mean over the piece's items
                (or, with ``normalized=True``, already divided by the whole batch's
                item count).
            model: the model being trained (the DDP wrapper under DDP): its parameters'
                gradients are dropped before a re-run, and its ``no_sync()`` is used for
                every piece but the last.
            backward: runs the backward of a weighted loss (default
                ``loss.backward()``; e.g. ``accelerator.backward`` or
                ``lambda l: scaler.scale(l).backward()``).
            count: items in a piece, for losses averaged over something other than
                samples (tokens: ``lambda b: (b["labels"] != -100).sum()``); a piece's
                loss is weighted by ``count(piece) / count(batch)``. Default: samples.
            normalized: the loss of a piece is already its share of the batch loss
                (summed and divided by the batch's item count): pieces are added as
                they are.
            rollbacks: more state to restore before a re-run (Fisher statistics, ...);
                BatchNorm running statistics are always restored.

        Returns:
            The batch loss (the weighted sum of the pieces' losses), detached.

        Raises:
            ElasticBatchError: the step cannot fit even at ``min_micro_batch`` (after
                activation checkpointing, when available), or cannot be re-run exactly.
            Exception: any error that is not an out-of-memory error, unchanged; fatal
                CUDA errors are never retried.
        """
        n = batch_size(batch)
        total = None if normalized or count is None else count(batch)
        measure = self.probe.measures and self._is_check(self._steps)

        def weight(piece: Batch, size: int) -> float | torch.Tensor:
            return 1.0 if normalized else piece_weight(piece, size, n, count, total)

        def attempt(progress: AttemptProgress) -> torch.Tensor:
            step = (batch, n, loss_fn, model, backward or torch.Tensor.backward, weight, measure)
            return self._attempt(*step, progress)

        loss, progress = run_with_retries(
            attempt,
            model=model,
            rollbacks=[self._running_stats(model), *rollbacks],
            on_oom=self._on_oom,
        )
        if measure and progress.regular_max:
            peak = self.probe.peak()
            if peak is not None:
                self.sizing.measured(peak, progress.regular_max)
        self._stable += 1
        if self._is_check(self._steps):
            self._check()
        self._steps += 1
        return loss

    def _running_stats(self, model: nn.Module) -> RunningStatsRollback:
        if self._stats_rollback is None or self._stats_rollback[0] is not model:
            self._stats_rollback = (model, RunningStatsRollback(model))  # one per model
        return self._stats_rollback[1]

    def _attempt(
        self,
        batch: Batch,
        n: int,
        loss_fn: Callable[[Batch], torch.Tensor],
        model: nn.Module,
        backward: Callable[[torch.Tensor], None],
        weight: Callable[[Batch, int], float | torch.Tensor],
        measure: bool,
        progress: AttemptProgress,
    ) -> torch.Tensor:
        no_sync = getattr(model, "no_sync", None)
        plan = self.sizing.probe_sizes(self._m, n) if self.probe.measures else []
        measured: list[tuple[int, int]] = []  # (size, peak) of the probe pieces
        total: torch.Tensor | None = None
        start = 0
        while start < n:
            probing = bool(plan)
            size = min(plan.pop(0) if probing else self._m, n - start)
            stop = start + size
            last = stop >= n
            piece = slice_batch(batch, start, stop, n)
            w = weight(piece, size)
            if probing or (measure and not progress.regular_max):
                self.probe.reset_peak()
            progress.size, progress.probing, progress.backward = size, probing, False
            progress.syncing = last and syncs_gradients(model)
            with no_sync() if no_sync is not None and not last else contextlib.nullcontext():
                loss = loss_fn(piece)
                loss = loss * (w.to(loss.dtype) if torch.is_tensor(w) else w)
                progress.backward = True
                backward(loss)
            total = loss.detach() if total is None else total + loss.detach()
            if probing:
                measured.append((size, self.probe.peak()))
                if not plan:
                    self.sizing.fit(*measured[1], *measured[2])
                    snapshot = self.probe.snapshot()
                    if snapshot is not None:
                        self._set(self.sizing.fitting(snapshot), "probe")
            else:
                progress.regular_max = max(progress.regular_max, size)
            start = stop
        return total

    # -- checkpoints -------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The controller's state, JSON-serialisable.

        Example:
            >>> state = ElasticBatchController(8).state_dict()
            >>> state["micro_batch"], state["steps"]
            (8, 0)
        """
        return {
            "effective_batch": self.effective_batch,
            "micro_batch": self._m,
            "steps": self._steps,
            "stable_steps": self._stable,
            **self.sizing.state_dict(),
            "activation_checkpointing": self._checkpointing,
            "events": [asdict(e) for e in self.events],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores :meth:`state_dict`'s output; switches activation checkpointing back
        on when it was on (the hook is called). A size outside this controller's
        bounds is clamped to them."""
        self._m = max(self.min_micro_batch, min(int(state["micro_batch"]), self.max_micro_batch))
        self._steps = int(state["steps"])
        self._stable = int(state["stable_steps"])
        self.sizing.load_state_dict(state)
        self.events = [ElasticEvent(**e) for e in state["events"]]
        hook = self.enable_activation_checkpointing
        if state["activation_checkpointing"] and not self._checkpointing and hook is not None:
            hook()
            self._checkpointing = True

    def __repr__(self) -> str:
        return (
            f"ElasticBatchController(effective_batch={self.effective_batch}, "
            f"micro_batch={self._m}, accumulation={self.accumulation})"
        )
