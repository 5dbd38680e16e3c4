"""Training recipes: one timm image classifier on one data set, trained by
:class:`~hf_triaccel.integrations.trainer.TriAccelTrainer` with the efficiency settings
on, and everything a published model needs written to the output folder.

A recipe script (``recipes/*.py``) only names its data set and model in a :class:`Recipe`
and calls :func:`main`; the flags are :class:`RecipeArguments` plus every
``TrainingArguments`` / :class:`TriAccelArguments` field, with the defaults of
:func:`recipe_defaults`. A run writes into ``output_dir``:

- ``model.safetensors`` and a timm-style ``config.json`` (architecture, classes, the
  input normalisation): :func:`load_trained` loads them back, from the folder or from the
  Hub repository they were published to;
- ``efficiency_report.json`` (the Trainer's telemetry), ``history.json`` (every log entry
  with its wall time) and ``results.json`` (accuracy, time, throughput, memory, settings,
  and the baseline's figures when there is one);
- PNG plots (loss, accuracy and memory over wall time; the precision map when the run
  has one) and the model card ``README.md``;
- with ``--baseline``, the AdamW (fused) run of the same recipe in ``output_dir/baseline``.

Example:
    >>> from hf_triaccel.integrations.recipes import Recipe, run_recipe
    >>> recipe = Recipe("cifar10_resnet18", "uoft-cs/cifar10", "CIFAR-10", "resnet18_cifar")
    >>> results = run_recipe(recipe, ["--dataset", "/data/cifar10", "--baseline"])  # doctest: +SKIP
    >>> results["eval_accuracy"], results["comparison"]["throughput_ratio"]  # doctest: +SKIP
    (0.8991, 1.01)
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import os
import shlex
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import timm
import torch
from huggingface_hub import hf_hub_download
from safetensors.torch import load_model
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.models import register_model
from torch import nn
from transformers import EvalPrediction, HfArgumentParser, TrainerCallback, set_seed

from hf_triaccel.data.images import ImageTensors, load_image_dataset
from hf_triaccel.integrations.model_card import PushToHubError, push_run, write_card
from hf_triaccel.integrations.plots import plot_run
from hf_triaccel.integrations.telemetry import REPORT_NAME
from hf_triaccel.integrations.timm_models import register_cifar_models, resnet18_cifar
from hf_triaccel.integrations.trainer import TriAccelArguments, TriAccelTrainer

logger = logging.getLogger(__name__)

RESULTS_NAME = "results.json"
HISTORY_NAME = "history.json"
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"  # what Trainer.save_model writes for a plain nn.Module
BASELINE_DIR = "baseline"
BASELINE_OPTIM = "adamw_torch_fused"
# the figures of a run that the baseline comparison (results.json, model card) shows
COMPARED = (
    "eval_accuracy",
    "train_runtime_s",
    "samples_per_second",
    "step_time_ms",
    "peak_memory_gb",
    "device",
)


@dataclass(frozen=True)
class Recipe:
    """What a recipe trains: a data set, its splits, and a timm model.

    Attributes:
        name: the recipe's name: its script is ``recipes/{name}.py`` and its default
            output folder ``outputs/{name}``.
        dataset: the Hub data set (a local parquet folder of the same layout can be
            given with ``--dataset``).
        title: the data set's display name, for the model card.
        model: the timm model name (``--model`` overrides it).
        train_split: the training split.
        eval_split: the split evaluated after every epoch and reported.

    Example:
        >>> Recipe("cifar100_resnet18", "uoft-cs/cifar100", "CIFAR-100", "resnet18_cifar")
        Recipe(name='cifar100_resnet18', dataset='uoft-cs/cifar100', title='CIFAR-100', \
model='resnet18_cifar', train_split='train', eval_split='test')
    """

    name: str
    dataset: str
    title: str
    model: str
    train_split: str = "train"
    eval_split: str = "test"


@dataclass
class RecipeArguments:
    """The recipe's own flags; every ``TriAccelArguments`` field is a flag too.

    Example:
        >>> RecipeArguments(baseline=True).baseline_learning_rate
        0.003
    """

    dataset: str | None = field(
        default=None,
        metadata={
            "help": "Hub data set id, or a local folder of {split}.parquet files (or Hub "
            "shards) with the Hub's columns, or 'embedded' (the CIFAR-10 slice in the package)."
        },
    )
    model: str | None = field(default=None, metadata={"help": "timm model name."})
    baseline: bool = field(
        default=False,
        metadata={
            "help": f"Also train the plain baseline ({BASELINE_OPTIM}, same schedule, batch "
            "and precision) first, into OUTPUT_DIR/baseline, and compare with it."
        },
    )
    baseline_learning_rate: float = field(
        default=3e-3, metadata={"help": "Learning rate of the --baseline run."}
    )
    baseline_weight_decay: float = field(
        default=0.05, metadata={"help": "Weight decay of the --baseline run."}
    )
    compare_to: str | None = field(
        default=None,
        metadata={
            "help": "A baseline run's results.json (or its folder) to compare with, instead "
            "of training the baseline again."
        },
    )
    plot: bool = field(
        default=True, metadata={"help": "Write the PNG plots (--no_plot to skip them)."}
    )


def recipe_defaults(recipe: Recipe) -> dict[str, Any]:
    """The defaults a recipe gives its flags; any flag given on the command line wins.

    The optimizer settings are the ones measured on CIFAR-10 with a ResNet-18, batch 512,
    30 epochs (BENCHMARKS.md). bf16 is on where CUDA is (``--bf16 false`` for a GPU
    without bf16).

    Example:
        >>> recipe = Recipe("cifar10_resnet18", "uoft-cs/cifar10", "CIFAR-10", "resnet18_cifar")
        >>> recipe_defaults(recipe)["optim"], recipe_defaults(recipe)["learning_rate"]
        ('adafisher', 0.003)
    """
    return {
        "dataset": recipe.dataset,
        "model": recipe.model,
        "output_dir": os.path.join("outputs", recipe.name),
        "optim": "adafisher",
        "learning_rate": 3e-3,
        "weight_decay": 5e-4,
        "per_device_train_batch_size": 512,
        "per_device_eval_batch_size": 1024,
        "num_train_epochs": 30.0,
        # one-cycle-like: linear warm-up over the first 30% of the steps, then cosine decay
        "lr_scheduler_type": "cosine",
        "warmup_steps": 0.3,
        "label_smoothing_factor": 0.1,
        "bf16": torch.cuda.is_available(),
        "eval_strategy": "epoch",
        "logging_steps": 20,
        # a checkpoint every epoch would add its write time to the measured training time
        "save_strategy": "no",
        # The loss is a per-process mean: DDP's gradient averaging then makes it the global
        # mean. With batch-wide counting across processes, the Trainer would expect a
        # per-process loss scaled by the process count, which the plain-model loss is not.
        "average_tokens_across_devices": False,
        # every parameter of these models gets a gradient: skip DDP's per-step graph search
        "ddp_find_unused_parameters": False,
    }


def parse_args(
    recipe: Recipe, argv: Sequence[str] | None = None
) -> tuple[RecipeArguments, TriAccelArguments]:
    """Parses the recipe's flags (``sys.argv[1:]`` by default) over its defaults.

    ``--epochs`` is another name for ``--num_train_epochs``.

    Example:
        >>> recipe = Recipe("cifar10_resnet18", "uoft-cs/cifar10", "CIFAR-10", "resnet18_cifar")
        >>> recipe_args, args = parse_args(recipe, ["--epochs", "5", "--baseline"])
        >>> recipe_args.baseline, args.num_train_epochs, args.optim
        (True, 5.0, 'adafisher')
    """
    parser = HfArgumentParser(
        (RecipeArguments, TriAccelArguments),
        description=f"{recipe.title}: timm {recipe.model} trained with hf_triaccel.",
    )
    parser.add_argument(
        "--epochs", dest="num_train_epochs", type=float, help="Same as --num_train_epochs."
    )
    parser.set_defaults(**recipe_defaults(recipe))
    recipe_args, args = parser.parse_args_into_dataclasses(args=argv)
    if recipe_args.baseline and recipe_args.compare_to:
        raise ValueError("--baseline and --compare_to both name a baseline: give one of them")
    return recipe_args, args


# ---------------------------------------------------------------------------- models

# read by timm's register_model, like the CIFAR variants' configs in timm_models
default_cfgs: dict[str, dict[str, Any]] = {
    "resnet18_tiny": {
        "url": "",
        "num_classes": 200,
        "input_size": (3, 64, 64),
        "pool_size": None,
        "crop_pct": 1.0,
        "interpolation": "bilinear",
        "mean": IMAGENET_DEFAULT_MEAN,
        "std": IMAGENET_DEFAULT_STD,
        "first_conv": "conv1",
        "classifier": "fc",
        "license": "apache-2.0",
    }
}


def resnet18_tiny(pretrained: bool = False, **kwargs: Any) -> nn.Module:
    """timm ``resnet18`` for 64x64 images (Tiny-ImageNet): a 3x3 stride-1 ``conv1``, then
    the stride-2 max-pool, so the first block sees 32x32 maps as on CIFAR.

    Args:
        pretrained: load the base model's ImageNet weights (``conv1`` starts fresh).
        **kwargs: timm model arguments (``num_classes`` defaults to 200).

    Example:
        >>> resnet18_tiny()(torch.zeros(2, 3, 64, 64)).shape
        torch.Size([2, 200])
    """
    kwargs.setdefault("num_classes", 200)
    model = resnet18_cifar(pretrained=pretrained, **kwargs)
    model.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
    cfg = dict(timm.models.get_pretrained_cfg("resnet18_tiny").to_dict())
    cfg["num_classes"] = model.num_classes
    model.pretrained_cfg = model.default_cfg = cfg
    # resnet18_cifar has no down-sampling before layer1; the max-pool halves what follows it
    for info in model.feature_info:
        if info["module"].startswith("layer"):
            info["reduction"] *= 2
    return model


def register_models() -> list[str]:
    """Registers the CIFAR variants and ``resnet18_tiny`` with timm (once).

    Example:
        >>> register_models()
        ['resnet18_cifar', 'efficientnet_b0_cifar', 'resnet18_tiny']
    """
    if not timm.models.is_model("resnet18_tiny"):
        register_model(resnet18_tiny)
    return [*register_cifar_models(), "resnet18_tiny"]


def create_model(name: str, **kwargs: Any) -> nn.Module:
    """``timm.create_model`` with the recipes' models registered.

    Example:
        >>> create_model("resnet18_tiny", num_classes=10).fc.out_features
        10
    """
    register_models()
    return timm.create_model(name, **kwargs)


def load_trained(source: str | os.PathLike) -> nn.Module:
    """A recipe's trained model, from its output folder or its Hub repository.

    The architecture is built untrained and the weights loaded into it: timm's own
    ``hf-hub:`` / ``local-dir:`` loading does not restore them into the CIFAR variants,
    whose entry points build timm's ImageNet model and then replace its stem.
    ``model.pretrained_cfg`` gets the input size and the normalisation the model was
    trained with.

    Example:
        >>> model = load_trained("outputs/cifar10_resnet18").eval()  # doctest: +SKIP
        >>> model = load_trained("me/cifar10-resnet18")  # doctest: +SKIP
        >>> model.pretrained_cfg["mean"]  # doctest: +SKIP
        [0.4914, 0.4822, 0.4465]
    """
    folder = Path(source).expanduser()
    if folder.is_dir():
        config_file, weights_file = folder / CONFIG_NAME, folder / WEIGHTS_NAME
    else:
        config_file = hf_hub_download(str(source), CONFIG_NAME)
        weights_file = hf_hub_download(str(source), WEIGHTS_NAME)
    config = json.loads(Path(config_file).read_text())
    model = create_model(config["architecture"], num_classes=config["num_classes"])
    load_model(model, weights_file)
    model.pretrained_cfg = {**model.pretrained_cfg, **config["pretrained_cfg"]}
    return model


def save_timm_config(
    model: nn.Module, data: ImageTensors, mean: Sequence[float], std: Sequence[float], path: Path
) -> None:
    """Writes timm's ``config.json`` for the trained model: architecture, classes and
    the normalisation the model was trained with (the training set's statistics).

    Example:
        >>> mean, std = train.channel_stats()  # doctest: +SKIP
        >>> save_timm_config(model, train, mean, std, Path("out/config.json"))  # doctest: +SKIP
    """
    keep = ("input_size", "interpolation", "crop_pct", "crop_mode", "first_conv", "classifier")
    pretrained_cfg = {k: model.pretrained_cfg[k] for k in keep if k in model.pretrained_cfg}
    pretrained_cfg.update(input_size=(3, *data.images.shape[2:]), mean=mean, std=std)
    config = {
        "architecture": model.pretrained_cfg["architecture"],
        "num_classes": model.num_classes,
        "num_features": model.num_features,
        "label_names": data.class_names,
        "pretrained_cfg": pretrained_cfg,
    }
    path.write_text(json.dumps(config, indent=2))


# ---------------------------------------------------------------------- training run


def predicted_classes(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Keeps only the argmax of the logits: evaluation then gathers one int per image
    (the Trainer's ``preprocess_logits_for_metrics``).

    Example:
        >>> predicted_classes(torch.tensor([[0.1, 2.0], [3.0, 0.0]]), None)
        tensor([1, 0])
    """
    return logits.argmax(dim=-1)


def accuracy(prediction: EvalPrediction) -> dict[str, float]:
    """Top-1 accuracy, the Trainer's ``compute_metrics`` (after :func:`predicted_classes`).

    Example:
        >>> import numpy as np
        >>> accuracy(EvalPrediction(np.array([1, 2, 3]), np.array([1, 2, 0])))
        {'accuracy': 0.6666666666666666}
    """
    return {"accuracy": float((prediction.predictions == prediction.label_ids).mean())}


class TimedHistory(TrainerCallback):
    """Every log entry with ``wall_time_s``, the seconds since training started (the
    Trainer's own log history has no time), and the time spent in evaluations during
    training (``training_eval_s``), which the training throughput leaves out.

    Example:
        >>> history = TimedHistory()
        >>> trainer = TriAccelTrainer(..., callbacks=[history])  # doctest: +SKIP
    """

    def __init__(self) -> None:
        self.entries: list[dict[str, Any]] = []
        self.training_eval_s = 0.0
        self._start = time.perf_counter()
        self._training = False

    def on_train_begin(self, args, state, control, **kwargs):
        self._start = time.perf_counter()
        self._training = True

    def on_train_end(self, args, state, control, **kwargs):
        self._training = False

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        if self._training:
            self.training_eval_s += logs.get("eval_runtime", 0.0)
        wall = round(time.perf_counter() - self._start, 3)
        self.entries.append({"wall_time_s": wall, "step": state.global_step, **logs})


@dataclass
class RecipeData:
    """The decoded training and evaluation splits.

    Example:
        >>> data = RecipeData.load(recipe, "/data/cifar10")  # doctest: +SKIP
        >>> data.num_classes  # doctest: +SKIP
        10
    """

    train: ImageTensors
    eval: ImageTensors

    @classmethod
    def load(cls, recipe: Recipe, source: str, progress: bool = True) -> RecipeData:
        """Loads the recipe's two splits from ``source`` (Hub id or local folder)."""
        return cls(
            load_image_dataset(source, recipe.train_split, progress=progress),
            load_image_dataset(source, recipe.eval_split, progress=progress),
        )

    @property
    def num_classes(self) -> int:
        """Classes of the data set (a split may lack the last ones)."""
        return max(self.train.num_classes, self.eval.num_classes)


@dataclass
class RunOutcome:
    """A finished run, on the main process: its results, timed log history and the
    precision-change events (empty when the run had no precision controller)."""

    results: dict[str, Any]
    history: list[dict[str, Any]]
    precision_events: list[Any]


def _settings(trainer: TriAccelTrainer) -> dict[str, Any]:
    """The settings a reader needs to judge and repeat the run."""
    args = trainer.args
    settings: dict[str, Any] = {
        "optim": str(getattr(args.optim, "value", args.optim)),
        "learning_rate": args.learning_rate,
        "weight_decay": args.weight_decay,
        "lr_scheduler_type": str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)),
        "warmup_steps": args.warmup_steps,
        "per_device_train_batch_size": args.per_device_train_batch_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "world_size": args.world_size,
        "total_batch_size": args.per_device_train_batch_size
        * args.gradient_accumulation_steps
        * args.world_size,
        "num_train_epochs": args.num_train_epochs,
        "max_steps": args.max_steps,
        "precision": "bf16 autocast" if args.bf16 else "fp16 autocast" if args.fp16 else "fp32",
        "label_smoothing": trainer.label_smoothing,
        "augmentation": "random crop (4-pixel zero padding) and horizontal flip, on the device"
        if args.device_data_augment
        else "none",
        "seed": args.seed,
        "adafisher": None,
    }
    if args.uses_adafisher:
        optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
        plugin = args.to_plugin()
        settings["adafisher"] = {
            "gamma": plugin.gamma,
            "damping": plugin.damping,
            "beta": plugin.beta,
            # the optimizer resolves the default refresh interval from the EMA rule
            "update_every": getattr(optimizer, "update_every", plugin.update_every),
            "ema": plugin.ema,
            "impl": plugin.impl or "auto",
        }
    return settings


