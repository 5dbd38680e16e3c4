"""transformers integration: ``TriAccelArguments`` and ``TriAccelTrainer``.

``TrainingArguments(optim=...)`` rejects names it does not know, so the arguments
subclass accepts ``adafisher`` / ``adafisherw`` (any name transformers knows still
works) and the Trainer subclass overrides ``create_optimizer``; the Trainer's own
weight-decay parameter groups are kept.
"""

from __future__ import annotations

import json
import logging
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel, Trainer, TrainerCallback, TrainingArguments

from hf_triaccel._types import EMA_MODES
from hf_triaccel.curvature.signals import SignalTracker
from hf_triaccel.data.images import ImageTensors
from hf_triaccel.dispatch import IMPLS
from hf_triaccel.integrations.elastic import TrainerElasticBatch
from hf_triaccel.integrations.plugin import OPTIMIZERS, TriAccelPlugin, check_distributed_support
from hf_triaccel.integrations.telemetry import EfficiencyTelemetry
from hf_triaccel.integrations.trainer_data import DeviceImageDataLoader
from hf_triaccel.optim.steering import StepSizeSteering
from hf_triaccel.precision import PrecisionController, PrecisionPolicy, plot_precision_map

logger = logging.getLogger(__name__)

PRECISION_MAP_NAME = "precision_map.png"
SIGNALS_NAME = "signals.json"


