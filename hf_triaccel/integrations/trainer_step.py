"""The Trainer's training step without the walks over the model that repeat an answer.

A CIFAR-size training step is bound by the host (the device waits for launches), so
every microsecond of Python the Trainer adds to a step is wall time. Three pieces of a
Trainer step visit the whole model at every step to reach a result that only changes
when something outside the step changes it; :class:`LeanStepMixin` keeps their results
and skips the visits:

* ``model.train()`` (in ``training_step``) sets ``training`` on every module. Here it
  runs when some module is not in training mode (the Trainer's evaluation switches the
  model to eval mode, a callback may switch one module); when every module is in
  training mode it would change nothing. Modules whose class overrides ``train`` with
  more than that get the call at every step, as in the Trainer.
* ``floating_point_ops`` counts a transformers model's parameters (a walk over all of
  them) once per model and ``train()``, not at every step.
* the gradient clipping lists the model's parameters once per model and ``train()``
  (:class:`~hf_triaccel.integrations.trainer_compat.KeptParameterClipping`).

Without gradient accumulation the loss is not divided by one (a kernel launch whose
result is the loss itself). The rest of the step is the Trainer's. A run the Trainer
steps otherwise (SageMaker model parallelism, a LOMO optimizer, DeepSpeed,
``torch_empty_cache_steps``) and a class between this mixin and ``transformers.Trainer``
that overrides a method (TRL's trainers) keep the Trainer's own method; these facts are
read once per ``train()``.
"""

from __future__ import annotations

from typing import Any
from weakref import WeakKeyDictionary

import torch
from accelerate.utils import DistributedType
from torch import nn
from transformers import PreTrainedModel
from transformers.training_args import OptimizerNames
from transformers.utils import is_sagemaker_mp_enabled

from hf_triaccel.integrations import trainer_compat

__all__ = ["LeanStepMixin", "train_mode_modules"]

# ``train`` methods that do nothing but set ``training`` when the mode does not change
_MODE_ONLY_TRAIN = frozenset(
    (
        nn.Module.train,
        torch.nn.parallel.DistributedDataParallel.train,
        PreTrainedModel.train,
    )
)


def train_mode_modules(model: nn.Module) -> list[nn.Module] | None:
    """The modules below ``model`` whose ``training`` flags ``model.train()`` sets (the
    model itself left out, so that a cache keyed by the model weakly does not keep it),
    or ``None`` when one of them overrides ``train`` with more than that (then the call
    must be made).

    Example:
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.Dropout())
        >>> len(train_mode_modules(model))
        2
        >>> class Frozen(nn.Linear):
        ...     def train(self, mode=True):
        ...         return super().train(False)
        >>> train_mode_modules(nn.Sequential(Frozen(2, 2))) is None
        True
    """
    modules = list(model.modules())
    if any(type(m).train not in _MODE_ONLY_TRAIN for m in modules):
        return None
    return modules[1:]  # modules() yields the model first


class LeanStepMixin(trainer_compat.KeptParameterClipping):
    """Trainer mixin: ``training_step``, ``floating_point_ops`` and the gradient clipping
    with the Trainer's results, without their walks over the model at every step (see
    the module's docstring). Before :meth:`resolve_lean_step` (a step called by hand)
    they are the Trainer's."""

    _lean_step = False  # resolved by each train()
    _lean_flops = False

    def resolve_lean_step(self) -> None:
        """Reads, for the ``train()`` about to run, which of the Trainer's methods this
        mixin may shorten, and forgets what earlier runs kept (``TriAccelMixin.train``
        calls it)."""
        self.reset_kept_parameters()
        trainer_args = self.args
        self._lean_step = (
            trainer_compat.defers_to_trainer(self, LeanStepMixin, "training_step")
            and not is_sagemaker_mp_enabled()
            and trainer_args.optim not in (OptimizerNames.LOMO, OptimizerNames.ADALOMO)
            and self.accelerator.distributed_type != DistributedType.DEEPSPEED
            and trainer_args.torch_empty_cache_steps is None
        )
        self._lean_flops = trainer_compat.defers_to_trainer(
            self, LeanStepMixin, "floating_point_ops"
        )
        self._several_gpus = trainer_args.n_gpu > 1
        self._train_modes: WeakKeyDictionary = WeakKeyDictionary()
        self._parameter_counts: WeakKeyDictionary = WeakKeyDictionary()

    def _set_train_mode(self, model: nn.Module) -> None:
        if model not in self._train_modes:
            self._train_modes[model] = train_mode_modules(model)
        modules = self._train_modes[model]
        if modules is None or not (model.training and all(m.training for m in modules)):
            model.train()

    def training_step(self, model, inputs, num_items_in_batch=None):
        """``Trainer.training_step``, with ``model.train()`` only when it changes a mode."""
        if not self._lean_step:
            return super().training_step(model, inputs, num_items_in_batch)
        cp_context, inputs = trainer_compat.context_parallel_inputs(self, model, inputs)
        with cp_context():
            self._set_train_mode(model)
            if callable(getattr(self.optimizer, "train", None)):
                self.optimizer.train()
            inputs = trainer_compat.prepare_inputs(self, inputs)
            with self.compute_loss_context_manager():
                loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
            del inputs
            if self._several_gpus:
                loss = loss.mean()  # DataParallel: one loss per device
            steps = self.current_gradient_accumulation_steps
            # x / 1 == x exactly: one kernel launch less when nothing accumulates
            if steps != 1 and not trainer_compat.loss_is_scaled_for_ga(self, num_items_in_batch):
                loss = loss / steps
            self.accelerator.backward(loss)
            return loss.detach()

    def floating_point_ops(self, inputs: dict[str, Any]) -> int:
        """``Trainer.floating_point_ops``, with the model's parameters counted once."""
        model = self.model
        if not self._lean_flops or model is None:
            return super().floating_point_ops(inputs)
        if model not in self._parameter_counts:
            counts = hasattr(model, "num_parameters")
            self._parameter_counts[model] = (
                model.num_parameters(exclude_embeddings=True) if counts else None
            )
        count = self._parameter_counts[model]
        main_input = getattr(model, "main_input_name", "input_ids")
        if count is None or main_input not in inputs:
            return 0
        return 6 * inputs[main_input].numel() * count
