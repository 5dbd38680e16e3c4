"""The recipe runner end to end on tiny Hub-layout data (CPU, 2 steps), and its helpers."""

from __future__ import annotations

import contextlib
import doctest
import io
import json
import os
import re
import subprocess
import sys
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

from hf_triaccel.data import load_image_dataset  # noqa: E402
from hf_triaccel.integrations import model_card  # noqa: E402
from hf_triaccel.integrations.telemetry import REPORT_NAME  # noqa: E402

from .conftest import RECIPES_DIR, write_split  # noqa: E402

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


def this_checkout() -> dict[str, str]:
    """The environment of a recipe script run as a user runs it, importing the package of
    this checkout (not another installed copy)."""
    return {**os.environ, "PYTHONPATH": str(RECIPES_DIR.parent)}


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


@pytest.mark.parametrize("module", [recipe_config, recipe_energy, recipe_results, train])
def test_docstring_examples(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0


def test_every_recipe_config_is_tested():
    assert sorted(CLASSES) == recipe_config.available()


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_recipe_trains_and_writes_model_reports_plots_and_card(name, hub_folders, tmp_path):
    out = tmp_path / name
    model = recipe_config.RecipeConfig.load(name).model  # the recipe's own architecture
    argv = tiny_run(name, hub_folders[name], out, "--model", model)
    argv[argv.index("--max_steps") + 1] = "1"  # a full-size model: one step is enough here
    autotuning = torch.backends.cudnn.benchmark
    results = train.run_recipe(argv)
    assert torch.backends.cudnn.benchmark == autotuning  # on during the run only
    assert results["settings"]["cudnn_benchmark"] is None  # no cuDNN on a CPU run

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
    assert results["baseline"] is None and results["co2"] is None  # no GPU energy reading
    assert 0.0 <= results["eval_accuracy"] <= 1.0
    assert results["steady_step_time_ms"] > 0 and results["steady_samples_per_second"] > 0
    assert set(results["plots"]) == {"loss", "accuracy"}  # no GPU memory figures on a CPU

    card = (out / "README.md").read_text()
    assert metrics_of(card)["accuracy"] == round(results["eval_accuracy"], 4)
    assert f"{100 * results['eval_accuracy']:.2f}%" in card
    assert results["model"] in card and "not estimated: no GPU energy reading" in card
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
    # not published: the card loads the model from the folder it sits in
    assert f'timm.create_model("local-dir:{out.resolve()}", pretrained=True)' in card
    assert "import hf_triaccel" in card and "hf_triaccel.recipes" not in card


def test_baseline_trains_adamw_and_is_compared(run_with_baseline_and_failed_push):
    out, _, _ = run_with_baseline_and_failed_push
    baseline = json.loads((out / "baseline" / "results.json").read_text())
    assert (out / "baseline" / "model.safetensors").is_file()
    assert baseline["settings"]["optim"] == "adamw_torch_fused"
    assert baseline["settings"]["learning_rate"] == 2.4e-2
    assert baseline["settings"]["weight_decay"] == 0.1

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


def test_embedded_slice_is_named_as_a_slice_of_its_hub_data_set(tmp_path):
    argv = tiny_run("cifar10_resnet18", "embedded", tmp_path)
    results = train.run_recipe([*argv, "--per_device_eval_batch_size", "500"])
    # the results are on the slice's 1,000 test images, not on the Hub data set's split
    assert results["dataset_id"] == "uoft-cs/cifar10" and results["eval_samples"] == 1000
    assert results["dataset_type"] == recipe_results.EMBEDDED_TYPE
    assert "1,000 test images of uoft-cs/cifar10" in results["dataset_name"]
    card = (tmp_path / "README.md").read_text()
    result = front_matter(card)["model-index"][0]["results"][0]
    assert result["dataset"]["type"] == recipe_results.EMBEDDED_TYPE != "uoft-cs/cifar10"
    assert result["dataset"]["name"] == results["dataset_name"]
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


def usage_error(capsys, argv: list[str], recipe: str | None = None) -> str:
    """The one line a command line that cannot work prints, exiting with status 2."""
    with pytest.raises(SystemExit) as exit_info:
        recipe_config.parse_args(argv, recipe=recipe)
    assert exit_info.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and err.endswith("\n") and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize("dataset", ["cifar10_local", "data/cifar10/extra"])
def test_a_dataset_that_is_neither_a_path_nor_a_hub_id_fails_at_once(dataset, capsys):
    error = usage_error(capsys, ["--recipe", "cifar10_resnet18", "--dataset", dataset])
    assert re.search(r"error: --dataset .*no such file or folder.*owner/name", error)


def test_unknown_recipe_lists_the_recipes(capsys):
    error = usage_error(capsys, ["--recipe", "cifar1000"])
    assert re.search(r"no such recipe; choose one of \[.*cifar100_resnet18", error)
    assert "--recipe" in usage_error(capsys, ["--epochs", "3"])


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--adafisher_gamma", "2"], "error: --adafisher_gamma 2.0: needs 0 < gamma < 1"),
        (["--adafisher_gamma", "x"], "--adafisher-gamma: invalid float value: 'x'"),
        (
            ["--optim", "adamw_torch_fuse"],
            "--optim 'adamw_torch_fuse' is not a known optimizer; "
            "did you mean 'adamw_torch_fused'?",
        ),
        (["--adafisher_gama", "0.5"], "--adafisher_gama 0.5; did you mean '--adafisher_gamma'?"),
        (["--triaccel_precision", "--optim", "sgd"], "--triaccel_precision True: needs optim"),
    ],
)
def test_a_flag_that_cannot_work_is_named_in_one_line(flags, message, capsys):
    error = usage_error(capsys, flags, recipe="cifar10_resnet18")
    assert error.startswith(f"{Path(sys.argv[0]).name}: error: ") and message in error
    assert "Traceback" not in error and "TriAccelArguments." not in error


