"""The recipe runner end to end on tiny Hub-layout data (CPU, 2 steps), and its helpers."""

from __future__ import annotations

import contextlib
import io
import json
import time
import warnings
from pathlib import Path

import pytest
import torch
import yaml

pytest.importorskip("timm")
pytest.importorskip("matplotlib")

# the recipes' folder is on the import path (conftest.py)
import recipe_config  # noqa: E402
import recipe_energy  # noqa: E402
import recipe_results  # noqa: E402
import timm  # noqa: E402
import train  # noqa: E402
from huggingface_hub import ModelCard  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from hf_triaccel.integrations import model_card  # noqa: E402
from hf_triaccel.integrations.telemetry import REPORT_NAME  # noqa: E402

from .conftest import write_split  # noqa: E402

CLASSES = {
    "cifar10_resnet18": 10,
    "cifar10_efficientnet_b0": 10,
    "cifar100_resnet18": 100,
    "tiny_imagenet_resnet18": 200,
}


# timm's own small test network: the runner's behaviour, not the recipes' architectures
SMALL_MODEL = ["--model", "test_resnet"]


def tiny_run(recipe: str, dataset: Path | str, out: Path, *extra: str) -> list[str]:
    """Flags for a 2-step CPU run with batches of 2 (of the small model unless ``extra``
    names another)."""
    model = [] if "--model" in extra else SMALL_MODEL
    return [
        *model,
        "--recipe",
        recipe,
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


def metrics_of(card: str) -> dict[str, float]:
    results = front_matter(card)["model-index"][0]["results"]
    assert len(results) == 1  # one result: every metric of the same run and data set
    return {m["type"]: m["value"] for m in results[0]["metrics"]}


class OfflineHfApi:
    """Stands in for ``huggingface_hub.HfApi`` without network: every call fails."""

    def __init__(self, token=None) -> None:
        pass

    def create_repo(self, *args, **kwargs):
        raise ConnectionError("Failed to resolve 'huggingface.co'")


def test_every_recipe_config_is_tested():
    assert sorted(CLASSES) == recipe_config.available()


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_recipe_trains_and_writes_model_reports_plots_and_card(name, hub_folders, tmp_path):
    out = tmp_path / name
    model = recipe_config.RecipeConfig.load(name).model  # the recipe's own architecture
    argv = tiny_run(name, hub_folders[name], out, "--model", model)
    argv[argv.index("--max_steps") + 1] = "1"  # a full-size model: one step is enough here
    results = train.run_recipe(argv)

    for file in ("model.safetensors", "config.json", REPORT_NAME, "history.json"):
        assert (out / file).is_file(), file
    for file in ("results.json", "loss.png", "accuracy.png", "README.md"):
        assert (out / file).is_file(), file
    assert not (out / "baseline").exists()
    assert json.loads((out / "results.json").read_text()) == results
    assert results["optimizer_steps"] == 1 and results["num_classes"] == CLASSES[name]
    assert results["settings"]["optim"] == "adafisher"
    assert results["settings"]["label_smoothing"] == 0.1
    assert results["settings"]["precision"] == "static fp32"
    assert results["baseline"] is None and results["co2"] is None  # no GPU power reading
    assert 0.0 <= results["eval_accuracy"] <= 1.0
    assert results["steady_step_time_ms"] > 0 and results["steady_samples_per_second"] > 0
    assert set(results["plots"]) == {"loss", "accuracy"}  # no GPU memory figures on a CPU

    card = (out / "README.md").read_text()
    assert metrics_of(card)["accuracy"] == round(results["eval_accuracy"], 4)
    assert f"{100 * results['eval_accuracy']:.2f}%" in card
    assert results["model"] in card and "not estimated: no GPU power reading" in card
    assert "co2_eq_emissions" not in front_matter(card)

    # timm alone loads the output folder back, with the trained weights and the training
    # normalisation (the recipes' architectures are registered by the package)
    model = timm.create_model(f"local-dir:{out}", pretrained=True).eval()
    saved = load_file(out / "model.safetensors")
    assert all(torch.equal(value, saved[key]) for key, value in model.state_dict().items())
    assert model.pretrained_cfg["mean"] == pytest.approx(results["normalisation"]["mean"])
    assert len(model.pretrained_cfg["label_names"]) == CLASSES[name]
    assert model(torch.zeros(1, 3, *results["image_size"])).shape == (1, CLASSES[name])


def test_time_figures_agree_across_report_results_and_card(hub_folders, tmp_path):
    results = train.run_recipe(
        tiny_run("cifar10_resnet18", hub_folders["cifar10_resnet18"], tmp_path)
    )
    report = json.loads((tmp_path / REPORT_NAME).read_text())
    for key in ("train_runtime_s", "step_time_ms", "samples_per_second", "optimizer_steps"):
        assert results[key] == report[key], key
    card = (tmp_path / "README.md").read_text()
    metrics = metrics_of(card)
    assert metrics["training_time_s"] == results["train_runtime_s"]
    assert metrics["training_samples_per_second"] == results["steady_samples_per_second"]
    assert f"{results['train_runtime_s']:.1f} s" in card
    assert f"{results['step_time_ms']:.2f} ms (training time / optimizer steps, " in card
    # 2 logging windows: no median, the whole run less its evaluations, which the card says
    assert results["timing_windows"] == 0 and "too few logging windows" in card
    assert set(results["definitions"]) >= {"train_runtime_s", "step_time_ms", "energy_kwh"}
    # every metric of model-index is one the Hub's parser reads back
    parsed = ModelCard(card).data.eval_results
    assert {r.metric_type: r.metric_value for r in parsed} == metrics


def test_history_places_evaluations_at_their_step(hub_folders, tmp_path):
    argv = tiny_run("cifar10_resnet18", hub_folders["cifar10_resnet18"], tmp_path)
    argv[argv.index("--max_steps") + 1] = "4"
    train.run_recipe([*argv, "--eval_strategy", "steps", "--eval_steps", "2"])
    history = json.loads((tmp_path / "history.json").read_text())
    assert [e["step"] for e in history if "eval_accuracy" in e] == [2, 4]
    assert [e["step"] for e in history if "loss" in e] == [1, 2, 3, 4]


def test_no_evaluation_with_eval_strategy_no(hub_folders, tmp_path):
    argv = tiny_run("cifar10_resnet18", hub_folders["cifar10_resnet18"], tmp_path)
    results = train.run_recipe([*argv, "--eval_strategy", "no"])
    history = json.loads((tmp_path / "history.json").read_text())
    assert not any(key.startswith("eval_") for entry in history for key in entry)
    assert results["eval_accuracy"] is None and results["eval_samples"] is None
    card = (tmp_path / "README.md").read_text()
    assert "not evaluated" in card and "accuracy" not in metrics_of(card)
    assert ModelCard(card).data.eval_results  # the efficiency metrics are still there


@pytest.fixture(scope="module")
def run_with_baseline_and_failed_push(hub_folders, tmp_path_factory):
    """The CIFAR-10 recipe with --baseline and --push_to_hub while the Hub is unreachable."""
    out = tmp_path_factory.mktemp("runs") / "cifar10"
    argv = tiny_run(
        "cifar10_resnet18",
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
        status = train.main(argv)
    return out, status, stderr.getvalue()


def test_failed_push_says_why_and_keeps_every_output(run_with_baseline_and_failed_push):
    out, status, stderr = run_with_baseline_and_failed_push
    assert status == 1
    assert "could not publish" in stderr and "me/cifar10-resnet18" in stderr
    assert "ConnectionError" in stderr and "Nothing is lost" in stderr and str(out) in stderr
    for file in ("model.safetensors", "results.json", "README.md", "loss.png"):
        assert (out / file).is_file(), file
    card = (out / "README.md").read_text()
    assert 'timm.create_model("hf-hub:me/cifar10-resnet18", pretrained=True)' in card
    assert "import hf_triaccel" in card and "hf_triaccel.recipes" not in card


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
        results["steady_samples_per_second"] / baseline["steady_samples_per_second"]
    )
    card = (out / "README.md").read_text()
    assert "## Against the baseline" in card and "same command" in card
    assert f"{100 * baseline['eval_accuracy']:.2f}%" in card


def test_compare_to_uses_a_saved_baseline(run_with_baseline_and_failed_push, hub_folders, tmp_path):
    baseline_dir = run_with_baseline_and_failed_push[0] / "baseline"
    results = train.run_recipe(
        tiny_run(
            "cifar10_resnet18",
            hub_folders["cifar10_resnet18"],
            tmp_path,
            "--compare_to",
            str(baseline_dir),
        )
    )
    assert results["baseline"]["same_run"] is False
    assert results["baseline"]["source"] == str(baseline_dir)
    assert "separate run" in (tmp_path / "README.md").read_text()


@pytest.mark.parametrize(
    ("recipe", "classes"), [("cifar100_resnet18", 100), ("tiny_imagenet_resnet18", 200)]
)
def test_data_with_other_classes_is_refused(recipe, classes, tmp_path):
    with pytest.raises(ValueError, match=rf"{classes}-class .*has 10 classes \(airplane"):
        train.run_recipe(tiny_run(recipe, "embedded", tmp_path))
    assert not (tmp_path / "model.safetensors").exists()


def test_embedded_slice_is_named_by_its_hub_data_set(tmp_path):
    argv = tiny_run("cifar10_resnet18", "embedded", tmp_path)
    results = train.run_recipe([*argv, "--per_device_eval_batch_size", "500"])
    assert results["dataset_id"] == results["dataset_type"] == "uoft-cs/cifar10"
    assert "slice" in results["dataset_name"] and results["eval_samples"] == 1000
    card = (tmp_path / "README.md").read_text()
    result = front_matter(card)["model-index"][0]["results"][0]
    assert result["dataset"]["type"] == "uoft-cs/cifar10"
    assert result["metrics"][0]["name"] == "Accuracy (1000 test images)"


def test_local_folder_is_named_by_itself_or_by_the_hub_copy_it_is(hub_folders, tmp_path):
    folder = hub_folders["cifar10_resnet18"]
    own = train.run_recipe(tiny_run("cifar10_resnet18", folder, tmp_path / "a"))
    assert own["dataset_id"] is None and own["dataset_type"] == folder.name
    copy = train.run_recipe(
        tiny_run("cifar10_resnet18", folder, tmp_path / "b", "--hub_dataset_id", "uoft-cs/cifar10")
    )
    assert copy["dataset_id"] == copy["dataset_type"] == "uoft-cs/cifar10"
    assert front_matter((tmp_path / "b" / "README.md").read_text())["datasets"] == [
        "uoft-cs/cifar10"
    ]


def test_adaptive_precision_is_reported_with_its_counts(hub_folders, tmp_path):
    argv = tiny_run("cifar10_resnet18", hub_folders["cifar10_resnet18"], tmp_path)
    results = train.run_recipe([*argv, "--triaccel_precision", "true"])
    report = json.loads((tmp_path / REPORT_NAME).read_text())
    precision = results["settings"]["precision"]
    assert precision.startswith("adaptive per module: ")
    for kind in ("fp32", "bf16", "fp16"):
        assert f"{report[f'precision_{kind}']} {'modules ' if kind == 'fp32' else ''}{kind}" in (
            precision
        )
    assert precision in (tmp_path / "README.md").read_text()


def test_columns_can_be_named_on_the_command_line(tmp_path):
    folder = tmp_path / "data"
    for split in ("train", "test"):
        write_split(folder / f"{split}.parquet", 8, 32, 10, "picture", ("target",))
    argv = tiny_run("cifar10_resnet18", folder, tmp_path / "out")
    with pytest.raises(ValueError, match="--image_column"):
        train.run_recipe(argv)
    results = train.run_recipe([*argv, "--image_column", "picture", "--label_column", "target"])
    assert results["num_classes"] == 10


@pytest.mark.parametrize("dataset", ["cifar10_local", "data/cifar10/extra"])
def test_a_dataset_that_is_neither_a_path_nor_a_hub_id_fails_at_once(dataset, tmp_path):
    with pytest.raises(ValueError, match=r"--dataset .*no such file or folder.*owner/name"):
        recipe_config.parse_args(["--recipe", "cifar10_resnet18", "--dataset", dataset])


def test_unknown_recipe_lists_the_recipes():
    with pytest.raises(ValueError, match=r"no such recipe; choose one of \[.*cifar100_resnet18"):
        recipe_config.parse_args(["--recipe", "cifar1000"])


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--fp16", "true"], "--fp16 on a CPU"),
        (["--elastic_batch", "true"], "without a GPU"),
        (["--auto_find_batch_size", "true"], "without a GPU"),
    ],
)
def test_settings_that_do_nothing_on_a_cpu_warn_once(flags, message):
    argv = ["--recipe", "cifar10_resnet18", "--dataset", "embedded", "--use_cpu", *flags]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        recipe_config.parse_args(argv)
    assert len([w for w in caught if message in str(w.message)]) == 1


