"""Memory-elastic batch scaling: the micro-batch follows live device memory.

The effective batch ``E`` (what the caller asked for) never changes. Each step splits
its ``E`` samples into ``ceil(E / m)`` pieces of ``m`` samples (the last may be
smaller), runs forward and backward on each with the loss weighted by its share of
the batch, and so accumulates exactly the gradient of the full-batch mean loss.
Only ``m`` moves:

* **Sizing.** On the first step, three pieces ``p, p, 2p`` (a warm-up, then two
  measured) give the per-sample activation memory (slope) and the fixed part
  (intercept) of the step's peak; ``m`` is the largest size whose predicted peak stays
  under ``target_fraction`` of what the device can give this process.
* **Shrink before an OOM.** Every ``check_every`` steps the probe is read again and
  the intercept refreshed from the step's measured peak; when free memory dropped
  (another process, a longer sequence, the optimizer state), ``m`` shrinks.
* **OOM inside a step.** Memory is freed, ``m`` halves, and the *same* samples are
  run again from scratch: the gradients of the failed attempt are dropped, so no
  sample is counted twice and none is lost. Fatal CUDA errors are never retried.
  Below ``min_micro_batch``, activation checkpointing is switched on once, then the
  controller gives up with :class:`ElasticBatchError`.
* **Grow back.** After ``grow_after`` steps without a shrink, ``m`` grows to what
  the device can give again.
* **Data parallel.** Ranks agree on ``m`` (all-reduce MIN) at every check, and only
  the last piece synchronises gradients (``no_sync()`` for the others).

The controller knows nothing of the Trainer: :meth:`ElasticBatchController.run_step`
takes a batch, a function that computes the loss of a piece, and the model.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _NormBase

from hf_triaccel.memory.probe import MemoryProbe, MemorySnapshot, default_probe, is_oom

Batch = Any  # a tensor, a mapping of tensors, or a tuple / list of them


class ElasticBatchError(Exception):
    """A step cannot be run within the device's memory, or cannot be re-run exactly.

    Not a ``RuntimeError``: out-of-memory handlers further up (Accelerate's
    ``find_executable_batch_size``, :func:`~hf_triaccel.memory.probe.is_oom`) must not
    take it for one more retryable OOM.
    """


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


class StepRollback(Protocol):
    """State that a step changes besides gradients, restored before a re-run.

    :meth:`save` is called before the first piece of every step, :meth:`restore`
    before each re-run of the step after an out-of-memory error.
    """

    def save(self) -> None: ...

    def restore(self) -> None: ...


class RunningStatsRollback:
    """Restores BatchNorm running statistics, so a re-run step updates them once.

    Example:
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
        >>> rollback = RunningStatsRollback(model)
        >>> rollback.save(); _ = model(torch.randn(8, 4)); rollback.restore()
        >>> model[1].num_batches_tracked.item()
        0
    """

    def __init__(self, model: nn.Module) -> None:
        self._norms = [
            m for m in model.modules() if isinstance(m, _NormBase) and m.track_running_stats
        ]
        self._saved: list[torch.Tensor] = []

    def _buffers(self) -> list[torch.Tensor]:
        # read at each call: model.to() replaces buffer tensors
        return [
            b
            for m in self._norms
            for b in (m.running_mean, m.running_var, m.num_batches_tracked)
            if b is not None
        ]

    def save(self) -> None:
        buffers = self._buffers()
        if not buffers:
            return
        if [(s.shape, s.dtype, s.device) for s in self._saved] != [
            (b.shape, b.dtype, b.device) for b in buffers
        ]:
            self._saved = [torch.empty_like(b) for b in buffers]
        torch._foreach_copy_(self._saved, buffers)

    def restore(self) -> None:
        buffers = self._buffers()
        if buffers and self._saved:
            with torch.no_grad():
                torch._foreach_copy_(buffers, self._saved)


def batch_size(batch: Batch) -> int:
    """Number of samples: the leading size of the batch's first tensor.

    Example:
        >>> batch_size({"input_ids": torch.zeros(6, 3), "labels": torch.zeros(6)})
        6
    """
    for value in _values(batch):
        if isinstance(value, torch.Tensor) and value.dim() >= 1:
            return value.shape[0]
    raise ValueError(f"the batch holds no tensor with a batch dimension: {type(batch).__name__}")


def _values(batch: Batch) -> list[Any]:
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, Mapping):
        return [v for value in batch.values() for v in _values(value)]
    if isinstance(batch, (tuple, list)):
        return [v for value in batch for v in _values(value)]
    return []


def slice_batch(batch: Batch, start: int, stop: int, n: int | None = None) -> Batch:
    """Samples ``start:stop`` of a batch of ``n`` samples.

    Tensors whose leading size is ``n`` are sliced along dim 0, and so are sequences
    of ``n`` non-tensor items (a list of strings); anything else is passed whole.
    Mappings come back as ``dict``, tuples and lists as their own type.

    Example:
        >>> piece = slice_batch({"x": torch.arange(6), "scale": 2.0}, 2, 4)
        >>> piece["x"].tolist(), piece["scale"]
        ([2, 3], 2.0)
    """
    n = batch_size(batch) if n is None else n

    def cut(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value[start:stop] if value.dim() >= 1 and value.shape[0] == n else value
        if isinstance(value, Mapping):
            return {k: cut(v) for k, v in value.items()}
        if isinstance(value, (tuple, list)):
            if not _values(value):  # items are samples (strings, ids), not fields
                return value[start:stop] if len(value) == n else value
            items = [cut(v) for v in value]
            if hasattr(value, "_fields"):  # namedtuple
                return type(value)(*items)
            return type(value)(items)
        return value

    return cut(batch)


@dataclass
class _Progress:
    """Where an attempt is, read after it fails (plain values: no tensor outlives it)."""

    size: int = 0
    probing: bool = False
    backward: bool = False
    syncing: bool = False
    regular_max: int = 0


def _syncs_gradients(model: nn.Module) -> bool:
    """Whether a backward through ``model`` now all-reduces gradients (DDP, sync on)."""
    return (
        getattr(model, "require_backward_grad_sync", False)
        and dist.is_available()
        and dist.is_initialized()
        and dist.get_world_size() > 1
    )


class _DDPBufferSync:
    """Keeps a re-run step to the one buffer broadcast DDP makes per step.

    DDP broadcasts module buffers in the first forward after a synchronised backward.
    If the failed attempt already entered that forward, the re-run must not broadcast
    again: the other ranks would wait on a collective this rank never matches.
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
        if self.model is not None and self.entered:
            self.model.require_forward_param_sync = False

    def close(self) -> None:
        if self._handle is not None:
            self._handle.remove()