def test_a_recipe_script_exits_with_one_line_for_a_bad_flag():
    script = RECIPES_DIR / "cifar10_resnet18.py"
    done = subprocess.run(
        [sys.executable, str(script), "--adafisher_gamma", "2"],
        capture_output=True,
        text=True,
        env=this_checkout(),
    )
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == "cifar10_resnet18.py: error: --adafisher_gamma 2.0: needs 0 < gamma < 1\n"


@pytest.mark.parametrize("recipe", sorted(CLASSES))
def test_each_recipe_script_helps_with_its_own_defaults(recipe):
    done = subprocess.run(
        [sys.executable, str(RECIPES_DIR / f"{recipe}.py"), "--help"],
        capture_output=True,
        text=True,
        env=this_checkout(),
    )
    assert done.returncode == 0, done.stderr
    config = recipe_config.RecipeConfig.load(recipe)
    help_text = " ".join(done.stdout.split())
    assert (
        f"Train {config.model} on {config.title} with hf_triaccel. The defaults below are this "
        "recipe's: batch 512, 30 epochs, adafisher at learning rate 0.012, weight decay 0.0005."
    ) in help_text
    for flag, default in [
        ("--per_device_train_batch_size", "512"),
        ("--num_train_epochs", "30.0"),
        ("--learning_rate", "0.012"),
        ("--weight_decay", "0.0005"),
        ("--optim", "adafisher"),
        ("--model", config.model),
        ("--output_dir", f"outputs/{recipe}"),
    ]:
        start = help_text.index(f" {flag} ")
        end = help_text.index(" --", help_text.index(")", start))
        assert f"(default: {default})" in help_text[start:end], flag


def test_the_runner_without_a_recipe_says_how_to_see_one(capsys):
    with pytest.raises(SystemExit):
        recipe_config.parse_args(["--help"])
    assert "--recipe NAME --help lists a recipe's defaults" in " ".join(
        capsys.readouterr().out.split()
    )


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
    assert (args.optim, args.learning_rate, args.weight_decay) == ("adafisher", 1.2e-2, 5e-4)
    assert args.per_device_train_batch_size == 512 and args.num_train_epochs == 30
    assert args.bf16 == torch.cuda.is_available()
    assert args.label_smoothing_factor == 0.1 and args.warmup_steps == 0.3
    assert args.output_dir == "outputs/cifar10_resnet18"
    assert recipe_args.plot and not recipe_args.baseline


