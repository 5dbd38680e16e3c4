"""Every use of transformers' private ``Trainer`` API by hf_triaccel, in one place.

Tested with transformers 5.17 and 5.24 (``pyproject.toml`` states the range). Each
function names the private member it uses; when a transformers release changes one,
this is the file to update. (``TriAccelMixin.save_model`` also takes the Trainer's
``_internal_call`` argument, which tells checkpoints from user saves.)
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from typing import Any
from weakref import WeakKeyDictionary

import torch
from accelerate.utils import DistributedType
from transformers import Trainer, TrainingArguments
from transformers.utils import is_sagemaker_mp_enabled

from hf_triaccel.integrations.trainer_loss import (
    feeds_positionally,
    forward_parameters,
    takes_positionally,
)


def prepare_inputs(trainer: Trainer, inputs: dict[str, Any]) -> dict[str, Any]:
    """``Trainer._prepare_inputs``: the batch moved to the device."""
    return trainer._prepare_inputs(inputs)


def train_batch_size(trainer: Trainer) -> int:
    """``Trainer._train_batch_size``: the per-device training batch, after
    ``auto_find_batch_size`` reduced it."""
    return trainer._train_batch_size


def context_parallel_inputs(
    trainer: Trainer, model: torch.nn.Module, inputs: dict[str, Any]
) -> tuple[Callable[[], Any], dict[str, Any]]:
    """``Trainer._prepare_context_parallel_inputs``: the context-parallel context and the
    batch (a no-op context without context parallelism)."""
    return trainer._prepare_context_parallel_inputs(model, inputs)


def loss_is_scaled_for_ga(trainer: Trainer, num_items_in_batch: Any) -> bool:
    """Whether ``compute_loss`` already divides by the whole accumulated batch's item
    count, as ``Trainer.training_step`` decides it (``loss_is_scaled_for_ga`` from
    transformers 5.24, the same rule inline before)."""
    flag = getattr(trainer, "loss_is_scaled_for_ga", None)
    if flag is not None:
        return bool(flag)
    return (
        trainer.model_accepts_loss_kwargs and num_items_in_batch is not None
    ) or trainer.compute_loss_func is not None


@contextlib.contextmanager
def init_arguments(model: torch.nn.Module | None, args: TrainingArguments):
    """The arguments to give ``Trainer.__init__``: ``args`` itself, or a copy without
    label smoothing for a model without a ``config`` attribute (``Trainer.__init__``
    reads ``model.config`` when ``label_smoothing_factor`` is set, which fails on timm
    models); the caller's object is never changed."""
    if model is None or hasattr(model, "config") or not args.label_smoothing_factor:
        yield args
        return
    init_args = copy.copy(args)
    init_args.label_smoothing_factor = 0.0
    yield init_args


class ColumnsForPositionalModels:
    """Trainer mixin: a model fed positionally (see
    :func:`~hf_triaccel.integrations.trainer_loss.feeds_positionally`) keeps every
    dataset column, where the Trainer would drop the columns its ``forward`` does not
    name (all of them, for timm's ``forward(x)``). Overrides
    ``Trainer._remove_unused_columns`` and ``Trainer._get_collator_with_removed_columns``;
    other models keep the Trainer's behaviour."""

    def _positional(self, keys) -> bool:
        model = self.accelerator.unwrap_model(self.model)
        return model is not None and feeds_positionally(model, keys, self.label_names)

    def _remove_unused_columns(self, dataset, description=None):
        if self._positional(dataset.column_names):
            return dataset
        return super()._remove_unused_columns(dataset, description)

    def _get_collator_with_removed_columns(self, data_collator, description=None):
        removing = super()._get_collator_with_removed_columns(data_collator, description)
        model = self.accelerator.unwrap_model(self.model)
        if removing is data_collator or model is None:
            return data_collator
        return _CollatorByModel(data_collator, removing, model, self.label_names)


class _CollatorByModel:
    """Collates with the column-removing collator, or, for a batch the model takes
    positionally, with the plain one (a class, not a closure: DataLoader workers pickle
    it)."""

    def __init__(self, plain, removing, model: torch.nn.Module, label_names) -> None:
        self.plain, self.removing = plain, removing
        self.signature = forward_parameters(model)
        self.label_names = list(label_names)

    def __call__(self, features):
        keys = features[0].keys() if features and hasattr(features[0], "keys") else ()
        positional = takes_positionally(self.signature, keys, self.label_names)
        return self.plain(features) if positional else self.removing(features)


def defers_to_trainer(trainer: Trainer, mixin: type, name: str) -> bool:
    """Whether the method ``name`` that ``mixin`` would defer to (the next class in
    ``trainer``'s method order) is ``transformers.Trainer``'s own, not a subclass's
    between them (a TRL trainer's)."""
    following = getattr(super(mixin, trainer), name, None)
    return getattr(following, "__func__", None) is getattr(Trainer, name)


# distributed types whose gradients Accelerate clips with its own code
_SHARDED_CLIPPING = frozenset(
    (DistributedType.FSDP, DistributedType.DEEPSPEED, DistributedType.XLA)
)


def _is_dtensor(tensor: torch.Tensor) -> bool:
    if not torch.distributed.is_available():  # builds without torch.distributed
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


class KeptParameterClipping:
    """Trainer mixin: ``Trainer._clip_grad_norm`` over the model's parameters listed once
    per model and ``train()``, where the Trainer walks ``model.parameters()`` (every
    module) at every step; the clipping itself is Accelerate's ``clip_grad_norm_``, as
    in the Trainer. Sharded gradients (FSDP, DeepSpeed, XLA, DTensor parameters),
    SageMaker model parallelism and a class between this mixin and ``Trainer`` that
    overrides ``_clip_grad_norm`` keep the Trainer's method."""

    _kept_parameters: WeakKeyDictionary | None = None

    def reset_kept_parameters(self) -> None:
        """Forgets the parameter lists of earlier ``train()`` calls (called at the start
        of each)."""
        self._kept_parameters = WeakKeyDictionary()

    def _clip_grad_norm(self, model: torch.nn.Module):
        kept = self._kept_parameters
        if kept is None:  # before any train()
            return super()._clip_grad_norm(model)
        if model not in kept:
            kept[model] = self._clipped_parameters(model)
        parameters = kept[model]
        if parameters is None:
            return super()._clip_grad_norm(model)
        return self.accelerator.clip_grad_norm_(parameters, self.args.max_grad_norm)

    def _clipped_parameters(self, model: torch.nn.Module) -> list[torch.nn.Parameter] | None:
        parameters = list(model.parameters())
        if (
            not defers_to_trainer(self, KeptParameterClipping, "_clip_grad_norm")
            or is_sagemaker_mp_enabled()
            or self.accelerator.distributed_type in _SHARDED_CLIPPING
            or any(map(_is_dtensor, parameters))
        ):
            return None
        return parameters