def test_defaults_are_the_efficiency_settings():
    config, recipe_args, args = recipe_config.parse_args(["--recipe", "cifar10_resnet18"])
    assert config.num_classes == 10 and config.eval_split == "test"
    assert (recipe_args.dataset, recipe_args.model) == ("uoft-cs/cifar10", "resnet18_cifar")
    assert (args.optim, args.learning_rate, args.weight_decay) == ("adafisher", 3e-3, 5e-4)
    assert args.per_device_train_batch_size == 512 and args.num_train_epochs == 30
    assert args.bf16 == torch.cuda.is_available()
    assert args.label_smoothing_factor == 0.1 and args.warmup_steps == 0.3
    assert args.output_dir == "outputs/cifar10_resnet18"
    assert recipe_args.plot and not recipe_args.baseline


def test_flags_override_the_defaults():
    _, recipe_args, args = recipe_config.parse_args(
        ["--recipe", "cifar10_resnet18", "--epochs", "5", "--optim", "adafisherw", "--no_plot"]
    )
    assert args.num_train_epochs == 5 and args.optim == "adafisherw" and not recipe_args.plot
    with pytest.raises(ValueError, match="--baseline and --compare_to"):
        recipe_config.parse_args(
            ["--recipe", "cifar10_resnet18", "--baseline", "--compare_to", "elsewhere"]
        )


