"""Train a recipe: one timm image classifier on one data set, with ``TriAccelTrainer`` and
the efficiency settings on, and everything a published model needs in the output folder.

Each recipe has its own script over this runner (``recipes/cifar10_resnet18.py``...);
``train.py --recipe NAME`` runs the same::

    accelerate launch recipes/cifar10_resnet18.py
    accelerate launch recipes/cifar10_resnet18.py --baseline             # and AdamW
    python recipes/cifar10_resnet18.py --quick --dataset embedded        # sized for a CPU
    python recipes/train.py --recipe configs/mine.yaml --help            # every flag

``--recipe`` names a configuration in ``recipes/configs/`` (data set, classes, model,
splits, quick form) or a YAML file of the same fields. Before training, the run says what
it will train and, on a CPU, about how long that takes. A run writes into ``output_dir``:

- ``model.safetensors`` and ``config.json`` (``timm.models.save_for_hf``: architecture,
  class names, the input size and normalisation): ``timm.create_model("local-dir:DIR",
  pretrained=True)`` loads it, after ``import hf_triaccel``;
- ``efficiency_report.json`` (the Trainer's telemetry), ``history.json`` (every log entry
  with its step and wall time) and ``results.json`` (recipe_results.py);
- PNG plots over the optimizer steps and the model card ``README.md``;
- with ``--baseline``, the AdamW (fused) run of the same recipe in ``output_dir/baseline``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import logging
import math
import os
import shlex
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import EvalPrediction, TrainerCallback, set_seed

from hf_triaccel import TriAccelArguments, TriAccelTrainer
from hf_triaccel.data import ImageTensors, is_hub_dataset_id, load_image_dataset
from hf_triaccel.data.loading import ClassCountError
from hf_triaccel.integrations.model_card import PushToHubError
from hf_triaccel.integrations.plots import plot_run
from hf_triaccel.integrations.telemetry import REPORT_NAME
from hf_triaccel.integrations.timm_models import create_cifar_model, save_model

from recipe_config import (
    BASELINE_OPTIM,
    EMBEDDED,
    RecipeArguments,
    RecipeConfig,
    UsageError,
    first_line,
    given_flags,
    hub_unreachable,
    model_args,
    parse_args,
)
from recipe_energy import EnergyMeter, total_energy
from recipe_results import (
    DEFINITIONS,
    HISTORY_NAME,
    RESULTS_NAME,
    baseline_summary,
    compare,
    comparison_table,
    duration,
    emissions,
    identity,
    load_results,
    publish,
    respect_umask,
    resumed_from,
    run_figures,
    settings,
    timing_figures,
    true_device,
    write_json,
)

logger = logging.getLogger("recipes")

BASELINE_DIR = "baseline"


def predicted_classes(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Keeps only the argmax of the logits (the Trainer's ``preprocess_logits_for_metrics``)."""
    return logits.argmax(dim=-1)


def accuracy(prediction: EvalPrediction) -> dict[str, float]:
    """Top-1 accuracy, the Trainer's ``compute_metrics`` (after :func:`predicted_classes`)."""
    return {"accuracy": float((prediction.predictions == prediction.label_ids).mean())}


class TimedHistory(TrainerCallback):
    """Every log entry with its ``step`` and ``wall_time_s`` (seconds since training
    started), the time spent in evaluations during training, and the efficiency report as
    it stands when training ends."""

    def __init__(self, trainer: TriAccelTrainer) -> None:
        self.telemetry = trainer.telemetry
        self.entries: list[dict[str, Any]] = []
        self.eval_runtime_s = 0.0
        self.report: dict[str, Any] | None = None
        self._start = time.perf_counter()
        self._training = False

    def on_train_begin(self, args, state, control, **kwargs):
        self._start, self._training = time.perf_counter(), True

    def on_train_end(self, args, state, control, **kwargs):
        self._training = False
        self.report = self.telemetry.report()

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        if self._training:
            self.eval_runtime_s += logs.get("eval_runtime", 0.0)
        wall = round(time.perf_counter() - self._start, 3)
        self.entries.append({"wall_time_s": wall, "step": state.global_step, **logs})


