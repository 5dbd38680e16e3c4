"""Re-running a training step after an out-of-memory error, exactly.

:func:`run_with_retries` runs an attempt of a step; when it fails with an out-of-memory
error, the gradients it left are dropped, the state it changed is restored (step
rollbacks, DDP's buffer broadcast), and the *same* samples run again from scratch, so
that no sample is counted twice and none is lost. What size the re-run uses is not
decided here: ``on_oom`` shrinks the micro-batch, or raises to give up. Errors that are
not out-of-memory errors, fatal CUDA errors included, propagate unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from torch import nn

from hf_triaccel.memory.distributed import DDPBufferSync, sharded_over_processes
from hf_triaccel.memory.probe import is_oom
from hf_triaccel.memory.rollback import StepRollback

T = TypeVar("T")


class ElasticBatchError(Exception):
    """A step cannot be run within the device's memory, or cannot be re-run exactly.

    Not a ``RuntimeError``: out-of-memory handlers further up (Accelerate's
    ``find_executable_batch_size``, :func:`~hf_triaccel.memory.probe.is_oom`) must not
    take it for one more retryable OOM.
    """


@dataclass
class AttemptProgress:
    """Where an attempt is, read after it fails (plain values: no tensor outlives it).

    Attributes:
        size: samples of the piece being run.
        probing: whether that piece is a measuring piece.
        backward: whether its backward started.
        syncing: whether its backward all-reduces gradients (the last piece, DDP).
        regular_max: largest regular (not measuring) piece finished so far.
    """

    size: int = 0
    probing: bool = False
    backward: bool = False
    syncing: bool = False
    regular_max: int = 0


def check_rerunnable(
    progress: AttemptProgress, message: str, carried: bool, sharded: bool = False
) -> None:
    """Raises :class:`ElasticBatchError` when a failed step cannot be re-run exactly:
    gradients from before the step (``carried``) would be lost, a gradient all-reduce
    was partly launched, or the model is sharded over several processes (``sharded``:
    FSDP2 gathers parameters inside the forward and backward, so a process that re-ran
    alone would no longer match the others' collectives).

    Example:
        >>> check_rerunnable(AttemptProgress(), "CUDA out of memory.", False, sharded=True)
        Traceback (most recent call last):
        ...
        hf_triaccel.memory.retry.ElasticBatchError: out of memory (CUDA out of memory.) on ...
    """
    if sharded:
        raise ElasticBatchError(
            f"out of memory ({message}) on this process under FSDP2: a step cannot be "
            "re-run by one process alone (its forward and backward gather parameters with "
            "the others); lower target_fraction (elastic_target_fraction) or the batch size"
        )
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


def run_with_retries(
    attempt: Callable[[AttemptProgress], T],
    *,
    model: nn.Module,
    rollbacks: Sequence[StepRollback],
    on_oom: Callable[[AttemptProgress, str], None],
) -> tuple[T, AttemptProgress]:
    """Runs ``attempt`` until it finishes without an out-of-memory error.

    Args:
        attempt: runs the whole step, updating the progress it is given.
        model: the trained model (the DDP wrapper under DDP): its trainable parameters'
            gradients are dropped before each re-run.
        rollbacks: state saved before the first attempt, restored before each re-run.
        on_oom: called after a failure, once the failed attempt's tensors are gone, with
            its progress and the error's first line; frees memory and picks the next
            size, or raises to give up.

    Returns:
        The result of the attempt that finished, and its progress.

    Example:
        >>> import torch
        >>> failures = [torch.OutOfMemoryError("CUDA out of memory.")]
        >>> def attempt(progress):
        ...     if failures:
        ...         raise failures.pop()
        ...     return "done"
        >>> result, _ = run_with_retries(
        ...     attempt, model=nn.Linear(2, 2), rollbacks=[], on_oom=lambda p, m: print(m)
        ... )
        CUDA out of memory.
        >>> result
        'done'
    """
    params = [p for p in model.parameters() if p.requires_grad]
    carried = any(p.grad is not None for p in params)
    sharded = sharded_over_processes(model)
    for rollback in rollbacks:
        rollback.save()
    buffer_sync = DDPBufferSync(model)
    try:
        while True:
            progress = AttemptProgress()
            try:
                return attempt(progress), progress
            except Exception as exc:
                if not is_oom(exc):  # fatal CUDA errors included: never retried
                    raise
                message = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            # Past the except clause the traceback, and with it every tensor of the
            # failed attempt, is gone: only now can memory be given back.
            check_rerunnable(progress, message, carried, sharded)
            on_oom(progress, message)
            for p in params:
                p.grad = None
            for rollback in rollbacks:
                rollback.restore()
            buffer_sync.before_retry()
    finally:
        buffer_sync.close()
