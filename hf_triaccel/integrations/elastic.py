"""transformers glue for memory-elastic batch scaling.

:class:`TrainerElasticBatch` runs each ``Trainer.training_step`` through an
:class:`~hf_triaccel.memory.elastic.ElasticBatchController`: the per-device batch is
the effective batch ``E``, split into micro-batches that follow live device memory.
It replaces ``auto_find_batch_size``, which restarts the whole inner loop on OOM with a
smaller batch, keeps the old optimizer, and changes the effective batch.

It is also the Trainer callback that saves the controller's state with each checkpoint
(``elastic_batch.json``) and the telemetry provider of ``micro_batch`` and
``accumulation``. :class:`FisherStatisticsRollback` keeps AdaFisher's statistics exact
when a step is re-run; hand-written loops pass it to
:meth:`~hf_triaccel.memory.elastic.ElasticBatchController.run_step` themselves.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import warnings
from typing import Any

import torch
from accelerate.utils import DistributedType
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from hf_triaccel.curvature.collector import FisherCollector
from hf_triaccel.memory.checkpointing import CheckpointedBlocks, checkpoint_largest_blocks
from hf_triaccel.memory.elastic import ElasticBatchController, ElasticBatchError
from hf_triaccel.memory.probe import MemoryProbe, default_probe

logger = logging.getLogger(__name__)

STATE_NAME = "elastic_batch.json"


class FisherStatisticsRollback:
    """Forgets the Fisher statistics a failed attempt gathered before its step is re-run.

    A failed attempt may already have counted the statistics of some pieces; without
    this, the re-run would count them again. The collector gathers an optimizer step's
    statistics from its first micro-batch and forgets them at each fold, so a step that
    starts with nothing gathered is restored by forgetting everything gathered since
    (``LayerFactors.reset``). Costs one pass over the layers' counters per step.

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
        for ly in self.collector.layers.values():
            ly.reset()


class TrainerElasticBatch(TrainerCallback):
    """Elastic micro-batching for a ``transformers.Trainer``.

    The effective batch per device is ``per_device_train_batch_size``; set
    ``gradient_accumulation_steps=1`` and let the controller accumulate: with Trainer
    accumulation, an OOM in any but the first micro-batch of an optimizer step cannot
    be re-run exactly and raises. Single device and DDP; DeepSpeed and FSDP are
    refused.

    Args:
        trainer: the Trainer (its ``args``, ``accelerator``, ``compute_loss``, model).
        controller: the controller (default: built from ``trainer.args`` and
            ``controller_kwargs``).
        checkpoint_blocks: how many of the largest blocks the activation-checkpointing
            fallback wraps (default: all).
        **controller_kwargs: :class:`ElasticBatchController` arguments
            (``min_micro_batch``, ``target_fraction``, ``check_every``, ...).

    Example:
        How ``TriAccelTrainer`` uses it::

            class TriAccelTrainer(Trainer):
                def __init__(self, ...):
                    ...
                    self.telemetry = EfficiencyTelemetry()
                    self.add_callback(self.telemetry)
                    self.elastic = TrainerElasticBatch.attach(self, min_micro_batch=8)

                def training_step(self, model, inputs, num_items_in_batch=None):
                    if self.elastic is None:
                        return super().training_step(model, inputs, num_items_in_batch)
                    return self.elastic.training_step(model, inputs, num_items_in_batch)

                def train(self, resume_from_checkpoint=None, **kwargs):
                    if self.elastic is not None:
                        self.elastic.resume(resume_from_checkpoint)
                    return super().train(resume_from_checkpoint, **kwargs)
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
        self._fisher: FisherStatisticsRollback | None = None

    @classmethod
    def attach(cls, trainer: Trainer, **kwargs: Any) -> TrainerElasticBatch:
        """Builds the helper, registers it as a callback (checkpoint state) and, when the
        trainer has ``telemetry``, as its provider of ``micro_batch`` / ``accumulation``."""
        helper = cls(trainer, **kwargs)
        trainer.add_callback(helper)
        telemetry = getattr(trainer, "telemetry", None)
        if telemetry is not None:
            telemetry.add_provider(helper.metrics)
        return helper

    @property
    def probe(self) -> MemoryProbe:
        """The controller's memory probe."""
        return self.controller.probe

    def enable_activation_checkpointing(self) -> None:
        """The controller's last resort: checkpoints the largest blocks of the model
        (nothing more when transformers' own gradient checkpointing is already on)."""
        model = self.trainer.accelerator.unwrap_model(self.trainer.model)
        # transformers 5 name first: the 4.x one may be a deprecated alias there
        already = getattr(model, "is_activation_checkpointing", None)
        if already is None:
            already = getattr(model, "is_gradient_checkpointing", False)
        if already:
            logger.warning("elastic batch: gradient checkpointing is already on")
            return
        self.checkpointed = checkpoint_largest_blocks(model, self.checkpoint_blocks)
        logger.warning(
            "elastic batch: activation checkpointing of %d blocks switched on",
            len(self.checkpointed),
        )

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
        prepare_cp = getattr(trainer, "_prepare_context_parallel_inputs", None)
        cp_context, inputs = (
            prepare_cp(model, inputs) if prepare_cp else (contextlib.nullcontext, inputs)
        )
        with cp_context():
            model.train()
            if callable(getattr(trainer.optimizer, "train", None)):
                trainer.optimizer.train()
            inputs = trainer._prepare_inputs(inputs)
            normalized = _loss_is_normalized(trainer, num_items_in_batch)
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

    def resume(self, resume_from_checkpoint: str | bool | None) -> bool:
        """Loads the controller's state for ``Trainer.train(resume_from_checkpoint=...)``
        (``True``: the last checkpoint in ``output_dir``). Returns whether a state was
        found; a checkpoint without one (saved without elastic batching) starts fresh."""
        if not resume_from_checkpoint:
            return False
        path = resume_from_checkpoint
        if path is True:
            path = get_last_checkpoint(self.trainer.args.output_dir)
            if path is None:
                return False
        file = os.path.join(str(path), STATE_NAME)
        if not os.path.isfile(file):
            return False
        with open(file) as f:
            self.controller.load_state_dict(json.load(f))
        return True

    def on_train_begin(self, args, state, control, **kwargs):
        reset = getattr(self.probe, "reset_overall_peak", None)
        if callable(reset):
            reset()

    def on_save(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        if os.path.isdir(folder):
            with open(os.path.join(folder, STATE_NAME), "w") as f:
                json.dump(self.controller.state_dict(), f, indent=2)


def _loss_is_normalized(trainer: Trainer, num_items_in_batch: Any) -> bool:
    """Whether ``compute_loss`` divides by the whole batch's item count (the Trainer's
    own test), so that pieces' losses add up without weights."""
    flag = getattr(trainer, "loss_is_scaled_for_ga", None)
    if flag is not None:
        return bool(flag)
    return (
        trainer.model_accepts_loss_kwargs and num_items_in_batch is not None
    ) or trainer.compute_loss_func is not None


def _check_trainer(trainer: Trainer) -> None:
    args = trainer.args
    kind = trainer.accelerator.distributed_type
    if kind in (DistributedType.DEEPSPEED, DistributedType.FSDP):
        raise NotImplementedError(
            f"elastic batch does not support {kind.value} yet: use DDP or a single device"
        )
    if args.auto_find_batch_size:
        raise ValueError(
            "auto_find_batch_size and elastic batch both handle out-of-memory errors: "
            "turn auto_find_batch_size off (elastic batch keeps the effective batch fixed)"
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
