"""TriAccelPlugin and prepare_triaccel with an Accelerator (CPU)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

accelerate = pytest.importorskip("accelerate")

from hf_triaccel.integrations.plugin import (  # noqa: E402
    TriAccelPlugin,
    check_distributed_support,
    prepare_triaccel,
)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"optimizer": "sgd"}, "TriAccelPlugin.optimizer"),
        ({"ema": "x"}, "TriAccelPlugin.ema"),
        ({"impl": "fast"}, "TriAccelPlugin.impl"),
        ({"fp16_fraction": 2.0}, "TriAccelPlugin.fp16_fraction"),
        ({"signals_every": 0}, "TriAccelPlugin.signals_every"),
    ],
)
def test_bad_plugin_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TriAccelPlugin(**kwargs)


def test_prepare_returns_a_training_loop_kit():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(16, 6), torch.randint(0, 3, (16,))),
        batch_size=4,
    )
    accelerator = accelerate.Accelerator(cpu=True)
    run = prepare_triaccel(accelerator, model, TriAccelPlugin(lr=1e-2, update_every=1), data)
    (loader,) = run.others
    before = [p.detach().clone() for p in run.model.parameters()]
    for x, y in loader:
        loss = nn.functional.cross_entropy(run.model(x), y)
        accelerator.backward(loss)
        run.optimizer.step()
        run.optimizer.zero_grad()
    assert run.optimizer.optimizer.fisher_steps == 4
    assert sorted(run.collector.layers) == ["0", "2"]
    for b, p in zip(before, run.model.parameters(), strict=True):
        assert not torch.equal(b, p)


@pytest.mark.parametrize("kind", ["FSDP", "DEEPSPEED"])
def test_sharded_modes_are_refused(kind):
    with pytest.raises(NotImplementedError, match="DDP"):
        check_distributed_support(getattr(accelerate.utils.DistributedType, kind))


def test_prepare_with_adaptive_precision_checkpoints_its_state():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    plugin = TriAccelPlugin(lr=1e-4, update_every=1, precision=True, signals_every=2)
    run = prepare_triaccel(accelerate.Accelerator(cpu=True), model, plugin)
    for _ in range(6):  # decisions need two agreeing evaluations (steps 2 and 4)
        x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
        nn.functional.cross_entropy(run.model(x), y).backward()
        run.optimizer.step()
        run.optimizer.zero_grad()
    assert run.signals.steps == 6 and set(run.precision.decisions) == {"0", "2", "4"}
    state = run.optimizer.state_dict()
    fresh = prepare_triaccel(accelerate.Accelerator(cpu=True), copy.deepcopy(model), plugin)
    fresh.optimizer.load_state_dict(state)
    assert fresh.precision.state_dict() == run.precision.state_dict()
    assert fresh.signals.steps == 6


def test_precision_and_steering_are_off_by_default():
    run = prepare_triaccel(accelerate.Accelerator(cpu=True), nn.Linear(3, 2))
    assert run.precision is None and run.signals is None and run.steering is None


@pytest.mark.parametrize("precision", [False, True])
def test_prepare_with_step_size_steering_checkpoints_its_state(precision):
    """Steering alone builds its own signal tracker; with precision it shares that one."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    plugin = TriAccelPlugin(lr=1e-4, precision=precision, lr_steering=True, signals_every=2)
    run = prepare_triaccel(accelerate.Accelerator(cpu=True), model, plugin)
    assert run.signals is run.steering.tracker
    assert (run.precision is not None) == precision
    for _ in range(3):
        x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
        nn.functional.cross_entropy(run.model(x), y).backward()
        run.optimizer.step()
        run.optimizer.zero_grad()
    assert set(run.steering.scales) == {"0", "2", "4"}
    state = run.optimizer.state_dict()
    fresh = prepare_triaccel(accelerate.Accelerator(cpu=True), copy.deepcopy(model), plugin)
    fresh.optimizer.load_state_dict(state)
    assert fresh.steering.scales == run.steering.scales
    assert fresh.signals.steps == 3
