"""transformers glue for memory-elastic batch scaling.

:class:`TrainerElasticBatch` runs each ``Trainer.training_step`` through an
:class:`~hf_triaccel.memory.elastic.ElasticBatchController`: the per-device batch is
the effective batch ``E``, split into micro-batches that follow live device memory; an
out-of-memory error in a forward or backward re-runs the step's samples in smaller
pieces. Its controller state is Trainer callback state (:class:`ElasticBatchState`, an
``ExportableState`` kept in ``TrainerState.stateful_callbacks``), so checkpoints carry it
and a resumed run starts at the micro-batch it had reached.

:class:`ElasticEvaluation` does the same for evaluation batches: an out-of-memory error
in ``prediction_step`` splits the batch (and every later one) into smaller pieces. It
never touches the training batch.

An out-of-memory error raised elsewhere in a step (the optimizer step, a callback)
cannot be re-run exactly; with ``auto_find_batch_size`` transformers' own search handles
it by restarting the loop with a smaller batch. :class:`FisherStatisticsRollback` keeps
AdaFisher's statistics exact when a step is re-run; hand-written loops pass it to
:meth:`~hf_triaccel.memory.elastic.ElasticBatchController.run_step` themselves.
"""

from __future__ import annotations

import json
import logging
import os
import warnings
from collections.abc import Callable
from typing import Any

import torch
from accelerate.utils import DistributedType
from transformers import Trainer, TrainerCallback
from transformers.trainer_callback import ExportableState
from transformers.trainer_pt_utils import nested_concat

from hf_triaccel.curvature.collector import FisherCollector
from hf_triaccel.integrations import trainer_compat
from hf_triaccel.memory import (
    CheckpointedBlocks,
    ElasticBatchController,
    ElasticBatchError,
    MemoryProbe,
    batch_size,
    default_probe,
    enable_activation_checkpointing,
    is_oom,
    slice_batch,
)

logger = logging.getLogger(__name__)

LEGACY_STATE_NAME = "elastic_batch.json"
"""Where hf_triaccel 0.1.0 kept the controller state, in each checkpoint folder."""


class FisherStatisticsRollback:
    """Forgets the Fisher statistics a failed attempt gathered before its step is re-run.

    A failed attempt may already have counted the statistics of some pieces; without
    this, the re-run would count them again. The collector gathers an optimizer step's
    statistics from its first micro-batch and forgets them at each fold, so a step that
    starts with nothing gathered is restored by forgetting everything gathered since
    (``FisherCollector.discard``). Costs one pass over the layers' counters per step.

    Example:
        >>> from torch import nn
        >>> collector = FisherCollector(nn.Linear(4, 2))
        >>> rollback = FisherStatisticsRollback(collector)
        >>> rollback.save(); rollback.restore()
    """

    def __init__(self, collector: FisherCollector) -> None:
        self.collector = collector
        self._clean = True

    def save(self) -> None:
        self._clean = all(
            ly.a_count == 0 and ly.g_count == 0 for ly in self.collector.layers.values()
        )

    def restore(self) -> None:
        if not self._clean:
            raise ElasticBatchError(
                "Fisher statistics from before this step are present: the step cannot be "
                "re-run exactly. Let the controller own gradient accumulation."
            )
        self.collector.discard()  # what the failed attempt queued, and holds


class ElasticBatchState(TrainerCallback, ExportableState):
    """The elastic controller's state in ``TrainerState.stateful_callbacks``: saved with
    every checkpoint, read back by :class:`TrainerElasticBatch` when training (re)starts.

    Constructible without arguments, as transformers rebuilds stateful callbacks under
    ``restore_callback_states_from_checkpoint``; the helper binds itself to the rebuilt
    instance when training begins.
    """

    def __init__(self, elastic: TrainerElasticBatch | None = None) -> None:
        self.elastic = elastic
        self.saved: dict[str, Any] | None = None

    def state(self) -> dict[str, Any]:
        saved = self.saved if self.elastic is None else self.elastic.controller.state_dict()
        return {"args": {}, "attributes": {"saved": saved}}