def test_flags_override_the_defaults(capsys):
    _, recipe_args, args = recipe_config.parse_args(
        ["--recipe", "cifar10_resnet18", "--epochs", "5", "--optim", "adafisherw", "--no_plot"]
    )
    assert args.num_train_epochs == 5 and args.optim == "adafisherw" and not recipe_args.plot
    argv = ["--recipe", "cifar10_resnet18", "--baseline", "--compare_to", "elsewhere"]
    assert "--baseline and --compare_to" in usage_error(capsys, argv)


@pytest.mark.parametrize("recipe", sorted(CLASSES))
def test_quick_form_is_sized_for_a_cpu_and_flags_still_win(recipe):
    config, recipe_args, args = recipe_config.parse_args(["--quick"], recipe=recipe)
    assert recipe_args.quick and (args.per_device_train_batch_size, args.max_steps) == (
        64,
        config.quick_steps,
    )
    assert args.output_dir == f"outputs/{recipe}-quick" and args.optim == "adafisher"
    full = timm.create_model(config.model, num_classes=config.num_classes)
    quick = timm.create_model(
        recipe_args.model,
        num_classes=config.num_classes,
        **recipe_config.model_args(config, recipe_args),
    )
    size = sum(p.numel() for p in quick.parameters())
    assert size < sum(p.numel() for p in full.parameters()) / 10
    _, _, args = recipe_config.parse_args(["--quick", "--max_steps", "7"], recipe=recipe)
    assert args.max_steps == 7 and args.per_device_train_batch_size == 64
    # another model keeps its own shape: the quick form's arguments fit the recipe's model
    _, other, _ = recipe_config.parse_args(["--quick", "--model", "test_resnet"], recipe=recipe)
    assert recipe_config.model_args(config, other) == {}


def test_quick_run_says_its_cost_first_and_saves_a_model_that_loads(tmp_path, caplog):
    argv = ["--quick", "--dataset", "embedded", "--output_dir", str(tmp_path), "--use_cpu"]
    argv += ["--max_steps", "2", "--eval_strategy", "no", "--disable_tqdm", "true", "--no_plot"]
    with caplog.at_level("INFO", logger="recipes"):
        results = train.run_recipe(argv, recipe="cifar10_resnet18")
    plan = caplog.records[0].getMessage()
    assert plan == results["plan"] + "." or plan == results["plan"]
    assert plan.startswith("cifar10_resnet18 --quick: resnet18_cifar (0.32 M parameters), 2 ")
    assert "optimizer steps of 64 images" in plan and "of training" in plan
    assert "--quick trains" not in plan  # the hint is for the full recipe
    assert results["model_args"] == {
        "layers": [1, 1, 1, 1],
        "channels": [16, 32, 64, 128],
        "stem_width": 16,
    }
    loaded = timm.create_model(f"local-dir:{tmp_path}", pretrained=True)
    assert sum(p.numel() for p in loaded.parameters()) == 318186


def test_the_full_recipe_on_a_cpu_points_to_the_quick_form():
    config, recipe_args, args = recipe_config.parse_args(
        ["--use_cpu", "--model", "test_resnet", "--eval_strategy", "no"], recipe="cifar10_resnet18"
    )
    data = load_image_dataset("embedded", "test", progress=False)
    plan = train.announce_plan(
        config,
        recipe_args,
        args,
        train.RecipeData(data, None, {}),
        timm.create_model("test_resnet"),
    )
    # 1,000 images in batches of 512, the short last batch dropped as the Trainer drops it:
    # 1 step an epoch, 30 epochs, 30 x 512 samples = 15.4 passes over the 1,000 images
    assert "30 optimizer steps of 512 images (15.4 epochs of 1,000 images) on cpu" in plan
    assert re.search(r"about [0-9.]+ s here: about [0-9.]+ (s|min|h) of training", plan)
    assert plan.endswith("; --quick trains the form of this recipe sized for a CPU.")


