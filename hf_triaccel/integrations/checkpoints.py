"""Crash-consistent Trainer checkpoints: a completion marker, and resuming from the newest
complete checkpoint.

A Trainer checkpoint is a folder of files written one after another, by several processes
under DDP or FSDP (each rank its RNG state, FSDP each rank its shards). A process killed
part-way leaves a folder that looks like a checkpoint and is not one; transformers'
``resume_from_checkpoint=True`` picks the newest folder whatever it holds.

:class:`CrashConsistentCheckpoints` (a ``TrainerCallback``) makes completeness explicit:
when the Trainer has written a checkpoint, every process waits at a barrier (every rank's
files are written), then the main process writes :data:`COMPLETE_MARKER` into the folder
(a small file written under a temporary name and renamed within the folder, so that it is
whole or absent), and every process waits again, so that none goes on (or exits) before
the checkpoint is marked. It also keeps ``save_total_limit`` from removing the last
complete checkpoint: the Trainer's own rotation runs before the marker is written, so the
callback rotates after the marker instead, counting complete checkpoints only.

:func:`last_complete_checkpoint` is what a resume loads: the newest folder that holds the
marker. Newer folders without it are skipped with a warning and left where they are.
Why a marker rather than a temporary folder renamed when complete: docs/design.md,
"Crash-consistent checkpoints".

Example:
    >>> import os, tempfile
    >>> out = tempfile.mkdtemp()
    >>> for step in (10, 20):
    ...     os.makedirs(os.path.join(out, f"checkpoint-{step}"))
    >>> mark_complete(os.path.join(out, "checkpoint-10"), global_step=10, world_size=1)
    >>> os.path.basename(last_complete_checkpoint(out))  # checkpoint-20 has no marker
    'checkpoint-10'
    >>> resume_path(RESUME_OR_START, tempfile.mkdtemp()) is None  # nothing yet: start
    True
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from typing import Any

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

__all__ = [
    "COMPLETE_MARKER",
    "RESUME_OR_START",
    "CrashConsistentCheckpoints",
    "is_complete",
    "last_complete_checkpoint",
    "mark_complete",
    "resume_path",
]

logger = logging.getLogger(__name__)

COMPLETE_MARKER = "checkpoint-complete.json"
"""The file, written last into a checkpoint folder, that says every rank's files are there."""

RESUME_OR_START = "auto"
"""``resume_from_checkpoint`` value: the newest complete checkpoint when there is one, else
a fresh start (the same command starts a run and resumes it)."""

_CHECKPOINT = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")


def checkpoint_folders(output_dir: str | os.PathLike) -> list[tuple[int, str]]:
    """``(step, path)`` of every ``checkpoint-N`` folder in ``output_dir``, oldest step first
    (none when the folder does not exist)."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        match = _CHECKPOINT.match(name)
        path = os.path.join(output_dir, name)
        if match and os.path.isdir(path):
            found.append((int(match.group(1)), path))
    return sorted(found)


def is_complete(folder: str | os.PathLike) -> bool:
    """Whether a checkpoint folder holds :data:`COMPLETE_MARKER`."""
    return os.path.isfile(os.path.join(folder, COMPLETE_MARKER))


def mark_complete(folder: str | os.PathLike, *, global_step: int, world_size: int) -> None:
    """Writes :data:`COMPLETE_MARKER` into ``folder``: under a temporary name, flushed to
    disk, then renamed within the folder (a file rename by one process: the marker is
    whole or absent), the folder's entry flushed too."""
    record = {"global_step": global_step, "world_size": world_size, "written_at": time.time()}
    temporary = os.path.join(folder, f".{COMPLETE_MARKER}.tmp")
    with open(temporary, "w", encoding="utf-8") as f:
        json.dump(record, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, os.path.join(folder, COMPLETE_MARKER))
    try:
        descriptor = os.open(folder, os.O_RDONLY)
    except OSError:  # a filesystem without directory descriptors: the rename stands
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass  # some network filesystems refuse fsync on a directory
    finally:
        os.close(descriptor)


def last_complete_checkpoint(output_dir: str | os.PathLike) -> str | None:
    """The newest complete checkpoint folder of ``output_dir``, or ``None``.

    Folders newer than it without the marker (a save that was killed) are skipped with a
    warning naming them; they are never deleted here.

    Example:
        >>> import tempfile
        >>> last_complete_checkpoint(tempfile.mkdtemp()) is None
        True
    """
    for _, path in reversed(checkpoint_folders(output_dir)):
        if is_complete(path):
            return path
        logger.warning(
            "checkpoint %s is incomplete (no %s: its save was interrupted): skipped, left in place",
            path,
            COMPLETE_MARKER,
        )
    return None