def steady_step_time_ms(history: Sequence[dict[str, Any]]) -> tuple[float | None, int]:
    """Median step time over the logging windows after the first, and their number.

    The first window holds the warm-up (kernel compilation, allocator growth), which the
    first run in a process pays more of than a second one: with it left out, a run and
    its baseline compare the same way whichever trains first. A window that took in an
    evaluation is an outlier the median ignores. ``(None, 0)`` with fewer than two windows.

    Example:
        >>> steady_step_time_ms([{"step_time_ms": 900.0}, {"step_time_ms": 20.0},
        ...                      {"eval_loss": 1.0}, {"step_time_ms": 22.0}])
        (21.0, 2)
    """
    times = [e["step_time_ms"] for e in history if "step_time_ms" in e][1:]
    return (statistics.median(times), len(times)) if times else (None, 0)


def hub_dataset_id(source: str) -> str | None:
    """The Hub id a data source names, ``None`` for the embedded slice or a local path.

    Example:
        >>> hub_dataset_id("uoft-cs/cifar10"), hub_dataset_id("embedded")
        ('uoft-cs/cifar10', None)
    """
    return None if source == "embedded" or Path(source).expanduser().exists() else source


def _final_metrics(trainer: TriAccelTrainer) -> dict[str, float]:
    """The evaluation at the last step: the one logged there, else a new one."""
    last = next((e for e in reversed(trainer.state.log_history) if "eval_accuracy" in e), None)
    if last is not None and last["step"] == trainer.state.global_step:
        return last
    return trainer.evaluate()