@dataclass
class TriAccelArguments(TrainingArguments):
    """``TrainingArguments`` with hf_triaccel's settings (each a CLI flag through
    ``HfArgumentParser``).

    ``optim`` also accepts ``"adafisher"`` and ``"adafisherw"`` (the default);
    ``learning_rate`` and ``weight_decay`` are the Trainer's own.

    Example:
        >>> args = TriAccelArguments(output_dir="out", optim="adafisherw", learning_rate=1e-3)
        >>> args.to_plugin().optimizer
        'adafisherw'
    """

    optim: str = field(
        default="adafisherw",
        metadata={
            "help": "Optimizer: adafisher, adafisherw (Fisher-preconditioned, hf_triaccel) "
            "or any name transformers' `optim` accepts (e.g. adamw_torch_fused)."
        },
    )
    logging_nan_inf_filter: bool = field(
        default=False,
        metadata={
            "help": "Leave nan/inf losses out of the logged loss. Off by default here (on in "
            "transformers): the check reads the loss back at every step, a GPU sync that "
            "costs throughput on small models."
        },
    )
    adafisher_beta: float = field(default=0.9, metadata={"help": "AdaFisher momentum."})
    adafisher_damping: float = field(
        default=1e-3, metadata={"help": "AdaFisher: lambda added to every Fisher entry."}
    )
    adafisher_gamma: float = field(
        default=0.8, metadata={"help": "AdaFisher: EMA coefficient of the Fisher factors."}
    )
    adafisher_update_every: int | None = field(
        default=None,
        metadata={
            "help": "AdaFisher: refresh the Fisher factors every N optimizer steps "
            "(default 100 for ema=reference, 1 for ema=paper)."
        },
    )
    adafisher_ema: str = field(
        default="reference",
        metadata={"help": "AdaFisher EMA rule: reference (published results) or paper."},
    )
    triaccel_impl: str | None = field(
        default=None,
        metadata={"help": "Kernels: triton, foreach or reference (default: automatic)."},
    )
    triaccel_precision: bool = field(
        default=False,
        metadata={
            "help": "Per-module adaptive compute precision (fp32 / bf16 / fp16) steered by "
            "the Fisher signals; needs optim adafisher or adafisherw."
        },
    )
    triaccel_signals_every: int = field(
        default=200,
        metadata={"help": "Re-evaluate signals and precision every N optimizer steps."},
    )
    triaccel_fp32_fraction: float = field(
        default=PrecisionPolicy.fp32_fraction,
        metadata={
            "help": "Share of the compute and of the activations kept in fp32, given to the "
            "modules most sensitive per unit of that cost."
        },
    )
    triaccel_fp16_fraction: float | None = field(
        default=None,
        metadata={
            "help": "Share of the compute and activations in fp16, least sensitive first (default "
            "0.25 with --fp16, where a loss scaler exists, else 0)."
        },
    )
    triaccel_lr_steering: bool = field(
        default=False,
        metadata={
            "help": "Per-module step-size scale from the curvature signal, re-decided every "
            "triaccel_signals_every steps (experimental); needs optim adafisher or adafisherw."
        },
    )
    elastic_batch: bool = field(
        default=False,
        metadata={
            "help": "Micro-batch that follows live GPU memory, with out-of-memory steps re-run "
            "in smaller pieces; the effective batch stays per_device_train_batch_size. "
            "--auto_find_batch_size turns it on too (it replaces the stock search)."
        },
    )
    elastic_min_micro_batch: int = field(
        default=1, metadata={"help": "Elastic batch: smallest micro-batch before giving up."}
    )
    elastic_target_fraction: float = field(
        default=0.9,
        metadata={"help": "Elastic batch: peak memory target, as a share of what the GPU gives."},
    )
    device_data_augment: bool = field(
        default=True,
        metadata={
            "help": "For an ImageTensors train_dataset (images kept on the device): random "
            "crop with 4-pixel padding and horizontal flip, done per batch on the device."
        },
    )

    def __post_init__(self) -> None:
        name = getattr(self.optim, "value", self.optim)
        self.optim = str(name).lower() if str(name).lower() in OPTIMIZERS else name
        ours = self.optim in OPTIMIZERS
        if ours:
            self._check_adafisher_fields()
            chosen, self.optim = self.optim, "adamw_torch"  # let the parent validate the rest
        if self.auto_find_batch_size:
            # the stock search restarts the inner loop and drops the accumulation
            # arithmetic; the elastic controller replaces it under the same flag
            self.auto_find_batch_size, self.elastic_batch = False, True
        if self.elastic_min_micro_batch < 1:
            raise ValueError(
                f"TriAccelArguments.elastic_min_micro_batch={self.elastic_min_micro_batch!r}: "
                "needs >= 1"
            )
        if not 0.0 < self.elastic_target_fraction <= 1.0:
            raise ValueError(
                f"TriAccelArguments.elastic_target_fraction={self.elastic_target_fraction!r}: "
                "must lie in (0, 1]"
            )
        super().__post_init__()
        for name in ("triaccel_precision", "triaccel_lr_steering"):
            if getattr(self, name) and not ours:
                raise ValueError(
                    f"TriAccelArguments.{name} needs optim adafisher or adafisherw "
                    f"(its signals come from the Fisher factors), got optim={self.optim!r}"
                )
        if ours:
            self.optim = chosen
            if self.fsdp or self.deepspeed:
                raise ValueError(
                    f"optim={chosen!r} does not support "
                    f"{'fsdp' if self.fsdp else 'deepspeed'} yet: use DDP or a single device"
                )

    def _check_adafisher_fields(self) -> None:
        checks = [
            ("adafisher_beta", 0.0 <= self.adafisher_beta < 1.0, "needs 0 <= beta < 1"),
            ("adafisher_damping", self.adafisher_damping > 0.0, "needs > 0"),
            ("adafisher_gamma", 0.0 < self.adafisher_gamma < 1.0, "needs 0 < gamma < 1"),
            (
                "adafisher_update_every",
                self.adafisher_update_every is None or self.adafisher_update_every >= 1,
                "needs an integer >= 1",
            ),
            ("adafisher_ema", self.adafisher_ema in EMA_MODES, f"must be one of {EMA_MODES}"),
            (
                "triaccel_impl",
                self.triaccel_impl is None or self.triaccel_impl in IMPLS + ("auto",),
                f"must be one of {IMPLS + ('auto',)}",
            ),
            ("learning_rate", self.learning_rate >= 0.0, "needs >= 0"),
            ("weight_decay", self.weight_decay >= 0.0, "needs >= 0"),
            ("triaccel_signals_every", self.triaccel_signals_every >= 1, "needs >= 1"),
            (
                "triaccel_fp32_fraction",
                0.0 <= self.triaccel_fp32_fraction <= 1.0,
                "must lie in [0, 1]",
            ),
            (
                "triaccel_fp16_fraction",
                self.triaccel_fp16_fraction is None or 0.0 <= self.triaccel_fp16_fraction <= 1.0,
                "must lie in [0, 1]",
            ),
        ]
        for name, ok, why in checks:
            if not ok:
                raise ValueError(f"TriAccelArguments.{name}={getattr(self, name)!r}: {why}")

    @property
    def uses_adafisher(self) -> bool:
        """Whether ``optim`` names one of hf_triaccel's optimizers."""
        return self.optim in OPTIMIZERS

    def to_plugin(self) -> TriAccelPlugin:
        """The :class:`TriAccelPlugin` these arguments describe."""
        if not self.uses_adafisher:
            raise ValueError(f"optim={self.optim!r} is not an hf_triaccel optimizer")
        return TriAccelPlugin(
            optimizer=self.optim,
            lr=self.learning_rate,
            weight_decay=self.weight_decay,
            beta=self.adafisher_beta,
            damping=self.adafisher_damping,
            gamma=self.adafisher_gamma,
            update_every=self.adafisher_update_every,
            ema=self.adafisher_ema,
            impl=self.triaccel_impl,
            precision=self.triaccel_precision,
            signals_every=self.triaccel_signals_every,
            fp32_fraction=self.triaccel_fp32_fraction,
            fp16_fraction=self.triaccel_fp16_fraction,
            lr_steering=self.triaccel_lr_steering,
        )