def test_a_config_file_outside_the_folder_is_a_recipe(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("title: Mine\ndataset: me/mine\nnum_classes: 3\nmodel: resnet18_cifar\n")
    config, _, args = recipe_config.parse_args(["--recipe", str(path)])
    assert (config.name, config.num_classes, args.output_dir) == ("mine", 3, "outputs/mine")
    path.write_text("title: Mine\nclasses: 3\n")
    with pytest.raises(ValueError, match=r"unknown fields \['classes'\]"):
        recipe_config.RecipeConfig.load(str(path))


def test_steady_step_time_leaves_out_warm_up_and_evaluations():
    history = [
        {"step": 1, "step_time_ms": 500.0},
        {"step": 2, "step_time_ms": 10.0},
        {"step": 2, "eval_loss": 1.0},
        {"step": 3, "step_time_ms": 90.0},  # its window took in the evaluation
        {"step": 4, "step_time_ms": 30.0},
    ]
    assert recipe_results.steady_windows(history) == [10.0, 30.0]
    report = {"train_runtime_s": 1.0, "optimizer_steps": 4, "step_time_ms": 250.0}
    report["samples_per_second"] = 8.0
    timing = recipe_results.timing_figures(report, history, eval_runtime_s=0.2, batch_size=2)
    assert timing["steady_step_time_ms"] == 20.0 and timing["timing_windows"] == 2
    assert timing["steady_samples_per_second"] == 100.0
    # one window: the whole run less its evaluations, (1.0 - 0.2) s / 4 steps
    single = recipe_results.timing_figures(report, history[:2], eval_runtime_s=0.2, batch_size=2)
    assert single["steady_step_time_ms"] == 200.0 and single["timing_windows"] == 0


def test_load_results_needs_results(tmp_path):
    with pytest.raises(FileNotFoundError, match="no run results"):
        recipe_results.load_results(tmp_path)


def test_energy_integrates_the_power_readings_over_training(monkeypatch):
    watts = iter([100.0, 300.0, 200.0] + [200.0] * 1000)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "power_draw", lambda device=None: 1e3 * next(watts))
    meter = recipe_energy.EnergyMeter(interval_s=0.01)
    begin = time.perf_counter()
    meter.on_train_begin(None, None, None)
    time.sleep(0.1)
    meter.on_train_end(None, None, None)
    end = time.perf_counter()
    samples = meter.samples
    # the availability probe took the first value (100 W): the run reads 300, 200, 200...
    assert meter.readings >= 3 and [w for _, w in samples[:2]] == [300.0, 200.0]
    assert begin <= samples[0][0] and samples[-1][0] <= end
    (t0, _), (t1, _) = samples[:2]
    # trapezoids: (300 + 200) / 2 W over the first interval, then a constant 200 W
    expected = 250.0 * (t1 - t0) + 200.0 * (samples[-1][0] - t1)
    assert meter.joules == pytest.approx(expected, rel=1e-9)


def test_no_power_reading_no_energy(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    meter = recipe_energy.EnergyMeter()
    meter.on_train_begin(None, None, None)
    meter.on_train_end(None, None, None)
    assert meter.joules is None and meter.readings == 0