def train_and_evaluate(
    recipe: Recipe,
    recipe_args: RecipeArguments,
    args: TriAccelArguments,
    data: RecipeData,
) -> RunOutcome | None:
    """Trains one model, evaluates it, and writes its model, ``config.json``,
    ``history.json`` and efficiency report into ``args.output_dir``.

    Returns:
        The run's outcome on the main process, ``None`` on the others.
    """
    set_seed(args.seed)  # the same initial weights for a run and its baseline
    model = create_model(recipe_args.model, num_classes=data.num_classes)
    history = TimedHistory()
    trainer = TriAccelTrainer(
        model=model,
        args=args,
        train_dataset=data.train,
        eval_dataset=data.eval,
        compute_metrics=accuracy,
        preprocess_logits_for_metrics=predicted_classes,
        callbacks=[history],
    )
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    metrics = _final_metrics(trainer)
    trainer.save_model()
    if not trainer.is_world_process_zero():
        return None
    out = Path(args.output_dir)
    mean, std = data.train.channel_stats()
    save_timm_config(model, data.train, mean, std, out / CONFIG_NAME)
    (out / HISTORY_NAME).write_text(json.dumps(history.entries, indent=1))
    report = json.loads((out / REPORT_NAME).read_text())
    step_ms, windows = steady_step_time_ms(history.entries)
    if step_ms is None:  # too few logging windows: the whole run, evaluations taken out
        steps = report["optimizer_steps"]
        train_s = report["train_runtime_s"] - history.training_eval_s
        step_ms = 1e3 * train_s / steps if steps and train_s > 0 else None
    settings = _settings(trainer)
    dataset = recipe_args.dataset
    results = {
        "recipe": recipe.name,
        "title": recipe.title,
        "model": recipe_args.model,
        "dataset": dataset,
        "dataset_id": hub_dataset_id(dataset),
        "train_split": recipe.train_split,
        "eval_split": recipe.eval_split,
        "train_samples": len(data.train),
        "eval_samples": len(data.eval),
        "num_classes": data.num_classes,
        "image_size": list(data.train.images.shape[2:]),
        "normalisation": {"mean": list(mean), "std": list(std)},
        "eval_accuracy": metrics["eval_accuracy"],
        "eval_loss": metrics.get("eval_loss"),
        # the Trainer's wall time, evaluations during training included
        "train_runtime_s": report["train_runtime_s"],
        "eval_runtime_s": round(history.training_eval_s, 3),
        # steady-state pace of training alone (see steady_step_time_ms)
        "step_time_ms": None if step_ms is None else round(step_ms, 3),
        "samples_per_second": None
        if step_ms is None
        else round(1e3 * settings["total_batch_size"] / step_ms, 2),
        "timing_windows": windows,
        "peak_memory_gb": report.get("peak_memory_gb"),
        "optimizer_steps": report["optimizer_steps"],
        "epochs": trainer.state.epoch,
        "device": report["device"],
        "versions": report["versions"],
        "settings": settings,
        "output_dir": str(out),
    }
    controller = trainer.precision
    events = list(controller.events) if controller is not None else []
    return RunOutcome(results, history.entries, events)


