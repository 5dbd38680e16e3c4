"""The results of a recipe run (``results.json``): how the data is named, the settings as
they ran, the time figures from the Trainer's efficiency report and the run's timed log
history, the emissions, and the comparison with a baseline.

Every time figure names what it includes (:data:`DEFINITIONS`, also written into
``results.json``). The whole-run figures are the efficiency report's own
(``efficiency_report.json``), copied, so that the report, ``results.json`` and the model
card agree; the steady-state figures are the median over logging windows, which leaves
out the warm-up and the evaluations.

Example:
    >>> timing = timing_figures({"train_runtime_s": 12.0, "optimizer_steps": 4,
    ...     "samples_per_second": 40.0, "step_time_ms": 3000.0},
    ...     [{"step_time_ms": 900.0}, {"step_time_ms": 20.0}, {"step_time_ms": 22.0}],
    ...     eval_runtime_s=2.0, batch_size=10)
    >>> timing["steady_step_time_ms"], timing["steady_samples_per_second"]
    (21.0, 476.19)
"""

from __future__ import annotations

import json
import logging
import os
import platform
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from hf_triaccel import TriAccelArguments, TriAccelTrainer
from hf_triaccel.data.loading import EMBEDDED_ORIGIN
from hf_triaccel.integrations.model_card import push_run, write_card

from recipe_config import EMBEDDED, RecipeArguments, RecipeConfig

logger = logging.getLogger("recipes")

RESULTS_NAME = "results.json"
# the model-index identifier of the embedded slice: no Hub data set has its splits
EMBEDDED_TYPE = "hf-triaccel-cifar10-slice"
HISTORY_NAME = "history.json"
# the figures of a run that the baseline comparison (results.json, model card) shows
COMPARED = (
    "eval_accuracy",
    "train_runtime_s",
    "steady_samples_per_second",
    "steady_step_time_ms",
    "peak_memory_gb",
    "device",
)
DEFINITIONS = {
    "train_runtime_s": "wall time of Trainer.train(): training steps, logging and the "
    "evaluations during training (efficiency_report.json's train_runtime_s)",
    "eval_runtime_s": "the part of train_runtime_s spent in evaluations",
    "step_time_ms": "train_runtime_s / optimizer_steps: evaluations included "
    "(efficiency_report.json's step_time_ms)",
    "samples_per_second": "training samples / train_runtime_s: evaluations included "
    "(efficiency_report.json's samples_per_second)",
    "steady_step_time_ms": "median step time over the logging windows after the first "
    "(the warm-up), windows with an evaluation left out; without two such windows, "
    "(train_runtime_s - eval_runtime_s) / optimizer_steps",
    "steady_samples_per_second": "total batch size / steady_step_time_ms",
    "gpu_hours": "train_runtime_s x GPUs / 3600",
    "energy_kwh": "GPU energy over train_runtime_s, summed over the GPUs (NVML's energy "
    "counter read when training starts and ends); CPU and memory not counted",
}


def duration(seconds: float) -> str:
    """A duration as a person reads it.

    Example:
        >>> duration(42.0), duration(390.0), duration(3 * 3600 + 600.0)
        ('42 s', '6.5 min', '3.2 h')
    """
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def steady_windows(history: Sequence[Mapping[str, Any]]) -> list[float]:
    """Step times of the logging windows after the first, those that took in an
    evaluation left out (an evaluation log before a training log falls in its window).

    Example:
        >>> steady_windows([{"step_time_ms": 900.0}, {"step_time_ms": 20.0},
        ...                 {"eval_loss": 1.0}, {"step_time_ms": 35.0}, {"step_time_ms": 22.0}])
        [20.0, 22.0]
    """
    times, first, evaluated = [], True, False
    for entry in history:
        if "eval_loss" in entry or "eval_accuracy" in entry:
            evaluated = True
        elif "step_time_ms" in entry:
            if not first and not evaluated:
                times.append(entry["step_time_ms"])
            first, evaluated = False, False
    return times


def timing_figures(
    report: Mapping[str, Any],
    history: Sequence[Mapping[str, Any]],
    *,
    eval_runtime_s: float,
    batch_size: int,
) -> dict[str, Any]:
    """The run's time figures (see :data:`DEFINITIONS`).

    Args:
        report: the Trainer's efficiency report.
        history: the timed log history.
        eval_runtime_s: seconds spent in evaluations during training.
        batch_size: samples per optimizer step, over every process.
    """
    windows = steady_windows(history)
    steps = report["optimizer_steps"]
    if len(windows) >= 2:
        steady = statistics.median(windows)
    else:
        train_only = report["train_runtime_s"] - eval_runtime_s
        steady = 1e3 * train_only / steps if steps and train_only > 0 else None
    return {
        "train_runtime_s": report["train_runtime_s"],
        "eval_runtime_s": round(eval_runtime_s, 3),
        "step_time_ms": report["step_time_ms"],
        "samples_per_second": report["samples_per_second"],
        "steady_step_time_ms": None if steady is None else round(steady, 3),
        "steady_samples_per_second": None if not steady else round(1e3 * batch_size / steady, 2),
        "timing_windows": len(windows) if len(windows) >= 2 else 0,
    }