@dataclass
class RecipeData:
    """The decoded splits (``eval`` is ``None`` when the run does not evaluate) and the
    names the model card gives the data."""

    train: ImageTensors
    eval: ImageTensors | None
    identity: dict[str, str | None]

    @classmethod
    def load(
        cls, config: RecipeConfig, recipe_args: RecipeArguments, args: TriAccelArguments
    ) -> RecipeData:
        """Loads the splits.

        Raises:
            UsageError: data without the recipe's number of classes, or a Hub data set
                that cannot be loaded (no network: said at once, before ``datasets``
                retries), with what to run instead.
        """
        source = recipe_args.dataset
        options = {
            "image_column": recipe_args.image_column,
            "label_column": recipe_args.label_column,
            "num_classes": config.num_classes,
            "progress": args.process_index == 0,
        }
        from_hub = is_hub_dataset_id(source) and not Path(source).expanduser().exists()
        if from_hub and (reason := hub_unreachable()) is not None:
            raise UsageError(
                f"--dataset {source}: the Hub cannot be reached ({reason}). "
                + offline_advice(config)
            )
        splits = [config.train_split] + ([config.eval_split] if evaluates(args) else [])
        try:
            loaded = [load_image_dataset(source, split, **options) for split in splits]
        except ClassCountError as exc:
            raise UsageError(
                f"recipe {config.name} trains a {config.num_classes}-class {config.title} "
                f"model: {exc}. Give --dataset a copy of {config.dataset}"
            ) from None
        except RuntimeError as exc:  # the Hub data set could not be loaded
            if not from_hub:
                raise
            cause = first_line(exc.__cause__ or exc)
            raise UsageError(
                f"--dataset {source}: could not load it from the Hub ({cause}). "
                f"Check the id and the network. {offline_advice(config)}"
            ) from None
        return cls(loaded[0], loaded[1] if len(loaded) > 1 else None, identity(config, recipe_args))


def offline_advice(config: RecipeConfig) -> str:
    """What trains without the network: the embedded CIFAR-10 slice under ``--quick``, or a
    local copy of the data.

    Example:
        >>> print(offline_advice(RecipeConfig.load("cifar10_resnet18")))  # doctest: +ELLIPSIS
        Without a network, --dataset embedded --quick trains on the CIFAR-10 slice in the ...
    """
    local = f"a local folder of {config.dataset}'s parquet files works as --dataset too"
    if config.num_classes == 10:
        return (
            f"Without a network, --dataset {EMBEDDED} --quick trains on the CIFAR-10 slice in "
            f"the package (a few minutes on a CPU); {local}"
        )
    return (
        f"Without a network, {local}; `python recipes/cifar10_resnet18.py --dataset "
        f"{EMBEDDED} --quick` trains a CIFAR-10 model on the slice in the package"
    )


def evaluates(args: TriAccelArguments) -> bool:
    """Whether the run evaluates at all (``--eval_strategy no`` does not)."""
    return str(getattr(args.eval_strategy, "value", args.eval_strategy)) != "no"


@dataclass
class RunOutcome:
    """A finished run on the main process: its results, timed history and precision events."""

    results: dict[str, Any]
    history: list[dict[str, Any]]
    precision_events: list[Any]


def planned_steps(args: TriAccelArguments, train_samples: int) -> int:
    """The optimizer steps the Trainer will take: ``max_steps``, else the epochs' steps,
    counted as the Trainer counts them: an epoch's last, smaller batch skipped under
    ``dataloader_drop_last``, an epoch's last accumulation of fewer batches kept.

    Example:
        >>> args = TriAccelArguments(output_dir="out", per_device_train_batch_size=64,
        ...                          num_train_epochs=2, use_cpu=True)
        >>> planned_steps(args, 5000)
        158
        >>> args = TriAccelArguments(output_dir="out", per_device_train_batch_size=64,
        ...                          num_train_epochs=2, use_cpu=True, dataloader_drop_last=True)
        >>> planned_steps(args, 5000)
        156
    """
    if args.max_steps > 0:
        return args.max_steps
    per_process = math.ceil(train_samples / args.world_size)
    batch = args.per_device_train_batch_size
    batches = per_process // batch if args.dataloader_drop_last else math.ceil(per_process / batch)
    per_epoch = max(math.ceil(batches / args.gradient_accumulation_steps), 1)
    return math.ceil(args.num_train_epochs * per_epoch)