def baseline_arguments(args: TriAccelArguments, recipe_args: RecipeArguments) -> TriAccelArguments:
    """The baseline run's arguments: the run's, with fused AdamW and its own learning rate
    and weight decay, written to ``output_dir/baseline``.

    Example:
        >>> args = TriAccelArguments(output_dir="out", optim="adafisher")
        >>> baseline_arguments(args, RecipeArguments()).optim == "adamw_torch_fused"
        True
    """
    return dataclasses.replace(
        args,
        optim=BASELINE_OPTIM,
        learning_rate=recipe_args.baseline_learning_rate,
        weight_decay=recipe_args.baseline_weight_decay,
        output_dir=os.path.join(args.output_dir, BASELINE_DIR),
        resume_from_checkpoint=None,
    )


def load_run(path: str | os.PathLike) -> RunOutcome:
    """A finished run from its ``results.json`` (or its folder), with its ``history.json``
    when it sits beside it.

    Example:
        >>> run = load_run("outputs/cifar10_resnet18/baseline")  # doctest: +SKIP
        >>> run.results["settings"]["optim"]  # doctest: +SKIP
        'adamw_torch_fused'
    """
    path = Path(path)
    results_file = path / RESULTS_NAME if path.is_dir() else path
    if not results_file.is_file():
        raise FileNotFoundError(f"no run results at {results_file}")
    history_file = results_file.with_name(HISTORY_NAME)
    history = json.loads(history_file.read_text()) if history_file.is_file() else []
    return RunOutcome(json.loads(results_file.read_text()), history, [])