def identity(config: RecipeConfig, recipe_args: RecipeArguments) -> dict[str, str | None]:
    """How the model card names the data: ``dataset_id`` (the Hub data set, when the data
    is, copies or is cut from one), ``dataset_type`` (model-index's identifier: the Hub id
    of the data itself, else the local data's or the slice's own name) and
    ``dataset_name`` (its display name)."""
    source = recipe_args.dataset
    if source == EMBEDDED:
        # its results are on 1,000 test images, not the Hub data set's test split: the
        # model-index names the slice, and the slice names where it comes from
        return {
            "dataset_id": EMBEDDED_ORIGIN,
            "dataset_type": EMBEDDED_TYPE,
            "dataset_name": f"CIFAR-10 slice shipped with hf_triaccel (the first 5,000 "
            f"training and 1,000 test images of {EMBEDDED_ORIGIN})",
        }
    local = Path(source).expanduser()
    if local.exists():
        hub = recipe_args.hub_dataset_id
        own = local.resolve().name if local.is_dir() else local.stem
        return {
            "dataset_id": hub,
            "dataset_type": hub or own,
            "dataset_name": f"{config.title} (local copy)" if hub else own,
        }
    return {"dataset_id": source, "dataset_type": source, "dataset_name": config.title}


def precision_setting(args: TriAccelArguments, controller: Any) -> str:
    """What computed in which precision: the static autocast, or the adaptive controller's
    per-module counts at the end of training."""
    base = "bf16 autocast" if args.bf16 else "fp16 autocast" if args.fp16 else "fp32"
    if controller is None:
        return f"static {base}"
    counts = controller.counts()
    return (
        f"adaptive per module: {counts['precision_fp32']} modules fp32, "
        f"{counts['precision_bf16']} bf16, {counts['precision_fp16']} fp16 at the end of "
        f"training ({counts['precision_changes']} decisions logged); other modules {base}"
    )


def settings(trainer: TriAccelTrainer, given: frozenset[str] = frozenset()) -> dict[str, Any]:
    """The settings a reader needs to judge and repeat the run, as they ran: the epochs
    only where they set the length (no ``max_steps``), cuDNN's autotuning only on CUDA,
    AdaFisher's variant; ``set_on_command_line`` names the settings ``given`` on the
    command line, every other one being the recipe's default."""
    args = trainer.args
    batch = args.per_device_train_batch_size * args.gradient_accumulation_steps
    out: dict[str, Any] = {
        "optim": str(getattr(args.optim, "value", args.optim)),
        "learning_rate": args.learning_rate,
        "weight_decay": args.weight_decay,
        "lr_scheduler_type": str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)),
        "warmup_steps": args.warmup_steps,
        "per_device_train_batch_size": args.per_device_train_batch_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "world_size": args.world_size,
        "total_batch_size": batch * args.world_size,
        # the Trainer ignores the epochs when max_steps is set
        "num_train_epochs": None if args.max_steps > 0 else args.num_train_epochs,
        "max_steps": args.max_steps,
        "precision": precision_setting(args, trainer.precision),
        "label_smoothing": trainer.label_smoothing,
        "augmentation": "random crop (4-pixel zero padding) and horizontal flip, on the device"
        if args.device_data_augment
        else "none",
        "seed": args.seed,
        "cudnn_benchmark": torch.backends.cudnn.benchmark if args.device.type == "cuda" else None,
        "adafisher": None,
        "set_on_command_line": sorted(given),
    }
    if args.uses_adafisher:
        plugin = args.to_plugin()
        optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
        out["adafisher"] = {
            "gamma": plugin.gamma,
            "damping": plugin.damping,
            "beta": plugin.beta,
            # the optimizer resolves the default refresh interval from the EMA rule
            "update_every": getattr(optimizer, "update_every", plugin.update_every),
            "ema": plugin.ema,
            "normalise": plugin.normalise,
            "factor_init": plugin.factor_init,
            "variant": adafisher_variant(plugin.ema, plugin.normalise, plugin.factor_init),
            "impl": plugin.impl or "auto",
        }
    return out