def resume_path(
    resume_from_checkpoint: str | bool | None, output_dir: str | os.PathLike
) -> str | None:
    """What ``Trainer.train(resume_from_checkpoint=...)`` should receive.

    Args:
        resume_from_checkpoint: :data:`RESUME_OR_START` (``"auto"``): the newest complete
            checkpoint, or ``None`` (start) when there is none; ``True``: the newest
            complete checkpoint, an error when there is none (as transformers' ``True``);
            a path or ``None``: returned as given.
        output_dir: the folder holding the ``checkpoint-N`` folders.

    Raises:
        ValueError: ``True`` and no complete checkpoint in ``output_dir``.
    """
    if resume_from_checkpoint == RESUME_OR_START:
        return last_complete_checkpoint(output_dir)
    if resume_from_checkpoint is True:
        found = last_complete_checkpoint(output_dir)
        if found is None:
            raise ValueError(
                f"resume_from_checkpoint=True: no complete checkpoint in {output_dir} (use "
                f"resume_from_checkpoint={RESUME_OR_START!r} to start when there is none)"
            )
        return found
    return resume_from_checkpoint or None


def barrier() -> None:
    """Waits for every process of the default process group (nothing without one)."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


class CrashConsistentCheckpoints(TrainerCallback):
    """Marks each checkpoint complete once every process has written it, and applies
    ``save_total_limit`` over complete checkpoints only. Works with any
    ``transformers.Trainer`` (``TriAccelTrainer`` adds it itself).

    The Trainer's own rotation would run before the marker is written, and could remove
    the last complete checkpoint (with ``save_total_limit=1``, or when a killed save left a
    folder behind): while ``train()`` runs, ``args.save_total_limit`` reads ``None`` (it
    is restored when training ends), and :meth:`on_save` rotates instead: the newest
    ``save_total_limit`` complete checkpoints (and ``best_model_checkpoint``) stay, and
    incomplete folders older than the newest complete one are removed, each with a
    warning.

    List it after :class:`~hf_triaccel.integrations.preemption.PreemptionHandler`, whose
    ``on_step_end`` asks for the save that this callback's ``on_step_end`` prepares.

    Example:
        >>> import tempfile
        >>> from transformers import Trainer, TrainingArguments
        >>> model = torch.nn.Linear(2, 2)
        >>> args = TrainingArguments(output_dir=tempfile.mkdtemp(), report_to=[], use_cpu=True)
        >>> trainer = Trainer(model=model, args=args, callbacks=[CrashConsistentCheckpoints()])
        >>> # resume from the newest complete checkpoint, or start when there is none:
        >>> # trainer.train(resume_from_checkpoint=last_complete_checkpoint(args.output_dir))
    """

    def __init__(self) -> None:
        self._held_limit: int | None = None
        self._holding = False

    def on_train_begin(self, args: TrainingArguments, state, control, **kwargs: Any) -> None:
        if args.save_total_limit and not self._holding:
            self._held_limit, self._holding = args.save_total_limit, True
            args.save_total_limit = None  # rotated in on_save, after the marker

    def on_train_end(self, args: TrainingArguments, state, control, **kwargs: Any) -> None:
        if self._holding:
            args.save_total_limit, self._holding = self._held_limit, False

    def _before_save(self, args: TrainingArguments, state: TrainerState) -> None:
        folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        if args.should_save and is_complete(folder):
            # a folder about to be written again is not complete until written again
            os.remove(os.path.join(folder, COMPLETE_MARKER))

    def on_step_end(self, args, state, control: TrainerControl, **kwargs: Any) -> None:
        if control.should_save:
            self._before_save(args, state)

    def on_epoch_end(self, args, state, control: TrainerControl, **kwargs: Any) -> None:
        if control.should_save:
            self._before_save(args, state)

    def on_save(self, args, state, control, **kwargs: Any) -> None:
        folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        barrier()  # every rank's files are written
        if args.should_save and os.path.isdir(folder):
            mark_complete(folder, global_step=state.global_step, world_size=args.world_size)
            if self._holding:
                self._rotate(args.output_dir, self._held_limit, state.best_model_checkpoint)
        barrier()  # no rank goes on (or exits) before the marker is written

    @staticmethod
    def _rotate(output_dir: str, limit: int | None, best: str | None) -> None:
        if not limit or limit <= 0:
            return
        folders = checkpoint_folders(output_dir)
        complete = [path for _, path in folders if is_complete(path)]
        if not complete:
            return
        keep = set(complete[-limit:])
        if best:
            keep.add(os.path.normpath(best))
        newest_complete = max(step for step, path in folders if path == complete[-1])
        for step, path in folders:
            if os.path.normpath(path) in keep or path in keep:
                continue
            if is_complete(path):
                logger.info("removing %s (save_total_limit=%d)", path, limit)
            elif step < newest_complete:
                logger.warning(
                    "removing %s: incomplete (an interrupted save) and older than the newest "
                    "complete checkpoint",
                    path,
                )
            else:
                continue  # newer than every complete one: left for the user to look at
            shutil.rmtree(path, ignore_errors=True)