def probe_step_seconds(model: torch.nn.Module, images: ImageTensors, batch_size: int) -> float:
    """Seconds of one training forward and backward of ``model`` at ``batch_size``, timed
    on a copy with random images of the data's shape (the model itself is left as it is).

    A CPU's time grows with the batch: a batch of up to 32 is timed, the fastest of three
    runs after an untimed one (other work on the machine slows some), and scaled to
    ``batch_size``.

    Example:
        >>> from hf_triaccel.data import load_image_dataset
        >>> data = load_image_dataset("embedded", "test", progress=False)
        >>> probe_step_seconds(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.LazyLinear(10)),
        ...                    data, 64) > 0
        True
    """
    probe = copy.deepcopy(model).train()
    size = min(batch_size, 32)
    times = []
    # the run's random numbers stay as they were: the probe draws from its own
    with torch.random.fork_rng(devices=[]):
        x = torch.randn(size, *images.images.shape[1:])
        for _ in range(4):  # the first run allocates, and initialises lazy modules
            start = time.perf_counter()
            probe(x).float().square().mean().backward()
            times.append(time.perf_counter() - start)
    return min(times[1:]) * batch_size / size


def announce_plan(
    config: RecipeConfig,
    recipe_args: RecipeArguments,
    args: TriAccelArguments,
    data: RecipeData,
    model: torch.nn.Module,
) -> str:
    """Says, before training, what the run will train and, on a CPU, about how long it
    takes (from :func:`probe_step_seconds`); on a CPU, the full recipe's message points
    to ``--quick``. Logged on the main process, and returned."""
    steps = planned_steps(args, len(data.train))
    batch = args.per_device_train_batch_size * args.world_size * args.gradient_accumulation_steps
    params = sum(p.numel() for p in model.parameters()) / 1e6
    form = " --quick" if recipe_args.quick else ""
    message = (
        f"{config.name}{form}: {recipe_args.model} ({params:.2f} M parameters), {steps} "
        f"optimizer steps of {batch} images ({steps * batch / len(data.train):.1f} epochs of "
        f"{len(data.train):,} images) on {args.device.type}"
    )
    if data.eval is not None:
        every = f"{args.eval_steps:g} steps" if args.eval_strategy == "steps" else "epoch"
        message += f", evaluating {len(data.eval):,} images every {every} and at the end"
    if args.device.type == "cpu":
        step_s = probe_step_seconds(model, data.train, args.per_device_train_batch_size)
        message += (
            f". One step of this model takes about {step_s:.2f} s here: about "
            f"{duration(steps * step_s)} of training"
        )
        if not recipe_args.quick:
            message += "; --quick trains the form of this recipe sized for a CPU"
    if args.process_index == 0:
        logger.info("%s.", message)
    return message + "."


def typed_command(argv: list[str], recipe: str | None) -> str:
    """The command that started the run, as the process can tell it: ``accelerate
    launch`` (whose own options the script does not see) when Accelerate's launcher
    started it, else ``python``; then the recipe script as it was typed (``recipes/train.py
    --recipe NAME`` when the run did not come from one) and the flags.

    Example:
        >>> typed_command(["--quick"], "cifar10_resnet18")  # called from outside the scripts
        'python recipes/train.py --recipe cifar10_resnet18 --quick'
    """
    # every `accelerate launch` sets the mixed precision it chose for its processes
    accelerate = "ACCELERATE_MIXED_PRECISION" in os.environ
    launcher = ["accelerate", "launch"] if accelerate else ["python"]
    typed = Path(sys.argv[0])
    ours = typed.suffix == ".py" and typed.resolve().parent == Path(__file__).resolve().parent
    script = sys.argv[0] if ours else "recipes/train.py"
    flags = ["--recipe", recipe, *argv] if recipe and Path(script).stem != recipe else argv
    return shlex.join([*launcher, script, *flags])