def adafisher_variant(ema: str, normalise: str, factor_init: str) -> str:
    """AdaFisher's rule in words, with where it departs from the published algorithm.

    Example:
        >>> print(adafisher_variant("reference", "absolute", "zeros"))
        the published EMA rule (ema=reference); this project's variant, not the published \
algorithm: factor_init="zeros"
        >>> adafisher_variant("paper", "absolute", "zeros")  # no seed survives the paper rule
        "the paper's EMA rule (ema=paper), as published"
    """
    rule = (
        "the published EMA rule (ema=reference)"
        if ema == "reference"
        else f"the paper's EMA rule (ema={ema})"
    )
    ours = []
    if normalise != "absolute":
        ours.append(f'normalise="{normalise}"')
    if ema == "reference" and factor_init != "ones":
        ours.append(f'factor_init="{factor_init}"')
    if not ours:
        return f"{rule}, as published"
    return f"{rule}; this project's variant, not the published algorithm: {', '.join(ours)}"


def true_device(device: str) -> str:
    """The device as a reader can look it up: a CPU named by its model and the cores this
    process may use (the report's ``cpu (...)`` often says ``unknown``), a GPU as it is.

    Example:
        >>> true_device("NVIDIA H200")
        'NVIDIA H200'
        >>> true_device("cpu (unknown)").startswith("CPU: ")
        True
    """
    if not device.startswith("cpu"):
        return device
    name = platform.processor() or platform.machine() or "unknown"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name") and ":" in line:
                name = line.split(":", 1)[1].strip()
                break
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"CPU: {name} ({cores} cores)"


def resumed_from(trainer: TriAccelTrainer, report: Mapping[str, Any]) -> dict[str, Any]:
    """Where a run's steps start and end: ``global_step`` (the model's steps from the
    start) and ``resumed_from_step`` (the checkpoint's step, 0 for a run from scratch);
    the time figures cover the steps after it."""
    total = trainer.state.global_step
    return {"global_step": total, "resumed_from_step": total - report["optimizer_steps"]}


def respect_umask(folder: str | os.PathLike) -> None:
    """Gives the files in ``folder`` the permissions the user's umask gives new files
    (safetensors writes its files readable by their owner only), so that a shared or
    uploaded folder reads as the user's other files do."""
    mask = os.umask(0)
    os.umask(mask)
    for path in Path(folder).iterdir():
        if path.is_file():
            path.chmod(0o666 & ~mask)


def comparison_table(results: Mapping[str, Any]) -> str:
    """The run and its baseline side by side, as the console shows them.

    Example:
        >>> print(comparison_table({
        ...     "settings": {"optim": "adafisher"}, "eval_accuracy": 0.391,
        ...     "train_runtime_s": 21.0, "steady_samples_per_second": 900.0,
        ...     "baseline": {"optim": "adamw_torch_fused", "eval_accuracy": 0.464,
        ...                  "train_runtime_s": 20.0, "steady_samples_per_second": 950.0},
        ...     "comparison": {"accuracy_points": -7.3, "train_time_ratio": 1.05}}))
        optimizer           accuracy  training time  samples/s (steady)
        adafisher             39.10%         21.0 s               900.0
        adamw_torch_fused     46.40%         20.0 s               950.0
        adafisher - adamw_torch_fused: -7.30 accuracy points, 1.050x the training time
    """

    def row(name: str, figures: Mapping[str, Any]) -> str:
        accuracy = figures.get("eval_accuracy")
        speed = figures.get("steady_samples_per_second")
        accuracy_cell = "n/a" if accuracy is None else f"{100 * accuracy:.2f}%"
        speed_cell = "n/a" if speed is None else f"{speed:.1f}"
        return (
            f"{name:<18} {accuracy_cell:>9} {figures['train_runtime_s']:>12.1f} s {speed_cell:>19}"
        )

    ours, theirs = results["settings"]["optim"], results["baseline"]["optim"]
    comparison = results["comparison"]
    points, ratio = comparison.get("accuracy_points"), comparison.get("train_time_ratio")
    return "\n".join(
        [
            f"{'optimizer':<18} {'accuracy':>9} {'training time':>14} {'samples/s (steady)':>19}",
            row(ours, results),
            row(theirs, results["baseline"]),
            f"{ours} - {theirs}: "
            + ("n/a" if points is None else f"{points:+.2f}")
            + " accuracy points, "
            + ("n/a" if ratio is None else f"{ratio:.3f}x")
            + " the training time",
        ]
    )


def emissions(results: dict[str, Any], recipe_args: RecipeArguments) -> dict[str, Any] | None:
    """The run's CO2-equivalent emissions from its measured GPU energy, or ``None``."""
    if results["energy"] is None:
        return None
    return {
        "emissions_g": round(results["energy"]["energy_kwh"] * recipe_args.carbon_intensity, 3),
        "carbon_intensity_g_per_kwh": recipe_args.carbon_intensity,
        "geographical_location": recipe_args.geographical_location,
    }


