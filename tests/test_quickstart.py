"""The quickstart: AdaFisher beside AdamW, its flags, and a short comparison on the CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from hf_triaccel import quickstart
from hf_triaccel.data.images import GPUBatchLoader, ImageTensors
from hf_triaccel.optim.adafisher import AdaFisher, AdaFisherW
from hf_triaccel.optim.config import AdaFisherConfig
from hf_triaccel.quickstart import (
    CPU_MODEL_ARGS,
    CPU_PLAN,
    GPU_PLAN,
    autocast,
    build_optimizer,
    main,
    parse_args,
    train_loop,
)


def test_cpu_defaults_compare_adafisher_and_adamw_on_a_small_model():
    args = parse_args(["--device", "cpu"])
    assert args.optimizers == ["adafisher", "adamw"]
    assert args.plan == CPU_PLAN and CPU_PLAN.max_steps == 100 and CPU_PLAN.batch_size == 64
    assert args.model_args == CPU_MODEL_ARGS and args.bf16 is False


def test_gpu_defaults_train_the_recipe_model_for_epochs():
    args = parse_args(["--device", "cuda"])
    assert args.plan == GPU_PLAN and GPU_PLAN.max_steps is None and GPU_PLAN.epochs >= 5
    assert args.model_args == {} and args.bf16 is True


def test_flags_override_the_plan():
    args = parse_args(["--device", "cpu", "--epochs", "3", "--batch_size", "32"])
    assert (args.plan.epochs, args.plan.batch_size, args.plan.max_steps) == (3, 32, None)
    args = parse_args(["--device", "cpu", "--optimizers", "adafisher", "--data", "./x"])
    assert args.optimizers == ["adafisher"] and args.dataset == "./x"
    with pytest.raises(SystemExit):
        parse_args(["--optimizers", "adafisherw,sgd"])


@pytest.mark.parametrize(
    ("name", "cls"),
    [("adafisherw", AdaFisherW), ("adafisher", AdaFisher), ("adamw", torch.optim.AdamW)],
)
def test_build_optimizer(name, cls):
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    lr, weight_decay = CPU_PLAN.hyperparameters[name]
    optimizer = build_optimizer(name, model, lr=lr, weight_decay=weight_decay)
    assert type(optimizer) is cls
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    with pytest.raises(ValueError, match="unknown optimizer"):
        build_optimizer("sgd", model, lr=1e-3, weight_decay=0.0)


@pytest.mark.parametrize("bf16", [True, False])
def test_autocast(bf16):
    with autocast(torch.device("cpu"), bf16):
        assert torch.is_autocast_enabled("cpu") is bf16


def test_both_optimizers_train_the_same_model_and_batches_side_by_side(capsys, monkeypatch):
    initial, plans = [], []
    real_create, real_loop = quickstart.create_cifar_model, quickstart.train_loop

    def create(*args, **kwargs):
        model = real_create(*args, **kwargs)
        initial.append({k: v.clone() for k, v in model.state_dict().items()})
        return model

    def loop(model, optimizer, loader, **kwargs):
        plans.append(loader.epoch_plan(0))
        return real_loop(model, optimizer, loader, **kwargs)

    monkeypatch.setattr(quickstart, "create_cifar_model", create)
    monkeypatch.setattr(quickstart, "train_loop", loop)
    results = main(["--max_steps", "2", "--batch_size", "8", "--device", "cpu"])
    out = capsys.readouterr().out
    runs = results["runs"]
    assert [run["optimizer"] for run in runs] == ["adafisher", "adamw"]
    assert [run["steps"] for run in runs] == [2, 2]
    assert [run["learning_rate"] for run in runs] == [
        CPU_PLAN.hyperparameters[name][0] for name in ("adafisher", "adamw")
    ]
    for run in runs:
        assert 0.0 <= run["test_accuracy"] <= 1.0 and run["train_seconds"] > 0
        assert f"{100 * run['test_accuracy']:.2f}%" in out
        assert torch.isfinite(torch.tensor(run["epochs"][0]["train_loss"]))
    assert runs[0]["parameters"] == runs[1]["parameters"] < 1_000_000
    # the same initial weights, sample order and augmentation for both optimizers
    assert all(torch.equal(initial[0][k], initial[1][k]) for k in initial[0])
    for field in ("order", "offsets", "flips"):
        assert torch.equal(getattr(plans[0], field), getattr(plans[1], field))
    assert "optimizer" in out and "test accuracy" in out and "accuracy on 1000 test images" in out
    assert results["train_seconds"] == pytest.approx(sum(r["train_seconds"] for r in runs))


def test_a_dataset_that_is_not_there_fails_before_training(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="no such file or folder: 'cifar10_local'"):
        main(["--dataset", "cifar10_local", "--device", "cpu"])


def test_the_cpu_plan_takes_the_best_of_its_grid_inside_it():
    """Each compared optimizer's CPU learning rate is the most accurate of the committed
    grid (docs/benchmarks_history.md, "The main job's CPU learning rates") at the plan's
    steps and weight decay, and AdaFisher's at the default factor seed (runs recorded
    without one started from ones), with a less accurate learning rate measured on both
    sides."""
    path = Path(__file__).resolve().parents[1] / "benchmarks/results/quickstart_cpu.jsonl"
    runs = [json.loads(line) for line in path.read_text().splitlines()]

    def seed(optimizer: str, record: dict) -> str | None:
        return record.get("factor_init", "ones") if optimizer.startswith("adafisher") else None

    for name in quickstart.COMPARED:
        lr, weight_decay = CPU_PLAN.hyperparameters[name]
        default = AdaFisherConfig().factor_init if name.startswith("adafisher") else None
        grid = {
            r["learning_rate"]: r["test_accuracy"]
            for r in runs
            if (r["optimizer"], r["steps"], r["weight_decay"], seed(r["optimizer"], r))
            == (name, CPU_PLAN.max_steps, weight_decay, default)
        }
        lrs = sorted(grid)
        assert max(grid, key=grid.get) == lr
        assert 0 < lrs.index(lr) < len(lrs) - 1


@pytest.mark.parametrize("clipped", [False, True])
def test_train_loop_clips_the_global_gradient_norm(clipped):
    """Plain SGD moves the parameters by lr_t x the clipped gradient each step, so with
    clipping the whole move is at most the sum of the schedule's rates x the norm bound
    (float32 roundoff aside); without it the same run moves far more."""
    gen = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (32, 3, 8, 8), generator=gen, dtype=torch.uint8)
    data = ImageTensors(images, torch.randint(0, 4, (32,), generator=gen), list("abcd"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 4))
    start = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    steps, lr, norm = 8, 0.1, 1e-3
    train_loop(
        model,
        torch.optim.SGD(model.parameters(), lr=lr),
        GPUBatchLoader(data, 8, shuffle=True),
        total_steps=steps,
        lr=lr,
        bf16=False,
        max_grad_norm=norm if clipped else None,
        log=lambda line: None,
        progress=False,
    )
    moved = (torch.cat([p.detach().flatten() for p in model.parameters()]) - start).norm()
    bound = steps * lr * norm * (1 + 1e-5)  # every rate of the one-cycle schedule <= lr
    assert (moved <= bound) if clipped else (moved > 10 * bound)