@contextlib.contextmanager
def cudnn_autotuning(on: bool) -> Iterator[None]:
    """cuDNN's autotuning (``torch.backends.cudnn.benchmark``) set to ``on`` for the block,
    and back to what it was when the block ends.

    Example:
        >>> with cudnn_autotuning(True):
        ...     torch.backends.cudnn.benchmark
        True
    """
    before = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = on
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = before


def train_and_evaluate(
    config: RecipeConfig,
    recipe_args: RecipeArguments,
    args: TriAccelArguments,
    data: RecipeData,
    given: frozenset[str] = frozenset(),
) -> RunOutcome | None:
    """Trains one model, evaluates it (unless ``--eval_strategy no``), and writes its
    model, ``history.json`` and efficiency report into ``args.output_dir``.

    ``given`` names the settings set on the command line (the others are the recipe's
    defaults), for the results and the card.

    Every batch has one shape (whole batches only, evaluation batches that divide the test
    set), so cuDNN's autotuning is on: each convolution's algorithms are timed once per
    shape and the fastest kept, as the hand-written loops of ``benchmarks/`` do;
    ``--full_determinism`` keeps the Trainer's deterministic choice.

    Returns:
        The run's outcome on the main process, ``None`` on the others.
    """
    with cudnn_autotuning(not args.full_determinism):
        return _train_and_evaluate(config, recipe_args, args, data, given)


def _train_and_evaluate(
    config: RecipeConfig,
    recipe_args: RecipeArguments,
    args: TriAccelArguments,
    data: RecipeData,
    given: frozenset[str],
) -> RunOutcome | None:
    set_seed(args.seed)  # the same initial weights for a run and its baseline
    model = create_cifar_model(
        recipe_args.model, num_classes=config.num_classes, **model_args(config, recipe_args)
    )
    plan = announce_plan(config, recipe_args, args, data, model)
    trainer = TriAccelTrainer(
        model=model,
        args=args,
        train_dataset=data.train,
        eval_dataset=data.eval,
        compute_metrics=accuracy,
        preprocess_logits_for_metrics=predicted_classes,
    )
    history, meter = TimedHistory(trainer), EnergyMeter()
    trainer.add_callback(history)
    trainer.add_callback(meter)
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    metrics: dict[str, Any] = {}
    if data.eval is not None:
        last = next((e for e in reversed(history.entries) if "eval_accuracy" in e), None)
        at_end = last is not None and last["step"] == trainer.state.global_step
        metrics = last if at_end else trainer.evaluate()
    run_energy = total_energy(trainer, meter)
    if not trainer.is_world_process_zero():
        return None
    out = Path(args.output_dir)
    mean, std = data.train.channel_stats()
    save_model(
        trainer.accelerator.unwrap_model(trainer.model),
        out,
        label_names=data.train.class_names,
        mean=mean,
        std=std,
        input_size=(3, *data.train.images.shape[2:]),
    )
    respect_umask(out)
    report = {**history.report, "device": true_device(history.report["device"])}
    write_json(report, out / REPORT_NAME)
    write_json(history.entries, out / HISTORY_NAME)
    run_settings = settings(trainer, given)
    timing = timing_figures(
        report,
        history.entries,
        eval_runtime_s=history.eval_runtime_s,
        batch_size=run_settings["total_batch_size"],
    )
    results = {
        "recipe": config.name,
        "title": config.title,
        "model": recipe_args.model,
        "model_args": model_args(config, recipe_args),
        "quick": recipe_args.quick,
        "plan": plan,
        "dataset": recipe_args.dataset,
        **data.identity,
        "train_split": config.train_split,
        "eval_split": config.eval_split if data.eval is not None else None,
        "train_samples": len(data.train),
        "eval_samples": len(data.eval) if data.eval is not None else None,
        "num_classes": config.num_classes,
        "image_size": list(data.train.images.shape[2:]),
        "normalisation": {"mean": list(mean), "std": list(std)},
        "eval_accuracy": metrics.get("eval_accuracy"),
        "eval_loss": metrics.get("eval_loss"),
        **run_figures(report, trainer, args, timing, run_energy, run_settings),
        **resumed_from(trainer, report),
        "definitions": DEFINITIONS,
        "output_dir": str(out),
    }
    events = list(trainer.precision.events) if trainer.precision is not None else []
    return RunOutcome(results, history.entries, events)


