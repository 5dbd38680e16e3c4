"""TriAccelPlugin and prepare_triaccel with an Accelerator (CPU)."""

from __future__ import annotations

import copy
from types import SimpleNamespace

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


# -- parallelism modes: FSDP2 and DDP run, the flattening ones are refused ---------------
# Accelerate turns FSDP on only for GPU processes, so its state cannot be launched here: the
# running state is a CPU Accelerator's, given the FSDP plugin a launch with an accelerate
# config's `fsdp_version` would give it, and prepare_triaccel meets a stand-in accelerator
# reporting the mode (it refuses before using anything else of it).
DistributedType = accelerate.utils.DistributedType


def _hooks(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


@pytest.fixture
def fsdp_version(monkeypatch):
    """Sets the FSDP version of the running Accelerator's plugin (``None``: no plugin)."""
    state = accelerate.Accelerator(cpu=True).state

    def set_version(version: int | None) -> None:
        plugin = None
        if version is not None:
            plugin = accelerate.utils.FullyShardedDataParallelPlugin(fsdp_version=version)
        monkeypatch.setattr(state, "fsdp_plugin", plugin, raising=False)

    return set_version


def assert_names_fsdp2(error: pytest.ExceptionInfo, refused: str) -> None:
    message = str(error.value)
    assert f"hf_triaccel does not support {refused}" in message, message
    # the supported path, as the accelerate config and the Trainer's arguments spell it
    for path in ("use FSDP2", "fsdp_version: 2", "fsdp_config={'version': 2}"):
        assert path in message, message


@pytest.mark.parametrize(
    "kind, version, refused",
    [
        ("DEEPSPEED", None, "DeepSpeed"),
        ("FSDP", 1, "FSDP version 1"),
        ("FSDP", None, "FSDP version 1"),  # no plugin: Accelerate's default, FSDP1
    ],
)
def test_flattening_modes_are_refused_naming_fsdp2(kind, version, refused, fsdp_version):
    fsdp_version(version)
    for explicit in (version, None):  # given, or read from the running Accelerator
        with pytest.raises(NotImplementedError) as error:
            check_distributed_support(getattr(DistributedType, kind), fsdp_version=explicit)
        assert_names_fsdp2(error, refused)


@pytest.mark.parametrize("kind, version", [("DEEPSPEED", None), ("FSDP", 1)])
def test_prepare_refuses_before_hooking_the_model(kind, version, fsdp_version):
    fsdp_version(version)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    stand_in = SimpleNamespace(distributed_type=getattr(DistributedType, kind))
    with pytest.raises(NotImplementedError) as error:
        prepare_triaccel(stand_in, model)
    assert_names_fsdp2(error, "DeepSpeed" if kind == "DEEPSPEED" else "FSDP version 1")
    assert _hooks(model) == 0


def test_fsdp2_and_the_unsharded_modes_are_accepted(fsdp_version):
    check_distributed_support(DistributedType.FSDP, fsdp_version=2)
    fsdp_version(2)
    check_distributed_support(DistributedType.FSDP)  # the running Accelerator's version
    fsdp_version(1)
    check_distributed_support(DistributedType.FSDP, fsdp_version=2)  # the one given wins
    for kind in ("NO", "MULTI_CPU", "MULTI_GPU"):
        check_distributed_support(getattr(DistributedType, kind))


@pytest.mark.parametrize("feature", ["precision", "lr_steering"])
def test_signal_features_are_refused_under_fsdp2_before_hooking(feature, fsdp_version):
    fsdp_version(2)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    stand_in = SimpleNamespace(distributed_type=DistributedType.FSDP)
    with pytest.raises(NotImplementedError, match=f"TriAccelPlugin.{feature}=True: .* FSDP2"):
        prepare_triaccel(stand_in, model, TriAccelPlugin(**{feature: True}))
    assert _hooks(model) == 0


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