def compare(results: Mapping[str, Any], baseline: Mapping[str, Any]) -> dict[str, float | None]:
    """The run against its baseline: accuracy difference in points, and ratios (run /
    baseline) of training time, steady throughput and peak memory; ``None`` where a
    figure is missing.

    Example:
        >>> compare({"eval_accuracy": 0.9, "train_runtime_s": 90.0,
        ...          "steady_samples_per_second": 110.0, "peak_memory_gb": None},
        ...         {"eval_accuracy": 0.88, "train_runtime_s": 100.0,
        ...          "steady_samples_per_second": 100.0, "peak_memory_gb": 1.0})
        {'accuracy_points': 2.0, 'train_time_ratio': 0.9, 'throughput_ratio': 1.1, \
'peak_memory_ratio': None}
    """

    def ratio(key: str) -> float | None:
        a, b = results.get(key), baseline.get(key)
        return a / b if a is not None and b else None

    accuracy = results.get("eval_accuracy"), baseline.get("eval_accuracy")
    return {
        "accuracy_points": None
        if None in accuracy
        else round(100 * (accuracy[0] - accuracy[1]), 2),
        "train_time_ratio": ratio("train_runtime_s"),
        "throughput_ratio": ratio("steady_samples_per_second"),
        "peak_memory_ratio": ratio("peak_memory_gb"),
    }


def baseline_summary(baseline: Mapping[str, Any], same_run: bool) -> dict[str, Any]:
    """What ``results.json`` keeps of the baseline run.

    Example:
        >>> baseline_summary({"settings": {"optim": "adamw_torch_fused"},
        ...                   "output_dir": "out/baseline"}, True)["optim"]
        'adamw_torch_fused'
    """
    return {
        "optim": baseline["settings"]["optim"],
        **{key: baseline.get(key) for key in COMPARED},
        "settings": baseline["settings"],
        "source": baseline["output_dir"],
        "same_run": same_run,
    }


def load_results(path: str | os.PathLike) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A finished run's results (``results.json`` or its folder) and its ``history.json``
    when it sits beside it.

    Example:
        >>> results, history = load_results("outputs/cifar10_resnet18/baseline")  # doctest: +SKIP
    """
    path = Path(path)
    results_file = path / RESULTS_NAME if path.is_dir() else path
    if not results_file.is_file():
        raise FileNotFoundError(f"no run results at {results_file}")
    history_file = results_file.with_name(HISTORY_NAME)
    history = json.loads(history_file.read_text()) if history_file.is_file() else []
    return json.loads(results_file.read_text()), history


def write_json(content: Any, path: str | os.PathLike) -> None:
    """Writes ``content`` as indented JSON."""
    Path(path).write_text(json.dumps(content, indent=2))


def publish(results: dict[str, Any], args: TriAccelArguments, push: bool, outcome: str) -> None:
    """Writes the run's ``results.json`` and model card into ``args.output_dir``, logs
    ``outcome`` with where they are, then uploads the run when ``push``.

    Raises:
        PushToHubError: the upload failed; every output is already written.
    """
    write_json(results, Path(args.output_dir) / RESULTS_NAME)
    repo_id = args.hub_model_id or Path(args.output_dir).resolve().name
    write_card(results, args.output_dir, repo_id=repo_id)
    logger.info("%s; outputs in %s", outcome, args.output_dir)
    if push:
        url = push_run(
            results, args.output_dir, repo_id, token=args.hub_token, private=args.hub_private_repo
        )
        logger.info("published %s", url)


def run_figures(
    report: Mapping[str, Any],
    trainer: TriAccelTrainer,
    args: TriAccelArguments,
    timing: Mapping[str, Any],
    energy: Mapping[str, Any] | None,
    run_settings: Mapping[str, Any],
) -> dict[str, Any]:
    """What every recipe's ``results.json`` says of the run itself: its time figures
    (``timing_figures``), GPU-hours, peak memory, energy, steps, epochs, hardware, versions
    and settings."""
    gpus = args.world_size if torch.cuda.is_available() else 0
    return {
        **timing,
        "gpu_hours": round(timing["train_runtime_s"] * gpus / 3600, 6) if gpus else None,
        "peak_memory_gb": report.get("peak_memory_gb"),
        "bytes_per_parameter_held": report.get("bytes_per_parameter_held"),
        "bytes_per_parameter_released": report.get("bytes_per_parameter_released"),
        "energy": energy,
        "optimizer_steps": report["optimizer_steps"],
        "epochs": trainer.state.epoch,
        "device": true_device(report["device"]),
        "hardware": f"{args.world_size} x {true_device(report['device'])}",
        "versions": report["versions"],
        "settings": run_settings,
    }
