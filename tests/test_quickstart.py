"""The quickstart: flags and a two-step run on the CPU."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hf_triaccel.optim.adafisher import AdaFisher, AdaFisherW
from hf_triaccel.quickstart import (
    CPU_DEFAULT_STEPS,
    DEFAULT_HYPERPARAMETERS,
    build_optimizer,
    build_precision,
    main,
    parse_args,
    precision_autocast,
)


def test_cpu_defaults():
    args = parse_args(["--device", "cpu"])
    assert args.optimizer == "adafisherw"
    assert (args.lr, args.weight_decay) == DEFAULT_HYPERPARAMETERS["adafisherw"]
    assert args.max_steps == CPU_DEFAULT_STEPS
    assert args.epochs == 2 and args.batch_size == 128
    assert args.bf16 is False
    adamw = parse_args(["--device", "cpu", "--optimizer", "adamw", "--lr", "0.01"])
    assert adamw.lr == 0.01 and adamw.weight_decay == 5e-2


@pytest.mark.parametrize(
    ("name", "cls"),
    [("adafisherw", AdaFisherW), ("adafisher", AdaFisher), ("adamw", torch.optim.AdamW)],
)
def test_build_optimizer(name, cls):
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    optimizer = build_optimizer(name, model, lr=1e-3, weight_decay=0.0)
    assert type(optimizer) is cls
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    with pytest.raises(ValueError, match="unknown optimizer"):
        build_optimizer("sgd", model, lr=1e-3, weight_decay=0.0)


@pytest.mark.parametrize(
    ("precision", "autocast"), [("bf16", True), ("fp32", False), ("adaptive", True)]
)
def test_precision_autocast(precision, autocast):
    with precision_autocast(torch.device("cpu"), precision):
        assert torch.is_autocast_enabled("cpu") is autocast
        assert not autocast or torch.get_autocast_dtype("cpu") == torch.bfloat16
    with pytest.raises(ValueError, match="unknown precision"):
        precision_autocast(torch.device("cpu"), "fp16")


def test_build_precision_only_for_adaptive_and_adafisher():
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2))
    adafisher = build_optimizer("adafisherw", model, lr=1e-3, weight_decay=0.0)
    assert build_precision("bf16", model, adafisher) is None
    assert build_precision("fp32", model, adafisher) is None
    signals, controller = build_precision("adaptive", model, adafisher, signals_every=7)
    assert signals.every == 7 and controller.tracker is signals
    assert controller.decisions == {"1": "fp32"}
    assert controller.policy.fp16_fraction == 0.0
    controller.remove()
    signals.remove()
    adamw = build_optimizer("adamw", model, lr=1e-3, weight_decay=0.0)
    with pytest.raises(ValueError, match="needs optimizer adafisher or adafisherw"):
        build_precision("adaptive", model, adamw)


def test_two_steps_report_a_test_accuracy(capsys):
    results = main(["--max_steps", "2", "--batch_size", "8", "--device", "cpu"])
    out = capsys.readouterr().out
    assert "epoch 1: train loss" in out
    assert "test accuracy:" in out and "(1000 images)" in out
    assert "total time:" in out
    assert results["steps"] == 2
    assert 0.0 <= results["test_accuracy"] <= 1.0
    assert torch.isfinite(torch.tensor(results["epochs"][0]["train_loss"]))