@pytest.mark.parametrize(
    ("argv0", "accelerate", "command"),
    [
        ("recipes/cifar10_resnet18.py", False, "python recipes/cifar10_resnet18.py --quick"),
        (
            "recipes/cifar10_resnet18.py",
            True,
            "accelerate launch recipes/cifar10_resnet18.py --quick",
        ),
        ("recipes/train.py", False, "python recipes/train.py --recipe cifar10_resnet18 --quick"),
    ],
)
def test_the_command_is_recorded_as_typed(argv0, accelerate, command, monkeypatch):
    monkeypatch.chdir(RECIPES_DIR.parent)
    monkeypatch.setattr(sys, "argv", [argv0, "--quick"])
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    if accelerate:
        monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
    assert train.typed_command(["--quick"], "cifar10_resnet18") == command


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


def test_full_determinism_keeps_cudnn_autotuning_off(hub_folders, tmp_path, monkeypatch):
    name = "cifar10_resnet18"
    argv = tiny_run(name, hub_folders[name], tmp_path / "out", "--full_determinism", "true")
    asked, autotuning = [], train.cudnn_autotuning

    def recorded(on: bool):
        asked.append(on)
        return autotuning(on)

    monkeypatch.setattr(train, "cudnn_autotuning", recorded)
    results = train.run_recipe([*argv, "--no_plot"])
    assert asked == [False]
    assert results["settings"]["cudnn_benchmark"] is None  # a CPU run says nothing of cuDNN


class FakeNVML:
    """pynvml's calls the energy meter makes, over one GPU known by ``uuid``, whose
    counter (millijoules) the test moves; ``supported=False``: a GPU without the counter."""

    class NVMLError(Exception):
        pass

    def __init__(self, uuid: str, supported: bool = True) -> None:
        self.uuid, self.supported, self.millijoules = uuid, supported, 5_000_000

    def nvmlInit(self) -> None:
        pass

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:
        if uuid != self.uuid:
            raise self.NVMLError(f"no device {uuid}")
        return uuid

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: str) -> int:
        if not self.supported:
            raise self.NVMLError("not supported")
        return self.millijoules


def fake_gpu(monkeypatch, nvml: FakeNVML, uuid: str) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    properties = type("Properties", (), {"uuid": uuid})()
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: properties)


@pytest.mark.parametrize("prefix", ["GPU-", "MIG-"])
def test_energy_is_the_counter_between_train_begin_and_end(monkeypatch, prefix):
    nvml = FakeNVML(prefix + "0a1b2c3d-0000-1111-2222-333344445555")
    fake_gpu(monkeypatch, nvml, "0a1b2c3d-0000-1111-2222-333344445555")
    meter = recipe_energy.EnergyMeter()
    meter.on_train_begin(None, None, None)
    nvml.millijoules += 1_234_567  # drawn during training
    meter.on_train_end(None, None, None)
    assert meter.joules == pytest.approx(1234.567, rel=1e-12)
    nvml.millijoules += 10_000  # after training: not counted, nor read again
    meter.on_train_end(None, None, None)
    assert meter.joules == pytest.approx(1234.567, rel=1e-12)


@pytest.mark.parametrize("case", ["no cuda", "no counter", "unknown device", "no pynvml"])
def test_no_counter_no_energy(monkeypatch, case):
    uuid = "0a1b2c3d-0000-1111-2222-333344445555"
    fake_gpu(monkeypatch, FakeNVML("GPU-" + uuid, supported=case != "no counter"), uuid)
    if case == "no cuda":
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    if case == "unknown device":
        monkeypatch.setattr(
            torch.cuda, "get_device_properties", lambda d: type("P", (), {"uuid": "ffff"})()
        )
    if case == "no pynvml":
        monkeypatch.setitem(sys.modules, "pynvml", None)  # import raises ModuleNotFoundError
    meter = recipe_energy.EnergyMeter()
    meter.on_train_begin(None, None, None)
    meter.on_train_end(None, None, None)
    assert meter.joules is None


@pytest.mark.gpu
def test_energy_counter_reads_a_training_gpu():
    pytest.importorskip("pynvml")
    meter = recipe_energy.EnergyMeter()
    meter.on_train_begin(None, None, None)
    x = torch.randn(4096, 4096, device="cuda")
    for _ in range(200):  # some joules of work
        x = torch.tanh(x @ x)
    torch.cuda.synchronize()
    meter.on_train_end(None, None, None)
    assert meter.joules is not None and meter.joules > 0