def baseline_arguments(args: TriAccelArguments, recipe_args: RecipeArguments) -> TriAccelArguments:
    """The baseline run's arguments: the run's, with fused AdamW and its own learning rate
    and weight decay, written to ``output_dir/baseline``."""
    return dataclasses.replace(
        args,
        optim=BASELINE_OPTIM,
        learning_rate=recipe_args.baseline_learning_rate,
        weight_decay=recipe_args.baseline_weight_decay,
        output_dir=os.path.join(args.output_dir, BASELINE_DIR),
        resume_from_checkpoint=None,
    )


def run_recipe(argv: list[str] | None = None, recipe: str | None = None) -> dict[str, Any] | None:
    """Runs a recipe: the baseline first when asked, then the run, its results, plots and
    model card, then the Hub upload when asked.

    Args:
        argv: the flags (``sys.argv[1:]`` by default).
        recipe: the recipe, for the ``recipes/<name>.py`` scripts; without it ``--recipe``
            names it.

    Returns:
        The run's results (as in ``results.json``) on the main process, ``None`` on others.

    Raises:
        PushToHubError: ``--push_to_hub`` failed; every output is already written.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    config, recipe_args, args = parse_args(argv, recipe=recipe)
    given = given_flags(argv)
    push = args.push_to_hub
    # The Trainer would create the Hub repository when it starts: the push happens here
    # instead, once every output is written.
    args = dataclasses.replace(args, push_to_hub=False)
    data = RecipeData.load(config, recipe_args, args)

    baseline = None
    if recipe_args.baseline:
        baseline_args = baseline_arguments(args, recipe_args)
        outcome = train_and_evaluate(config, recipe_args, baseline_args, data, given)
        if outcome is not None:
            outcome.results["co2"] = emissions(outcome.results, recipe_args)
            write_json(outcome.results, Path(baseline_args.output_dir) / RESULTS_NAME)
            baseline = (outcome.results, outcome.history)
        # free the baseline's model and optimizer before the run measures its own peak
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    elif recipe_args.compare_to:
        baseline = load_results(recipe_args.compare_to)

    run = train_and_evaluate(config, recipe_args, args, data, given)
    if run is None:
        return None
    results = run.results
    results["co2"] = emissions(results, recipe_args)
    results["command"] = typed_command(argv, recipe)
    results["baseline"] = results["comparison"] = None
    curves = {results["settings"]["optim"]: run.history}
    if baseline is not None:
        base_results, base_history = baseline
        results["baseline"] = baseline_summary(base_results, same_run=recipe_args.baseline)
        results["comparison"] = compare(results, base_results)
        curves[f"{results['baseline']['optim']} (baseline)"] = base_history
    results["plots"] = {}
    if recipe_args.plot:
        results["plots"] = plot_run(
            args.output_dir,
            curves,
            precision_events=run.precision_events,
            last_step=results["optimizer_steps"],
        )
    if results["comparison"] is not None:  # on the console too, before any upload
        print(comparison_table(results), flush=True)
    publish(results, args, push, f"accuracy {results['eval_accuracy']}")
    return results


def main(argv: list[str] | None = None, recipe: str | None = None) -> int:
    """The entry point: runs the recipe (``recipe``, else the one ``--recipe`` names),
    returns the exit status (1 when ``--push_to_hub`` failed, the reason printed; the
    outputs stay; 2 for a flag or data that cannot work, said in one line)."""
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s", level=logging.INFO)
    try:
        run_recipe(argv, recipe)
    except UsageError as exc:
        script = f"{recipe}.py" if recipe else Path(sys.argv[0]).name
        print(f"{script}: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    except PushToHubError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
