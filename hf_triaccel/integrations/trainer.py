"""transformers integration: ``TriAccelMixin`` for any Trainer, ``TriAccelTrainer``.

The mixin works through the Trainer's own extension points where one serves, and lists
each method it still overrides, with the extension point tried, in docs/design.md
("The Trainer"):

* the optimizer: for ``optim="adafisher(w)"`` the mixin hands the Trainer a
  :class:`~hf_triaccel.integrations.callback.TriAccelCallback` and its
  ``optimizer_cls_and_kwargs`` (a user's own ``optimizers`` or
  ``optimizer_cls_and_kwargs`` stay theirs); the callback builds the optimizer with its
  collector and controllers, unscales fp16 statistics and writes the precision report,
  as it does for the stock Trainer;
* the loss: ``compute_loss`` is the Trainer's for every model whose ``forward`` takes the
  whole batch by name; the others (timm's ``forward(x)``) get the fallback of
  :mod:`~hf_triaccel.integrations.trainer_loss`;
* ``train``: once per call, the step caches are reset and the optimizer of an earlier
  ``train()`` is rebuilt with its state; its cleanup takes the hooks off the model when
  training raises too (``on_train_end`` does not run then);
* the step: ``training_step`` and the clipping without walks over the model that repeat
  an answer (:mod:`.trainer_step`), or the elastic batch's (``training_step``,
  ``prediction_step``); telemetry (a callback); the device image loader;
* the layout: with AdaFisher, conv models and their image batches in channels_last
  (:mod:`.layout`), ``save_model`` (checkpoints, Hub pushes) writing contiguous weights;
* ``torch_compile``: refresh steps run the eager module (:mod:`.compiled`), the
  compilation time logged as ``compile_seconds``.

The caller's arguments are never changed: resolved values (the learning rate, ...) live
in :attr:`TriAccelMixin.triaccel_settings` and are logged once per ``train()``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from transformers import Trainer, TrainingArguments
from transformers.trainer_pt_utils import LabelSmoother

from hf_triaccel.integrations import trainer_compat
from hf_triaccel.integrations.callback import TriAccelCallback, inner_optimizer
from hf_triaccel.integrations.checkpoints import resume_path
from hf_triaccel.integrations.compiled import (
    CompileClock,
    check_cuda_graphs,
    eager_module,
    step_module,
)
from hf_triaccel.integrations.elastic import ElasticEvaluation, TrainerElasticBatch
from hf_triaccel.integrations.layout import (
    channels_last_batch,
    contiguous_weights,
    to_channels_last,
)
from hf_triaccel.integrations.plugin import check_distributed_support
from hf_triaccel.integrations.precision_report import write_precision_report
from hf_triaccel.integrations.preemption import add_preemption
from hf_triaccel.integrations.telemetry import EfficiencyTelemetry
from hf_triaccel.integrations.trainer_args import (
    TriAccelArguments,
    optim_name,
    plugin_from_args,
    resolve_learning_rate,
    setting,
    uses_adafisher,
)
from hf_triaccel.integrations.trainer_data import DeviceImagesMixin
from hf_triaccel.integrations.trainer_loss import LossRoutes, fallback_loss, forward_parameters
from hf_triaccel.integrations.trainer_step import LeanStepMixin

__all__ = ["TriAccelArguments", "TriAccelMixin", "TriAccelTrainer"]

logger = logging.getLogger(__name__)


class TriAccelMixin(trainer_compat.ColumnsForPositionalModels, LeanStepMixin, DeviceImagesMixin):
    """hf_triaccel for any ``transformers.Trainer`` subclass (TRL's included): put it
    first, ``class MyTrainer(TriAccelMixin, SFTTrainer)``.

    Settings come from the arguments' :class:`TriAccelArguments` fields; arguments of
    another class (a TRL config) use their defaults, and a config class that takes both
    (``@dataclass class Config(TriAccelArguments, SFTConfig)``) gives access to all. For
    AdaFisher alone (hooks, controllers, precision report) the stock Trainer needs no
    mixin: see :class:`~hf_triaccel.integrations.callback.TriAccelCallback`; the mixin
    adds the elastic batch, the telemetry, channels_last, timm's ``forward(x)`` and the
    device image loader.
    """

    def __init__(self, model=None, args: TrainingArguments | None = None, *pargs, **kwargs):
        with trainer_compat.init_arguments(model, args) as init_args:
            super().__init__(model, init_args, *pargs, **kwargs)
        if init_args is not args:
            self.args = args  # the caller's object; the loss applies its label smoothing
            self.label_smoother = LabelSmoother(epsilon=args.label_smoothing_factor)
        self._convert_layout(self.model)
        if self.model is not None and not self.label_names and not self._var_keyword():
            self.label_names = ["labels"]  # a forward without **kwargs names no labels
        self.telemetry = EfficiencyTelemetry()
        # first, so that its metrics reach every reporting callback's on_log
        self.callback_handler.callbacks.insert(0, self.telemetry)
        self.triaccel: TriAccelCallback | None = None
        if uses_adafisher(self.args):
            self._hand_over_optimizer()
        self.elastic: TrainerElasticBatch | None = None
        self.eval_pieces: ElasticEvaluation | None = None
        self._loss_routes = LossRoutes(
            lambda m: self.accelerator.unwrap_model(m, keep_torch_compile=False)
        )
        if uses_adafisher(self.args):
            check_distributed_support(self.accelerator.distributed_type)
        check_cuda_graphs(self.args)
        self.compile_clock: CompileClock | None = None
        if self.args.torch_compile:
            self.compile_clock = CompileClock(self.args.device)
            self.telemetry.add_provider(self.compile_clock.metrics, "compile")
        if setting(self.args, "elastic_batch") or self.args.auto_find_batch_size:
            self.enable_elastic_batch(
                min_micro_batch=setting(self.args, "elastic_min_micro_batch"),
                target_fraction=setting(self.args, "elastic_target_fraction"),
            )
        self.preemption = add_preemption(self, setting(self.args, "preemption_signals"))

    def _hand_over_optimizer(self) -> None:
        """Gives the Trainer the :class:`TriAccelCallback` of the arguments and its
        optimizer factory (``optimizer_cls_and_kwargs``, as if passed to the constructor,
        which a subclass's constructor may not take), unless the caller gave an optimizer
        of their own."""
        plugin = plugin_from_args(self.args)
        if self.optimizer is not None or self.optimizer_cls_and_kwargs is not None:
            if plugin.precision or plugin.lr_steering:
                raise ValueError(
                    "triaccel_precision and triaccel_lr_steering need the optimizer "
                    "hf_triaccel builds for optim adafisher(w); an optimizer was given "
                    "(optimizers / optimizer_cls_and_kwargs)"
                )
            logger.warning("an optimizer was given: it is used, not optim=%r", self.args.optim)
            return
        report_dir = setting(self.args, "triaccel_report_dir")
        self.triaccel = TriAccelCallback(plugin, report_dir=report_dir, telemetry=self.telemetry)
        self.triaccel.fp16 = bool(self.args.fp16)  # on_init_end has run already
        self.optimizer_cls_and_kwargs = self.triaccel.optimizer_cls_and_kwargs
        self.add_callback(self.triaccel)

    def _var_keyword(self) -> bool:
        return forward_parameters(self.model)[1]

    # -- layout ---------------------------------------------------------------------

    def _convert_layout(self, model: torch.nn.Module | None) -> None:
        """Puts a model with 2-D convolutions in channels_last (``triaccel_channels_last``;
        left unset, with AdaFisher only: stock runs keep the stock layout) and records
        whether batches follow. Sharded models (FSDP, DeepSpeed) keep their layout: their
        wrappers flatten the parameters."""
        sharded = getattr(self, "is_fsdp_enabled", False) or getattr(
            self, "is_deepspeed_enabled", False
        )
        wanted = setting(self.args, "triaccel_channels_last")
        if wanted is None:
            wanted = uses_adafisher(self.args)
        wanted = wanted and not sharded
        self.channels_last = bool(wanted and model is not None and to_channels_last(model))

    def call_model_init(self, trial=None):
        """The Trainer's ``call_model_init``, the new model put in the training layout."""
        model = super().call_model_init(trial)
        self._convert_layout(model)
        return model

    # -- settings -------------------------------------------------------------------

    @property
    def triaccel_settings(self) -> dict[str, Any]:
        """What this trainer resolved from its arguments (the arguments stay as given)."""
        args = self.args
        return {
            "optim": optim_name(args),
            "learning_rate": resolve_learning_rate(args),
            "learning_rate_set": args.learning_rate is not None,
            "elastic_batch": self.elastic is not None,
            "label_smoothing": args.label_smoothing_factor,
        }

    @property
    def label_smoothing(self) -> float:
        """The label smoothing of the loss (``label_smoothing_factor``)."""
        return self.args.label_smoothing_factor

    def _log_settings(self) -> None:
        s = self.triaccel_settings
        source = "set" if s["learning_rate_set"] else "the optimizer's default"
        on = "on" if s["elastic_batch"] else "off"
        message = "hf_triaccel: optim=%s, learning_rate=%g (%s), elastic batch %s"
        logger.info(message, s["optim"], s["learning_rate"], source, on)

    @property
    def collector(self):
        """The Fisher collector of the optimizer (``None`` before it is created)."""
        return getattr(inner_optimizer(self.optimizer), "collector", None)

    def _part(self, name: str) -> Any:
        parts = None if self.triaccel is None else self.triaccel.parts
        return None if parts is None else getattr(parts, name)

    @property
    def precision(self):
        """The precision controller (``triaccel_precision``; ``None`` without)."""
        return self._part("precision")

    @property
    def signals(self):
        """The signal tracker of the controllers (``None`` without one)."""
        return self._part("signals")

    @property
    def steering(self):
        """The step-size steering (``triaccel_lr_steering``; ``None`` without)."""
        return self._part("steering")

    # -- training -------------------------------------------------------------------

    def train(self, resume_from_checkpoint: str | bool | None = None, *args, **kwargs):
        resume_from_checkpoint = resume_path(resume_from_checkpoint, self.args.output_dir)
        built = None if self.triaccel is None else self.triaccel.optimizer
        rebuild = built is not None and inner_optimizer(self.optimizer) is built
        if rebuild and not built.collector.attached and self.model_init is None:
            # detached when the last train() returned: rebuild the optimizer (a collector
            # attached again, new controllers) on the same model, carrying its state over
            self.triaccel.carry_state(built.state_dict())
            self.optimizer = None
        if self.elastic is not None:
            self.elastic.resume(resume_from_checkpoint)
        self._log_settings()
        self.resolve_lean_step()
        try:
            return super().train(resume_from_checkpoint, *args, **kwargs)
        finally:
            # on_train_end does not run when training raises: the hooks come off here
            if self.triaccel is not None:
                self.triaccel.detach()

    def compute_loss(
        self,
        model,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch=None,
    ):
        # the signature of the model's own forward, not of a compile wrapper's
        stock, signature = self._loss_routes.lookup(model, inputs)
        if stock:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        loss, outputs = fallback_loss(
            model,
            inputs,
            self.label_names,
            signature=signature,
            label_smoothing=self.args.label_smoothing_factor,
            compute_loss_func=self.compute_loss_func,
            num_items_in_batch=num_items_in_batch,
        )
        if (
            self.compute_loss_func is not None
            and self.args.average_tokens_across_devices
            and num_items_in_batch is not None
        ):
            # as the Trainer's compute_loss: normalised by the global item count, while
            # DDP averages gradients over processes
            loss = loss * self.accelerator.num_processes
        return (loss, outputs) if return_outputs else loss

    def enable_elastic_batch(self, **kwargs: Any) -> TrainerElasticBatch:
        """Turns on the memory-elastic micro-batch (what ``elastic_batch=True`` does) and
        the splitting of evaluation batches that run out of memory; ``kwargs`` go to
        :class:`TrainerElasticBatch` (e.g. a custom memory ``probe``)."""
        self.elastic = TrainerElasticBatch.attach(self, **kwargs)
        self.eval_pieces = ElasticEvaluation(release=self.elastic.probe.release)
        return self.elastic

    def training_step(self, model, inputs, num_items_in_batch=None):
        """The Trainer's step (or the elastic batch's), on a channels-last batch when the
        model is channels-last; under ``torch_compile``, a refresh step calls the eager
        module (see :mod:`~hf_triaccel.integrations.compiled`)."""
        if self.channels_last:
            inputs = channels_last_batch(inputs)
        chosen = step_module(model, self.collector)
        if self.compile_clock is None or eager_module(chosen) is None:
            return self._training_step(chosen, inputs, num_items_in_batch)
        return self.compile_clock.time(
            lambda: self._training_step(chosen, inputs, num_items_in_batch)
        )

    def _training_step(self, model, inputs, num_items_in_batch):
        if self.elastic is None:
            return super().training_step(model, inputs, num_items_in_batch)
        return self.elastic.training_step(model, inputs, num_items_in_batch)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        if self.channels_last:
            inputs = channels_last_batch(inputs)
        if self.eval_pieces is None:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        step = super().prediction_step
        return self.eval_pieces.run(
            lambda piece: step(model, piece, prediction_loss_only, ignore_keys), inputs
        )

    # -- outputs --------------------------------------------------------------------

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The Trainer's ``save_model``; called by the user after training, it also writes
        the efficiency report (and the precision report) beside the model. Checkpoints
        (``_internal_call``) hold what transformers writes. Weights are written
        contiguous (safetensors refuses channels-last convolution weights); the model
        keeps its layout."""
        with contiguous_weights(self.model):
            super().save_model(output_dir, _internal_call)
        if _internal_call or not self.is_world_process_zero() or self.state.global_step == 0:
            return
        folder = output_dir or self.args.output_dir
        self.telemetry.write_report(folder)
        parts = None if self.triaccel is None else self.triaccel.parts
        if parts is not None and parts.precision is not None:
            step = self.state.global_step
            write_precision_report(folder, parts.precision, parts.signals, step)


class TriAccelTrainer(TriAccelMixin, Trainer):
    """A ``transformers.Trainer`` that trains with AdaFisher and reports its efficiency.

    Every model the stock Trainer trains trains here with the same loss (outputs as a
    dict, tuple or ``ModelOutput`` carrying a loss, any number of inputs,
    ``compute_loss_func``, ``label_names``, wrappers); plain timm-style models
    (``forward(x) -> logits``) get the batch's inputs without the labels and, when they
    return no loss, cross-entropy with ``label_smoothing_factor``.

    ``train_dataset`` / ``eval_dataset`` may be an
    :class:`~hf_triaccel.data.images.ImageTensors` (decoded images, see
    :func:`~hf_triaccel.data.images.load_image_dataset`): batches are then gathered and
    augmented on the device instead of collated by DataLoader workers.

    Example:
        >>> import tempfile
        >>> from transformers import GPT2Config, GPT2LMHeadModel
        >>> class Tokens(torch.utils.data.Dataset):
        ...     def __len__(self):
        ...         return 8
        ...     def __getitem__(self, i):
        ...         ids = torch.arange(i, i + 6) % 32
        ...         return {"input_ids": ids, "labels": ids}
        >>> model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32))
        >>> args = TriAccelArguments(
        ...     output_dir=tempfile.mkdtemp(), max_steps=2, per_device_train_batch_size=4,
        ...     report_to=[], use_cpu=True, disable_tqdm=True,
        ... )
        >>> trainer = TriAccelTrainer(model=model, args=args, train_dataset=Tokens())
        >>> output = trainer.train()  # doctest: +ELLIPSIS
        {'train_runtime': ...}
        >>> output.global_step
        2
        >>> trainer.triaccel_settings["learning_rate"], trainer.collector.attached
        (0.012, False)
    """

    def __init__(self, model=None, args: TrainingArguments | None = None, *a, **kw) -> None:
        if args is None:
            args = TriAccelArguments(output_dir="trainer_output")
        super().__init__(model, args, *a, **kw)