class TriAccelTrainer(Trainer):
    """A ``transformers.Trainer`` that trains with AdaFisher and reports its efficiency.

    Works with transformers models and with plain ``nn.Module`` models (timm): for
    those, the batch's single non-label entry is passed positionally and the loss is
    cross-entropy on the returned logits, with ``label_smoothing_factor`` (or
    ``compute_loss_func`` when given).

    ``train_dataset`` / ``eval_dataset`` may be an
    :class:`~hf_triaccel.data.images.ImageTensors` (decoded images, see
    :func:`~hf_triaccel.data.images.load_image_dataset`): batches are then gathered and
    augmented on the device instead of collated by DataLoader workers.

    Example:
        >>> from transformers import GPT2Config, GPT2LMHeadModel
        >>> model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
        >>> args = TriAccelArguments(output_dir="out", max_steps=2, learning_rate=1e-3)
        >>> trainer = TriAccelTrainer(model=model, args=args, train_dataset=[])  # doctest: +SKIP
    """

    def __init__(self, model=None, args: TriAccelArguments | None = None, *a, **kw) -> None:
        if args is None:
            args = TriAccelArguments(output_dir="trainer_output")
        if not isinstance(args, TriAccelArguments):
            raise TypeError(
                f"TriAccelTrainer needs TriAccelArguments, got {type(args).__name__}; "
                "TriAccelArguments accepts every TrainingArguments field"
            )
        self._plain_model = model is not None and not isinstance(model, PreTrainedModel)
        self._pixel_stats: tuple[ImageTensors, tuple] | None = None
        if self._plain_model and args.remove_unused_columns:
            # the column filter reads forward()'s signature, which says nothing useful
            # for a plain module such as timm's forward(x)
            logger.info("plain nn.Module model: keeping every dataset column")
            args.remove_unused_columns = False
        # the stock label smoother reads model.config, which a plain module lacks: the
        # plain-model loss applies the smoothing itself
        self._label_smoothing = 0.0
        if self._plain_model and args.label_smoothing_factor:
            self._label_smoothing, args.label_smoothing_factor = args.label_smoothing_factor, 0.0
        super().__init__(model, args, *a, **kw)
        if self._plain_model and self.args.label_names is None:
            self.label_names = ["labels"]
        if args.uses_adafisher:
            check_distributed_support(self.accelerator.distributed_type)
            if args.torch_compile:
                warnings.warn(
                    "torch_compile with AdaFisher: the Fisher statistics hooks run Python on "
                    "refresh steps, which breaks the compiled graph there; steps in between "
                    "run compiled",
                    stacklevel=2,
                )
        self.telemetry = EfficiencyTelemetry()
        self.add_callback(self.telemetry)
        self.signals: SignalTracker | None = None
        self.precision: PrecisionController | None = None
        self.steering: StepSizeSteering | None = None
        self.elastic: TrainerElasticBatch | None = None
        if args.elastic_batch:
            self.enable_elastic_batch(
                min_micro_batch=args.elastic_min_micro_batch,
                target_fraction=args.elastic_target_fraction,
            )

    def enable_elastic_batch(self, **kwargs: Any) -> TrainerElasticBatch:
        """Turns on the memory-elastic micro-batch (what ``elastic_batch=True`` does);
        ``kwargs`` go to :class:`TrainerElasticBatch` (e.g. a custom memory ``probe``)."""
        self.elastic = TrainerElasticBatch.attach(self, **kwargs)
        return self.elastic

    def training_step(self, model, inputs, num_items_in_batch=None):
        if self.elastic is None:
            return super().training_step(model, inputs, num_items_in_batch)
        return self.elastic.training_step(model, inputs, num_items_in_batch)

    def train(self, resume_from_checkpoint=None, **kwargs):
        if self.elastic is not None:
            self.elastic.resume(resume_from_checkpoint)
        return super().train(resume_from_checkpoint, **kwargs)

    @property
    def collector(self):
        """The Fisher collector of the optimizer (``None`` before it is created)."""
        opt = getattr(self.optimizer, "optimizer", self.optimizer)
        return getattr(opt, "collector", None)

    def create_optimizer(self, model=None) -> torch.optim.Optimizer:
        if self.optimizer is None and self.args.uses_adafisher:
            if self.optimizer_cls_and_kwargs is not None:
                raise ValueError(
                    f"optim={self.args.optim!r} and optimizer_cls_and_kwargs were both given"
                )
            plugin = self.args.to_plugin()
            unwrapped = self.accelerator.unwrap_model(self.model if model is None else model)
            collector = plugin.build_collector(unwrapped)
            collector.grad_scaler = self.accelerator.scaler
            self.optimizer_cls_and_kwargs = (
                OPTIMIZERS[plugin.optimizer],
                {"collector": collector, **plugin.optimizer_kwargs()},
            )
            optimizer = super().create_optimizer(model)
            inner = getattr(optimizer, "optimizer", optimizer)
            controllers = plugin.build_precision(unwrapped, inner, fp16=self.args.fp16)
            if controllers is not None:
                self.signals, self.precision = controllers
                self.telemetry.add_provider(self.precision.counts)
                self.add_callback(_PrecisionReport(self.precision, self.signals))
            self.steering = plugin.build_steering(inner, self.signals)
            if self.steering is not None:
                self.signals = self.steering.tracker
                self.telemetry.add_provider(self.steering.summary)
            return optimizer
        return super().create_optimizer(model)

    def compute_loss(
        self,
        model,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch=None,
    ):
        if not self._plain_model:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        features = {k: v for k, v in inputs.items() if k != "labels"}
        if "labels" not in inputs or len(features) != 1:
            raise ValueError(
                "a plain nn.Module model needs batches with 'labels' and exactly one input "
                f"entry; got keys {sorted(inputs)}"
            )
        logits = model(next(iter(features.values())))
        labels = inputs["labels"]
        if self.compute_loss_func is not None:
            loss = self.compute_loss_func(logits, labels, num_items_in_batch=num_items_in_batch)
            if self.args.average_tokens_across_devices and num_items_in_batch is not None:
                # as the stock compute_loss: the loss is normalised by the global item
                # count, and DDP averages gradients over processes
                loss = loss * self.accelerator.num_processes
        else:
            loss = F.cross_entropy(logits.float(), labels, label_smoothing=self._label_smoothing)
        return (loss, {"logits": logits}) if return_outputs else loss

    def get_train_dataloader(self):
        if not isinstance(self.train_dataset, ImageTensors):
            return super().get_train_dataloader()
        return self._device_loader(
            self.train_dataset,
            self._train_batch_size,
            shuffle=True,
            augment=self.args.device_data_augment,
            drop_last=self.args.dataloader_drop_last,
        )

    def get_eval_dataloader(self, eval_dataset=None):
        dataset = self.eval_dataset if eval_dataset is None else eval_dataset
        if not isinstance(dataset, ImageTensors):
            return super().get_eval_dataloader(eval_dataset)
        return self._device_loader(
            dataset, self.args.eval_batch_size, shuffle=False, augment=False, drop_last=False
        )

    def _device_loader(self, data: ImageTensors, batch_size: int, **kwargs):
        """Batches built on the device, normalised with the training set's statistics."""
        stats = self.train_dataset if isinstance(self.train_dataset, ImageTensors) else data
        # computed once: each evaluation builds a new loader, and the statistics take a
        # pass over every training image
        if self._pixel_stats is None or self._pixel_stats[0] is not stats:
            self._pixel_stats = (stats, stats.channel_stats())
        mean, std = self._pixel_stats[1]
        return DeviceImageDataLoader(
            data,
            batch_size,
            rank=self.args.process_index,
            world=self.args.world_size,
            device=self.args.device,
            seed=self.args.seed,
            mean=mean,
            std=std,
            **kwargs,
        )

    @property
    def label_smoothing(self) -> float:
        """The label smoothing of the loss: ``label_smoothing_factor`` as given (for a plain
        ``nn.Module`` model it is applied here, the Trainer's own smoother needing a
        transformers model)."""
        return self._label_smoothing if self._plain_model else self.args.label_smoothing_factor

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs:  # a training log, not an evaluation one
            logs.update(self.telemetry.window_metrics())
        super().log(logs, start_time)


class _PrecisionReport(TrainerCallback):
    """At the end of training: the precision map (PNG) and the last signals (JSON)."""

    def __init__(self, precision: PrecisionController, signals: SignalTracker) -> None:
        self.precision, self.signals = precision, signals

    def on_train_end(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        out = Path(args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        plot_precision_map(
            self.precision.events, out / PRECISION_MAP_NAME, last_step=state.global_step
        )
        (out / SIGNALS_NAME).write_text(json.dumps(self.signals.as_dict(), indent=2))