class TrainerElasticBatch(TrainerCallback):
    """Elastic micro-batching for a ``transformers.Trainer``.

    The effective batch per device is the Trainer's batch; set
    ``gradient_accumulation_steps=1`` and let the controller accumulate: with Trainer
    accumulation, an OOM in any but the first micro-batch of an optimizer step cannot
    be re-run exactly and raises. Single device, DDP and FSDP2; DeepSpeed is refused.
    Under FSDP the ranks agree on the micro-batch as under DDP, but an out-of-memory
    error on one rank is not re-run: FSDP gathers parameters inside the forward and
    backward, so a rank that re-ran alone would no longer match the others' collectives.
    It raises :class:`~hf_triaccel.memory.ElasticBatchError` instead.

    Args:
        trainer: the Trainer (its ``args``, ``accelerator``, ``compute_loss``, model).
        controller: the controller (default: built from ``trainer.args`` and
            ``controller_kwargs``).
        checkpoint_blocks: how many of the largest blocks the activation-checkpointing
            fallback wraps (default: all).
        **controller_kwargs: :class:`ElasticBatchController` arguments
            (``min_micro_batch``, ``target_fraction``, ``check_every``, ...).

    Example:
        ``TriAccelTrainer`` attaches it for ``elastic_batch=True``; any Trainer can::

            class MyTrainer(Trainer):
                def __init__(self, *args, **kwargs):
                    super().__init__(*args, **kwargs)
                    self.elastic = TrainerElasticBatch.attach(self, min_micro_batch=8)

                def training_step(self, model, inputs, num_items_in_batch=None):
                    return self.elastic.training_step(model, inputs, num_items_in_batch)
    """

    def __init__(
        self,
        trainer: Trainer,
        controller: ElasticBatchController | None = None,
        *,
        checkpoint_blocks: int | None = None,
        **controller_kwargs: Any,
    ) -> None:
        _check_trainer(trainer)
        self.trainer = trainer
        self.checkpoint_blocks = checkpoint_blocks
        self.checkpointed: CheckpointedBlocks | None = None
        if controller is None:
            controller_kwargs.setdefault("probe", default_probe(trainer.args.device))
            controller_kwargs.setdefault(
                "enable_activation_checkpointing", self.enable_activation_checkpointing
            )
            controller = ElasticBatchController(
                trainer.args.per_device_train_batch_size, **controller_kwargs
            )
        elif controller_kwargs:
            raise ValueError("give either a controller or controller arguments, not both")
        self.controller = controller
        self.exported = ElasticBatchState(self)
        self._fisher: FisherStatisticsRollback | None = None
        self._resume_from: str | None = None

    @classmethod
    def attach(cls, trainer: Trainer, **kwargs: Any) -> TrainerElasticBatch:
        """Builds the helper, registers it and its exported state as callbacks, and, when
        the trainer has ``telemetry``, registers its ``micro_batch`` / ``accumulation``."""
        helper = cls(trainer, **kwargs)
        trainer.add_callback(helper)
        trainer.add_callback(helper.exported)
        telemetry = getattr(trainer, "telemetry", None)
        if telemetry is not None:
            telemetry.add_provider(helper.metrics)
        return helper

    @property
    def probe(self) -> MemoryProbe:
        """The controller's memory probe."""
        return self.controller.probe

    def enable_activation_checkpointing(self) -> None:
        """The controller's last resort: switches activation checkpointing on, by the
        model's own switch (transformers', timm's) when it has one, else by wrapping its
        largest blocks (:func:`~hf_triaccel.memory.enable_activation_checkpointing`);
        nothing changes when the model's own checkpointing is already on."""
        model = self.trainer.accelerator.unwrap_model(self.trainer.model)
        handle = enable_activation_checkpointing(model, self.checkpoint_blocks)
        if not handle.switched_on:
            logger.warning("elastic batch: activation checkpointing is already on")
            return
        self.checkpointed = handle
        what = f"{len(handle)} blocks" if handle.method == "blocks" else handle.method
        logger.warning("elastic batch: activation checkpointing switched on (%s)", what)

    def metrics(self) -> dict[str, Any]:
        """Telemetry: ``micro_batch`` and ``accumulation``; on CUDA also the run's
        ``peak_memory_gb``, because the controller's peak windows reset the allocator's
        peak counter that the telemetry would otherwise read."""
        out: dict[str, Any] = self.controller.metrics()
        overall = getattr(self.probe, "overall_peak", None)
        if overall is not None:
            out["peak_memory_gb"] = round(overall / 2**30, 3)
        return out

    def training_step(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor:
        """``Trainer.training_step`` with the batch run in elastic micro-batches.

        Same contract as the Trainer's: returns the detached loss of the batch (divided
        by the Trainer's accumulation steps unless normalised by ``num_items_in_batch``).
        """
        trainer = self.trainer
        cp_context, inputs = trainer_compat.context_parallel_inputs(trainer, model, inputs)
        with cp_context():
            model.train()
            if callable(getattr(trainer.optimizer, "train", None)):
                trainer.optimizer.train()
            inputs = trainer_compat.prepare_inputs(trainer, inputs)
            normalized = trainer_compat.loss_is_scaled_for_ga(trainer, num_items_in_batch)
            divisor = 1 if normalized else trainer.current_gradient_accumulation_steps

            def loss_fn(piece: dict[str, Any]) -> torch.Tensor:
                with trainer.compute_loss_context_manager():
                    loss = trainer.compute_loss(model, piece, num_items_in_batch=num_items_in_batch)
                if loss.dim():  # DataParallel (n_gpu > 1): one loss per device
                    loss = loss.mean()
                return loss / divisor

            loss = self.controller.run_step(
                inputs,
                loss_fn,
                model=model,
                backward=trainer.accelerator.backward,
                normalized=normalized,
                rollbacks=self._rollbacks(),
            )
        del inputs
        steps = trainer.args.torch_empty_cache_steps
        if steps is not None and trainer.state.global_step % steps == 0:
            self.probe.release()
        return loss

    def _rollbacks(self) -> list[FisherStatisticsRollback]:
        collector = getattr(self.trainer, "collector", None)
        if not isinstance(collector, FisherCollector):
            return []
        if self._fisher is None or self._fisher.collector is not collector:
            self._fisher = FisherStatisticsRollback(collector)
        return [self._fisher]

    def resume(self, resume_from_checkpoint: str | None) -> None:
        """Notes the checkpoint a ``train()`` call resumes from (a folder, already
        resolved): a checkpoint of hf_triaccel 0.1.0 kept the state in a file there."""
        self._resume_from = resume_from_checkpoint

    def on_train_begin(self, args, state, control, **kwargs):
        for callback in self.trainer.callback_handler.callbacks:
            if isinstance(callback, ElasticBatchState) and callback.elastic is None:
                callback.elastic = self  # rebuilt by transformers from the checkpoint
        saved = state.stateful_callbacks.get(ElasticBatchState.__name__)
        if isinstance(saved, list):
            saved = saved[0]
        if saved is not None and saved["attributes"].get("saved") is not None:
            self.controller.load_state_dict(saved["attributes"]["saved"])
        elif self._resume_from is not None:
            legacy = os.path.join(self._resume_from, LEGACY_STATE_NAME)
            if os.path.isfile(legacy):
                with open(legacy) as f:
                    self.controller.load_state_dict(json.load(f))
        self._resume_from = None
        reset = getattr(self.probe, "reset_overall_peak", None)
        if callable(reset):
            reset()


def _combine(results: list[tuple[Any, Any, Any]], sizes: list[int]) -> tuple[Any, Any, Any]:
    """One ``prediction_step`` result from the results of a batch's pieces: the loss
    weighted by the pieces' sizes, logits and labels concatenated along the batch."""
    losses = [r[0] for r in results]
    loss = None
    if all(x is not None for x in losses):
        loss = sum(x * n for x, n in zip(losses, sizes, strict=True)) / sum(sizes)
    parts = []
    for k in (1, 2):
        joined = None
        for r in results:
            if r[k] is not None:
                joined = r[k] if joined is None else nested_concat(joined, r[k], padding_index=-100)
        parts.append(joined)
    return loss, parts[0], parts[1]


class ElasticEvaluation:
    """Splits evaluation batches that run out of memory; the training batch is untouched.

    On an out-of-memory error in a ``prediction_step``, cached memory is released and
    the batch is run in halves (then quarters, ...) down to ``min_micro_batch``; later
    batches are split at the size that fitted.

    Example:
        >>> evaluation = ElasticEvaluation()
        >>> def step(batch):
        ...     if len(batch["x"]) > 2:
        ...         raise torch.OutOfMemoryError("CUDA out of memory")
        ...     return batch["x"].float().mean(), batch["x"], None
        >>> loss, logits, _ = evaluation.run(step, {"x": torch.arange(8)})
        >>> evaluation.micro_batch, loss.item(), logits.tolist()
        (2, 3.5, [0, 1, 2, 3, 4, 5, 6, 7])
    """

    def __init__(self, min_micro_batch: int = 1, release: Callable[[], None] | None = None):
        self.min_micro_batch = min_micro_batch
        self.release = release or (lambda: None)
        self.micro_batch: int | None = None  # None: whole batches

    def run(self, step: Callable[[Any], tuple[Any, Any, Any]], inputs: Any) -> tuple:
        n = batch_size(inputs)
        while True:
            size = n if self.micro_batch is None else min(self.micro_batch, n)
            try:
                if size >= n:
                    return step(inputs)
                starts = range(0, n, size)
                pieces = [slice_batch(inputs, s, min(s + size, n), n) for s in starts]
                sizes = [min(s + size, n) - s for s in starts]
                return _combine([step(p) for p in pieces], sizes)
            except Exception as err:
                if not is_oom(err) or size <= self.min_micro_batch:
                    raise
                self.release()
                self.micro_batch = max(self.min_micro_batch, size // 2)
                logger.warning(
                    "evaluation ran out of memory with %d samples per forward: now %d",
                    size,
                    self.micro_batch,
                )


def _check_trainer(trainer: Trainer) -> None:
    args = trainer.args
    kind = trainer.accelerator.distributed_type
    if kind == DistributedType.DEEPSPEED:
        raise NotImplementedError(
            "elastic batch does not support DeepSpeed: use FSDP2, DDP or a single device"
        )
    if str(getattr(args.optim, "value", args.optim)).lower() in ("lomo", "adalomo"):
        raise NotImplementedError("elastic batch does not support LOMO optimizers")
    if args.gradient_accumulation_steps > 1:
        warnings.warn(
            f"gradient_accumulation_steps={args.gradient_accumulation_steps}: an OOM in any "
            "micro-batch but the first of an optimizer step cannot be re-run and raises. "
            "Set per_device_train_batch_size to the whole batch "
            f"({args.per_device_train_batch_size * args.gradient_accumulation_steps}) and "
            "gradient_accumulation_steps=1 instead: elastic batch accumulates itself.",
            stacklevel=3,
        )