def compare(results: dict[str, Any], baseline: dict[str, Any]) -> dict[str, float | None]:
    """The run against its baseline: accuracy difference in points, and ratios (run / baseline)
    of training time, throughput and peak memory; ``None`` where a figure is missing.

    Example:
        >>> compare({"eval_accuracy": 0.9, "train_runtime_s": 90.0, "samples_per_second": 110.0,
        ...          "peak_memory_gb": None},
        ...         {"eval_accuracy": 0.88, "train_runtime_s": 100.0, "samples_per_second": 100.0,
        ...          "peak_memory_gb": 1.0})
        {'accuracy_points': 2.0, 'train_time_ratio': 0.9, 'throughput_ratio': 1.1, \
'peak_memory_ratio': None}
    """

    def ratio(key: str) -> float | None:
        a, b = results.get(key), baseline.get(key)
        return a / b if a is not None and b else None

    return {
        "accuracy_points": round(100 * (results["eval_accuracy"] - baseline["eval_accuracy"]), 2),
        "train_time_ratio": ratio("train_runtime_s"),
        "throughput_ratio": ratio("samples_per_second"),
        "peak_memory_ratio": ratio("peak_memory_gb"),
    }


def _write_json(results: dict[str, Any], folder: str | os.PathLike) -> None:
    Path(folder, RESULTS_NAME).write_text(json.dumps(results, indent=2))


