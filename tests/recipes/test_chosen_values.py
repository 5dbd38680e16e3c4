"""What the package ships equals what the committed accuracy grid chose: the chosen values
regenerate from the JSON lines, and the optimizer's defaults, the recipes' settings, the
quickstart's GPU plan and the benchmarks' defaults are those values."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import recipe_config
from torch import nn

from benchmarks import harness
from benchmarks.__main__ import main
from hf_triaccel import FisherCollector, quickstart
from hf_triaccel.optim.config import AdaFisherConfig

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
RESULTS = BENCHMARKS / "results"


@pytest.fixture(scope="module")
def chosen() -> dict:
    return json.loads((RESULTS / "chosen.json").read_text())


def test_the_chosen_values_regenerate_from_the_committed_runs(tmp_path, chosen):
    out = tmp_path / "chosen.json"
    runs, times = RESULTS / "equal_epochs.jsonl", RESULTS / "epoch_seconds.jsonl"
    command = ["time-to-accuracy", "--summarise", str(runs), "--times", str(times)]
    assert main([*command, "--chosen", str(out)]) == 0
    assert json.loads(out.read_text()) == chosen


def test_the_optimizer_defaults_are_the_chosen_ones(chosen):
    config = AdaFisherConfig()
    shipped = chosen["adafisher"]
    assert (config.ema, config.normalise) == (shipped["ema"], shipped["normalise"])
    assert config.factor_init == shipped["factor_init"]
    # a collector built alone seeds its factors as the optimizer's default says
    assert FisherCollector(nn.Linear(2, 2)).factor_init == shipped["factor_init"]
    assert config.resolved_update_every == shipped["update_every"]
    assert (config.damping, config.lr) == (shipped["damping"], shipped["lr"])


@pytest.mark.parametrize("recipe", ["cifar10_resnet18", "cifar100_resnet18"])
def test_the_recipes_train_with_the_chosen_settings(chosen, recipe):
    expected = chosen["recipes"][recipe]
    defaults = recipe_config.recipe_defaults(recipe_config.RecipeConfig.load(recipe))
    assert {k: defaults[k] for k in ("optim", "learning_rate", "weight_decay")} == {
        k: expected[k] for k in ("optim", "learning_rate", "weight_decay")
    }
    arguments = recipe_config.RecipeArguments(recipe=recipe, baseline=True)
    assert arguments.baseline_learning_rate == expected["baseline_learning_rate"]
    assert arguments.baseline_weight_decay == expected["baseline_weight_decay"]


def test_the_quickstart_gpu_plan_and_the_benchmarks_use_the_chosen_values(chosen):
    arms = chosen["arms"]["cifar10"]
    plan = quickstart.GPU_PLAN
    comparison = {"model": "resnet18_cifar", "epochs": plan.epochs, "batch_size": plan.batch_size}
    assert comparison == chosen["comparison"]
    for arm, optimizer in ((chosen["rule"], "adafisher"), ("adamw", "adamw"), ("sgd", "sgd")):
        values = (arms[arm]["lr"], arms[arm]["weight_decay"])
        assert harness.HYPERPARAMETERS[optimizer] == values
        if optimizer in plan.hyperparameters:
            assert plan.hyperparameters[optimizer] == values
    assert harness.HYPERPARAMETERS["sgd_ema"] == (
        arms["curvature_off"]["lr"],
        arms["curvature_off"]["weight_decay"],
    )
