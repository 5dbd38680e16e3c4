"""The recipe scripts end to end on tiny Hub-layout data (CPU, 2 steps), and their helpers."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

pytest.importorskip("timm")
pytest.importorskip("matplotlib")

from safetensors.torch import load_file  # noqa: E402
from transformers import EvalPrediction  # noqa: E402

from hf_triaccel.integrations import model_card  # noqa: E402
from hf_triaccel.integrations.recipes import (  # noqa: E402
    Recipe,
    RecipeArguments,
    accuracy,
    baseline_arguments,
    compare,
    create_model,
    load_run,
    load_trained,
    main,
    parse_args,
    run_recipe,
    steady_step_time_ms,
)

RECIPES_DIR = Path(__file__).resolve().parents[2] / "recipes"
SCRIPTS = sorted(p.stem for p in RECIPES_DIR.glob("*.py"))
CLASSES = {
    "cifar10_resnet18": 10,
    "cifar10_efficientnet_b0": 10,
    "cifar100_resnet18": 100,
    "tiny_imagenet_resnet18": 200,
}
CIFAR10 = Recipe("cifar10_resnet18", "uoft-cs/cifar10", "CIFAR-10", "resnet18_cifar")


def load_recipe(name: str) -> Recipe:
    """The ``RECIPE`` of ``recipes/{name}.py``, imported without running the script."""
    spec = importlib.util.spec_from_file_location(f"recipe_{name}", RECIPES_DIR / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.RECIPE


def tiny_run(dataset: Path, out: Path, *extra: str) -> list[str]:
    """Flags for a 2-step CPU run with batches of 2."""
    return [
        "--dataset",
        str(dataset),
        "--output_dir",
        str(out),
        "--use_cpu",
        "--max_steps",
        "2",
        "--per_device_train_batch_size",
        "2",
        "--per_device_eval_batch_size",
        "4",
        "--logging_steps",
        "1",
        "--disable_tqdm",
        "true",
        *extra,
    ]


def front_matter(card: str) -> dict:
    _, header, _ = card.split("---\n", 2)
    return yaml.safe_load(header)


class OfflineHfApi:
    """Stands in for ``huggingface_hub.HfApi`` without network: every call fails."""

    def __init__(self, token=None) -> None:
        pass

    def create_repo(self, *args, **kwargs):
        raise ConnectionError("Failed to resolve 'huggingface.co'")


def test_every_recipe_script_is_tested():
    assert sorted(CLASSES) == SCRIPTS


@pytest.mark.parametrize("name", SCRIPTS)
def test_recipe_trains_and_writes_model_reports_plots_and_card(name, hub_folders, tmp_path):
    recipe = load_recipe(name)
    out = tmp_path / name
    results = run_recipe(recipe, tiny_run(hub_folders[name], out))

    for file in (
        "model.safetensors",
        "config.json",
        "efficiency_report.json",
        "history.json",
        "results.json",
        "loss.png",
        "accuracy.png",
        "README.md",
    ):
        assert (out / file).is_file(), file
    assert not (out / "baseline").exists()
    assert json.loads((out / "results.json").read_text()) == results
    assert results["optimizer_steps"] == 2
    assert results["num_classes"] == CLASSES[name]
    assert results["settings"]["optim"] == "adafisher"
    assert results["settings"]["label_smoothing"] == 0.1
    assert results["dataset_id"] is None and results["baseline"] is None
    assert 0.0 <= results["eval_accuracy"] <= 1.0
    assert results["step_time_ms"] > 0 and results["samples_per_second"] > 0
    assert set(results["plots"]) == {"loss", "accuracy"}  # no GPU memory figures on a CPU

    card = (out / "README.md").read_text()
    accuracy_value = front_matter(card)["model-index"][0]["results"][0]["metrics"][0]["value"]
    assert accuracy_value == round(results["eval_accuracy"], 4)
    assert f"{100 * results['eval_accuracy']:.2f}%" in card
    assert f"{results['train_runtime_s']:.1f} s" in card
    assert results["model"] in card and recipe.title in card

    # the output folder loads back with the trained weights and the training normalisation
    model = load_trained(out).eval()
    saved = load_file(out / "model.safetensors")
    assert all(torch.equal(value, saved[key]) for key, value in model.state_dict().items())
    assert model.pretrained_cfg["mean"] == results["normalisation"]["mean"]
    size = results["image_size"]
    assert model(torch.zeros(1, 3, *size)).shape == (1, CLASSES[name])


@pytest.fixture(scope="module")
def run_with_baseline_and_failed_push(hub_folders, tmp_path_factory):
    """The CIFAR-10 recipe with --baseline and --push_to_hub while the Hub is unreachable."""
    out = tmp_path_factory.mktemp("runs") / "cifar10"
    argv = tiny_run(
        hub_folders["cifar10_resnet18"],
        out,
        "--baseline",
        "--push_to_hub",
        "--hub_model_id",
        "me/cifar10-resnet18",
    )
    stderr = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stderr(stderr):
        patch.setattr(model_card, "HfApi", OfflineHfApi)
        status = main(load_recipe("cifar10_resnet18"), argv)
    return out, status, stderr.getvalue()


def test_failed_push_says_why_and_keeps_every_output(run_with_baseline_and_failed_push):
    out, status, stderr = run_with_baseline_and_failed_push
    assert status == 1
    assert "could not publish" in stderr and "me/cifar10-resnet18" in stderr
    assert "ConnectionError" in stderr and "Nothing is lost" in stderr and str(out) in stderr
    for file in ("model.safetensors", "results.json", "README.md", "loss.png"):
        assert (out / file).is_file(), file
    assert 'load_trained("me/cifar10-resnet18")' in (out / "README.md").read_text()


def test_baseline_trains_adamw_and_is_compared(run_with_baseline_and_failed_push):
    out, _, _ = run_with_baseline_and_failed_push
    baseline = json.loads((out / "baseline" / "results.json").read_text())
    assert (out / "baseline" / "model.safetensors").is_file()
    assert baseline["settings"]["optim"] == "adamw_torch_fused"
    assert baseline["settings"]["learning_rate"] == 3e-3
    assert baseline["settings"]["weight_decay"] == 0.05

    results = json.loads((out / "results.json").read_text())
    assert results["settings"]["optim"] == "adafisher"
    assert results["baseline"]["optim"] == "adamw_torch_fused"
    assert results["baseline"]["same_run"] is True
    assert results["baseline"]["eval_accuracy"] == baseline["eval_accuracy"]
    assert results["comparison"]["throughput_ratio"] == pytest.approx(
        results["samples_per_second"] / baseline["samples_per_second"]
    )
    card = (out / "README.md").read_text()
    assert "## Against the baseline" in card and "same command" in card
    assert f"{100 * baseline['eval_accuracy']:.2f}%" in card


def test_compare_to_uses_a_saved_baseline(run_with_baseline_and_failed_push, hub_folders, tmp_path):
    baseline_dir = run_with_baseline_and_failed_push[0] / "baseline"
    results = run_recipe(
        CIFAR10,
        tiny_run(hub_folders["cifar10_resnet18"], tmp_path, "--compare_to", str(baseline_dir)),
    )
    assert results["baseline"]["same_run"] is False
    assert results["baseline"]["source"] == str(baseline_dir)
    assert "separate run" in (tmp_path / "README.md").read_text()


def test_defaults_are_the_efficiency_settings():
    recipe_args, args = parse_args(CIFAR10, [])
    assert (recipe_args.dataset, recipe_args.model) == ("uoft-cs/cifar10", "resnet18_cifar")
    assert (args.optim, args.learning_rate, args.weight_decay) == ("adafisher", 3e-3, 5e-4)
    assert args.per_device_train_batch_size == 512 and args.num_train_epochs == 30
    assert args.bf16 == torch.cuda.is_available()
    assert args.label_smoothing_factor == 0.1 and args.warmup_steps == 0.3
    assert args.lr_scheduler_type.value == "cosine" and args.eval_strategy.value == "epoch"
    assert args.output_dir == "outputs/cifar10_resnet18"
    assert recipe_args.plot and not recipe_args.baseline


def test_flags_override_the_defaults():
    recipe_args, args = parse_args(
        CIFAR10,
        ["--epochs", "5", "--optim", "adafisherw", "--learning_rate", "1e-2", "--no_plot"],
    )
    assert args.num_train_epochs == 5 and args.optim == "adafisherw"
    assert args.learning_rate == 1e-2 and not recipe_args.plot
    with pytest.raises(ValueError, match="--baseline and --compare_to"):
        parse_args(CIFAR10, ["--baseline", "--compare_to", "elsewhere"])


def test_baseline_arguments_keep_everything_but_the_optimizer(tmp_path):
    _, args = parse_args(CIFAR10, ["--output_dir", str(tmp_path), "--max_steps", "7"])
    baseline = baseline_arguments(args, RecipeArguments(baseline_learning_rate=1e-3))
    assert baseline.optim == "adamw_torch_fused" and baseline.learning_rate == 1e-3
    assert baseline.weight_decay == 0.05 and baseline.max_steps == 7
    assert baseline.output_dir == str(tmp_path / "baseline")


def test_accuracy_and_timing_helpers():
    prediction = EvalPrediction(np.array([0, 1, 2, 2]), np.array([0, 1, 2, 3]))
    assert accuracy(prediction) == {"accuracy": 0.75}
    assert steady_step_time_ms([{"step_time_ms": 500.0}]) == (None, 0)
    assert steady_step_time_ms(
        [{"step_time_ms": 500.0}, {"step_time_ms": 10.0}, {"step_time_ms": 30.0}]
    ) == (20.0, 2)
    ours = {"eval_accuracy": 0.5, "train_runtime_s": 10.0, "samples_per_second": 20.0}
    base = {"eval_accuracy": 0.4, "train_runtime_s": 20.0, "samples_per_second": 10.0}
    assert compare(ours, base) == {
        "accuracy_points": 10.0,
        "train_time_ratio": 0.5,
        "throughput_ratio": 2.0,
        "peak_memory_ratio": None,
    }


def test_tiny_imagenet_model_downsamples_once_before_the_blocks():
    model = create_model("resnet18_tiny", num_classes=200)
    assert model.conv1.stride == (1, 1) and model.maxpool.stride == 2
    assert [info["reduction"] for info in model.feature_info] == [1, 2, 4, 8, 16]
    assert model(torch.zeros(2, 3, 64, 64)).shape == (2, 200)


def test_load_run_needs_results(tmp_path):
    with pytest.raises(FileNotFoundError, match="no run results"):
        load_run(tmp_path)
