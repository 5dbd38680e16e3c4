"""StepSizeSteering: scales from curvature, steps equal to per-module learning rates,
unscaled gradients for the noise sampling, state and removal."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hf_triaccel import AdaFisher, AdaFisherW, SignalTracker
from hf_triaccel.optim.steering import StepSizeSteering
from tests.optim.oracle import rounding_bound


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))


def steered(cls=AdaFisher, every: int = 1000, **kwargs):
    model = mlp()
    optimizer = cls.from_model(model, lr=1e-2, weight_decay=0.0)
    tracker = SignalTracker(optimizer.collector, optimizer, every=every, noise_every=1)
    return model, optimizer, tracker, StepSizeSteering(tracker, optimizer, **kwargs)


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(16, 6, generator=generator)
        y = torch.randint(0, 3, (16,), generator=generator)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()


def test_scales_follow_the_curvature_ratio_within_bounds():
    *_, steering = steered(power=1.0, min_scale=0.25, max_scale=3.0)
    steering.update({"0": 0.5, "2": 2.0, "4": 100.0})
    assert steering.scales == {"0": 3.0, "2": 1.0, "4": 0.25}  # 4.0 and 0.02 clamped
    *_, steering = steered()
    steering.update({"0": 1.0, "2": 4.0, "4": math.nan})
    # the median of the usable curvatures is 2.5; a module without one keeps scale 1
    assert steering.scales == pytest.approx({"0": 2.5**0.5, "2": (2.5 / 4.0) ** 0.5})
    with pytest.raises(KeyError, match="has not"):
        steering.update({"9": 1.0})


@pytest.mark.parametrize("cls", [AdaFisher, AdaFisherW])
def test_steered_steps_equal_per_module_learning_rates(cls):
    model, optimizer, _, steering = steered(cls)
    steering.load_state_dict({"scales": {"0": 0.5, "4": 1.5}})
    reference = mlp()
    groups = [
        {"params": list(reference[0].parameters()), "lr": 0.5e-2},
        {"params": list(reference[2].parameters())},
        {"params": list(reference[4].parameters()), "lr": 1.5e-2},
    ]
    ref_optimizer = cls.from_model(reference, groups, lr=1e-2, weight_decay=0.0)
    train(model, optimizer, 5)
    train(reference, ref_optimizer, 5)
    # lr * scale and the group's lr may differ in their last bit, and float32 steps round:
    # the drift of two trajectories over the 5 steps, relative to the weights
    drift = rounding_bound(torch.float32, 5, 1e-3)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert (p - q).norm() <= drift * q.norm()
    assert not torch.equal(model[0].weight, mlp()[0].weight)


def test_noise_sampling_sees_the_unscaled_gradients():
    model, optimizer, tracker, steering = steered()
    steering.load_state_dict({"scales": {"0": 0.5, "2": 2.0, "4": 0.5}})
    plain = copy.deepcopy(model)
    plain_optimizer = AdaFisher.from_model(plain, lr=0.0, weight_decay=0.0)
    plain_tracker = SignalTracker(plain_optimizer.collector, plain_optimizer, noise_every=1)
    for group in optimizer.param_groups:
        group["lr"] = 0.0  # same weights in both: same gradients
    train(model, optimizer, 3)
    train(plain, plain_optimizer, 3)
    for key, probe in tracker._probes.items():
        torch.testing.assert_close(probe.m1, plain_tracker._probes[key].m1)


def test_evaluations_set_the_scales_and_remove_stops_scaling():
    model, optimizer, tracker, steering = steered(every=2)
    train(model, optimizer, 2)
    curvature = {name: s.curvature for name, s in tracker.signals.items()}
    assert set(steering.scales) == set(curvature) == {"0", "2", "4"}
    assert len(set(steering.scales.values())) > 1  # the layers differ in curvature
    state = steering.state_dict()
    *_, restored = steered()
    restored.load_state_dict(state)
    assert restored.scales == steering.scales
    with pytest.raises(KeyError, match="has not"):
        restored.load_state_dict({"scales": {"x": 1.0}})
    steering.remove()
    assert not optimizer._optimizer_step_pre_hooks.keys() - tracker_hooks(tracker)
    model[0].weight.grad = torch.ones_like(model[0].weight)
    optimizer.param_groups[0]["lr"] = 0.0
    optimizer.step()
    assert torch.equal(model[0].weight.grad, torch.ones_like(model[0].weight))


def tracker_hooks(tracker: SignalTracker) -> set[int]:
    return {h.id for h in tracker._handles}


def test_refuses_other_optimizers_and_unattached_trackers():
    model = mlp()
    optimizer = AdaFisher.from_model(model, lr=1e-3)
    tracker = SignalTracker(optimizer.collector)
    with pytest.raises(ValueError, match="attach the tracker"):
        StepSizeSteering(tracker, optimizer)
    tracker.attach(optimizer)
    with pytest.raises(TypeError, match="AdaFisher"):
        StepSizeSteering(tracker, torch.optim.AdamW(model.parameters()))
    with pytest.raises(ValueError, match="min_scale"):
        StepSizeSteering(tracker, optimizer, min_scale=2.0)