def _ratio(part: int | torch.Tensor, whole: int | torch.Tensor) -> float | torch.Tensor:
    """``part / whole`` in float64: counts can be tensors (token counts on the device),
    whose integer division would round to float32."""
    if torch.is_tensor(part) or torch.is_tensor(whole):
        return torch.as_tensor(part, dtype=torch.float64) / torch.as_tensor(
            whole, dtype=torch.float64
        )
    return part / whole


def _backward(loss: torch.Tensor) -> None:
    loss.backward()


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
            activation memory (e.g. ``lambda: checkpoint_largest_blocks(model)``).
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
        checks = [
            ("effective_batch", effective_batch >= 1, "needs >= 1"),
            ("min_micro_batch", 1 <= min_micro_batch <= effective_batch, "needs 1 <= min <= E"),
            (
                "max_micro_batch",
                min_micro_batch <= max_micro_batch <= effective_batch,
                "needs min <= max <= E",
            ),
            ("target_fraction", 0.0 < target_fraction <= 1.0, "needs 0 < fraction <= 1"),
            ("check_every", check_every >= 1, "needs >= 1"),
            ("grow_after", grow_after >= 0, "needs >= 0"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise ValueError(f"ElasticBatchController {name}: {why}")
        self.effective_batch = effective_batch
        self.min_micro_batch = min_micro_batch
        self.max_micro_batch = max_micro_batch
        self.target_fraction = target_fraction
        self.check_every = check_every
        self.grow_after = grow_after
        self.probe = default_probe() if probe is None else probe
        self.enable_activation_checkpointing = enable_activation_checkpointing
        self.process_group = process_group
        self.events: list[ElasticEvent] = []
        self._m = self._balanced(max_micro_batch)
        self._steps = 0
        self._stable = 0
        self._slope: float | None = None  # bytes per sample; None until measured
        self._base = 0.0  # bytes of the peak that do not scale with the micro-batch
        self._checkpointing = False
        # (size, bytes available) of the last OOM: that size is not proposed again
        # until more memory is available than then
        # (failed size, available, allocated) at the last OOM
        self._oom: tuple[int, int, int] | None = None
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
        return None if self._slope is None else self._base + self._slope * m

    # -- sizing ------------------------------------------------------------------------

    def _balanced(self, cap: int) -> int:
        """The size for at most ``cap`` samples per piece with the fewest, most even
        pieces: ``ceil(E / k)`` for ``k = ceil(E / cap)``. Even pieces lower the peak
        at the same piece count and avoid a tiny last piece."""
        cap = max(self.min_micro_batch, min(cap, self.max_micro_batch))
        pieces = -(-self.effective_batch // cap)
        size = -(-self.effective_batch // pieces)
        return size if size >= self.min_micro_batch else cap

    def _fitting_size(self, snapshot: MemorySnapshot) -> int:
        """Largest balanced size whose predicted peak fits ``target_fraction`` of what
        the device can give this process (at least ``min_micro_batch``)."""
        limit = self.max_micro_batch
        if self._slope:
            room = self.target_fraction * snapshot.available - self._base
            limit = min(limit, math.floor(room / self._slope))
        if self._oom is not None and not self._memory_returned(snapshot):
            limit = min(limit, self._oom[0] - 1)
        return self._balanced(max(self.min_micro_batch, limit))

    def _memory_returned(self, snapshot: MemorySnapshot) -> bool:
        """Whether there is more room than at the last OOM: more available to the process
        (another process let go), or less held by it (a tensor of its own was freed, which
        under a budget never shows as more available). A margin of one smallest piece
        keeps allocator noise from re-trying the size that failed."""
        _, available, allocated = self._oom
        margin = (self._slope or 0.0) * self.min_micro_batch
        return snapshot.available > available or snapshot.allocated + margin < allocated

    def _probe_plan(self, n: int) -> list[int]:
        """Sizes of the measuring pieces: a warm-up ``p`` (allocates the gradients and
        workspaces, which would otherwise inflate the first measurement), then ``p``
        and ``2p``. Empty when already measured, not measurable, or the batch is too
        small; ``2p <= m`` keeps them no larger than a piece that is expected to fit."""
        if self._slope is not None or not self.probe.measures:
            return []
        p = max(self.min_micro_batch, self._m // 8)
        return [p, p, 2 * p] if 2 * p <= self._m and 4 * p <= n else []

    def _set(self, new: int, reason: str) -> None:
        if new != self._m or reason == "activation_checkpointing":
            self.events.append(ElasticEvent(self._steps, self._m, new, reason))
        if new < self._m:
            self._stable = 0
        self._m = new

    def agree(self, m: int) -> int:
        """The smallest ``m`` over the ranks of the process group (``m`` itself when
        ``torch.distributed`` is not initialised). Every rank must call it.

        Example:
            >>> ElasticBatchController(8).agree(5)
            5
        """
        if not (dist.is_available() and dist.is_initialized()):
            return m
        if dist.get_world_size(self.process_group) == 1:
            return m
        backend = dist.get_backend(self.process_group)
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else "cpu"
        value = torch.tensor([m], dtype=torch.int64, device=device)
        dist.all_reduce(value, op=dist.ReduceOp.MIN, group=self.process_group)
        return int(value.item())

    def _is_check(self, step: int) -> bool:
        # step 0 ends with the probe's choice, step 1 is the first with the optimizer
        # state allocated: both are checked, then every check_every steps
        return step < 2 or (step + 1) % self.check_every == 0

    def _check(self) -> None:
        proposal, reason = self._m, "agree"
        snapshot = self.probe.snapshot() if self.probe.measures else None
        if snapshot is not None and self._slope is not None:
            fitting = self._fitting_size(snapshot)
            if fitting < self._m:
                proposal, reason = fitting, "low_memory"
            elif fitting > self._m and self._stable >= self.grow_after:
                proposal, reason = fitting, "grow"
        agreed = self.agree(proposal)
        self._set(agreed, reason if agreed == proposal else "agree")

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
                along dim 0 (see :func:`slice_batch`).
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
        params = [p for p in model.parameters() if p.requires_grad]
        carried = any(p.grad is not None for p in params)
        rollbacks = [self._running_stats(model), *rollbacks]
        for rollback in rollbacks:
            rollback.save()
        total_count = None if normalized or count is None else count(batch)
        measure = self.probe.measures and self._is_check(self._steps)
        buffer_sync = _DDPBufferSync(model)
        try:
            while True:
                progress = _Progress()
                try:
                    total = self._attempt(
                        batch,
                        n,
                        loss_fn,
                        model,
                        backward or _backward,
                        count,
                        total_count,
                        normalized,
                        measure,
                        progress,
                    )
                    break
                except Exception as exc:
                    if not is_oom(exc):  # fatal CUDA errors included: never retried
                        raise
                    message = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                # Past the except clause the traceback, and with it every tensor of the
                # failed attempt, is gone: only now can memory be given back.
                self._recover(progress, message, carried)
                for p in params:
                    p.grad = None
                for rollback in rollbacks:
                    rollback.restore()
                buffer_sync.before_retry()
        finally:
            buffer_sync.close()
        if measure and progress.regular_max and self._slope is not None:
            peak = self.probe.peak()
            if peak is not None:
                self._base = peak - self._slope * progress.regular_max
        self._stable += 1
        if self._is_check(self._steps):
            self._check()
        self._steps += 1
        return total

    def _running_stats(self, model: nn.Module) -> RunningStatsRollback:
        if self._stats_rollback is None or self._stats_rollback[0] is not model:
            self._stats_rollback = (model, RunningStatsRollback(model))
        return self._stats_rollback[1]

    def _attempt(
        self,
        batch: Batch,
        n: int,
        loss_fn: Callable[[Batch], torch.Tensor],
        model: nn.Module,
        backward: Callable[[torch.Tensor], None],
        count: Callable[[Batch], int | torch.Tensor] | None,
        total_count: int | torch.Tensor | None,
        normalized: bool,
        measure: bool,
        progress: _Progress,
    ) -> torch.Tensor:
        no_sync = getattr(model, "no_sync", None)
        plan = self._probe_plan(n)
        measured: list[tuple[int, int]] = []  # (size, peak) of the probe pieces
        total: torch.Tensor | None = None
        start = 0
        while start < n:
            probing = bool(plan)
            size = min(plan.pop(0) if probing else self._m, n - start)
            stop = start + size
            last = stop >= n
            piece = slice_batch(batch, start, stop, n)
            if normalized:
                weight: float | torch.Tensor = 1.0
            elif count is None:
                weight = size / n
            else:
                weight = _ratio(count(piece), total_count)
            if probing or (measure and not progress.regular_max):
                self.probe.reset_peak()
            progress.size, progress.probing, progress.backward = size, probing, False
            progress.syncing = last and _syncs_gradients(model)
            with no_sync() if no_sync is not None and not last else contextlib.nullcontext():
                loss = loss_fn(piece)
                loss = loss * (weight.to(loss.dtype) if torch.is_tensor(weight) else weight)
                progress.backward = True
                backward(loss)
            total = loss.detach() if total is None else total + loss.detach()
            if probing:
                measured.append((size, self.probe.peak()))
                if not plan:
                    self._fit(*measured[1], *measured[2])
            else:
                progress.regular_max = max(progress.regular_max, size)
            start = stop
        return total

    def _fit(self, size_a: int, peak_a: int, size_b: int, peak_b: int) -> None:
        """Slope and intercept from the peaks of two pieces, then the size they allow."""
        self._slope = max(0.0, (peak_b - peak_a) / (size_b - size_a))
        self._base = peak_a - self._slope * size_a
        snapshot = self.probe.snapshot()
        if snapshot is not None:
            self._set(self._fitting_size(snapshot), "probe")

    def _recover(self, progress: _Progress, message: str, carried: bool) -> None:
        """After an OOM: frees memory, corrects the memory model, and shrinks ``m`` (or
        switches on activation checkpointing, or gives up)."""
        if carried:
            raise ElasticBatchError(
                f"out of memory ({message}) with gradients from before this step present: "
                "the step cannot be re-run without losing them. Let the controller own "
                "gradient accumulation (e.g. Trainer gradient_accumulation_steps=1)."
            )
        if progress.syncing and progress.backward:
            raise ElasticBatchError(
                f"out of memory ({message}) in the backward that all-reduces gradients "
                "(DDP): the reduction was partly launched and cannot be re-run. Lower "
                "target_fraction or max_micro_batch so that the last piece fits."
            )
        self.probe.release()
        snapshot = self.probe.snapshot()
        if snapshot is not None:
            self._oom = (progress.size, snapshot.available, snapshot.allocated)
            if self._slope is not None:
                # the failed size did not fit in what was available: the intercept is
                # at least that much, whatever the earlier measurements said
                self._base = max(self._base, snapshot.available - self._slope * progress.size)
        failed = progress.size if progress.probing else self._m
        cap = failed // 2
        if cap >= self.min_micro_batch:
            self._set(self._balanced(cap), "oom")
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
        # checkpointing changes the memory per sample: measure again
        self._slope, self._base = None, 0.0
        self._set(failed, "activation_checkpointing")

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
            "slope": self._slope,
            "base": self._base,
            "activation_checkpointing": self._checkpointing,
            "last_oom": None if self._oom is None else list(self._oom),
            "events": [asdict(e) for e in self.events],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores :meth:`state_dict`'s output; switches activation checkpointing back
        on when it was on (the hook is called). A size outside this controller's
        bounds is clamped to them."""
        self._m = max(self.min_micro_batch, min(int(state["micro_batch"]), self.max_micro_batch))
        self._steps = int(state["steps"])
        self._stable = int(state["stable_steps"])
        self._slope = None if state["slope"] is None else float(state["slope"])
        self._base = float(state["base"])
        self._oom = None if state["last_oom"] is None else tuple(state["last_oom"])
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