def run_recipe(recipe: Recipe, argv: Sequence[str] | None = None) -> dict[str, Any] | None:
    """Runs a recipe: the baseline first when asked, then the run, then its results, plots
    and model card, then the Hub upload when asked.

    Args:
        recipe: what to train.
        argv: the flags (default ``sys.argv[1:]``).

    Returns:
        The run's results (as in ``results.json``) on the main process, ``None`` on others.

    Raises:
        PushToHubError: ``--push_to_hub`` failed; every output is already written.

    Example:
        >>> results = run_recipe(recipe, ["--max_steps", "2", "--use_cpu"])  # doctest: +SKIP
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    recipe_args, args = parse_args(recipe, argv)
    push = args.push_to_hub
    # The Trainer would create the Hub repository when it starts: the push happens here
    # instead, once every output is written.
    args = dataclasses.replace(args, push_to_hub=False)
    data = RecipeData.load(recipe, recipe_args.dataset, progress=args.process_index == 0)

    baseline = None
    if recipe_args.baseline:
        baseline = train_and_evaluate(
            recipe, recipe_args, baseline_arguments(args, recipe_args), data
        )
        if baseline is not None:
            _write_json(baseline.results, baseline.results["output_dir"])
        # free the baseline's model and optimizer before the run measures its own peak
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    elif recipe_args.compare_to:
        baseline = load_run(recipe_args.compare_to)

    run = train_and_evaluate(recipe, recipe_args, args, data)
    if run is None:
        return None
    results = run.results
    results["command"] = shlex.join(["accelerate", "launch", f"recipes/{recipe.name}.py", *argv])
    results["baseline"] = results["comparison"] = None
    curves = {results["settings"]["optim"]: run.history}
    if baseline is not None:
        results["baseline"] = {
            "optim": baseline.results["settings"]["optim"],
            **{k: baseline.results.get(k) for k in COMPARED},
            "settings": baseline.results["settings"],
            "source": baseline.results["output_dir"],
            "same_run": bool(recipe_args.baseline),
        }
        results["comparison"] = compare(results, baseline.results)
        curves[f"{results['baseline']['optim']} (baseline)"] = baseline.history
    results["plots"] = {}
    if recipe_args.plot:
        results["plots"] = plot_run(
            args.output_dir,
            curves,
            precision_events=run.precision_events,
            last_step=results["optimizer_steps"],
        )
    _write_json(results, args.output_dir)
    repo_id = args.hub_model_id or Path(args.output_dir).resolve().name
    write_card(results, args.output_dir, repo_id=repo_id)
    logger.info("accuracy %.4f; outputs in %s", results["eval_accuracy"], args.output_dir)
    if push:
        url = push_run(
            results, args.output_dir, repo_id, token=args.hub_token, private=args.hub_private_repo
        )
        logger.info("published %s", url)
    return results


def main(recipe: Recipe, argv: Sequence[str] | None = None) -> int:
    """The recipe scripts' entry point: runs the recipe, returns the exit status.

    A failed ``--push_to_hub`` prints its reason and returns 1; the run's outputs stay.

    Example:
        >>> import sys
        >>> sys.exit(main(recipe))  # doctest: +SKIP
    """
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s", level=logging.INFO)
    try:
        run_recipe(recipe, argv)
    except PushToHubError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0
