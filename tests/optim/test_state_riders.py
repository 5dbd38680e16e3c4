"""The controllers' state rides in the optimizer's state dict, through every checkpoint path:
torch's own, and ``torch.distributed.checkpoint`` (what Accelerate and the Trainer use under
FSDP2), which keeps only ``state`` and ``param_groups``."""

import io
import math

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.utils._pytree import tree_flatten

from hf_triaccel import TriAccelPlugin

KEYS = ("triaccel_precision", "triaccel_steering")


def build(seed: int):
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3)
    )
    plugin = TriAccelPlugin(precision=True, lr_steering=True, signals_every=2, update_every=1)
    optimizer = plugin.build_optimizer(model)
    signals, precision = plugin.build_precision(model, optimizer, fp16=False)
    steering = plugin.build_steering(optimizer, signals)
    return model, optimizer, signals, precision, steering


def train(model, optimizer, steps: int) -> None:
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(32, 8, generator=generator)
        y = torch.randint(0, 3, (32,), generator=generator)
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()


def states(signals, precision, steering):
    return signals.state_dict(), precision.state_dict(), steering.state_dict()


def same(a, b) -> bool:
    """Equal nested states: the same structure, tensors equal in value and dtype, NaN
    (a signal not measured yet) equal to NaN."""
    leaves_a, spec_a = tree_flatten(a)
    leaves_b, spec_b = tree_flatten(b)
    if spec_a != spec_b:
        return False
    return all(
        torch.equal(x, y) and x.dtype == y.dtype
        if torch.is_tensor(x)
        else x == y or (isinstance(x, float) and math.isnan(x) and math.isnan(y))
        for x, y in zip(leaves_a, leaves_b, strict=True)
    )


def test_the_controllers_survive_a_distributed_checkpoint(tmp_path):
    model, optimizer, *controllers = build(0)
    train(model, optimizer, 6)
    assert controllers[0].steps == 6 and controllers[2].scales  # evaluated: state to keep
    saved = get_optimizer_state_dict(model, optimizer)
    assert set(saved) == {"state", "param_groups"}  # what the checkpoint API keeps
    dcp.save({"optimizer": saved}, checkpoint_id=tmp_path)

    model2, optimizer2, *fresh = build(1)
    assert not same(states(*fresh), states(*controllers))
    loaded = {"optimizer": get_optimizer_state_dict(model2, optimizer2)}
    dcp.load(loaded, checkpoint_id=tmp_path)
    set_optimizer_state_dict(model2, optimizer2, loaded["optimizer"])
    assert same(states(*fresh), states(*controllers))
    assert not any(key in group for group in optimizer2.param_groups for key in KEYS)


def test_a_state_dict_with_the_controllers_at_its_top_level_loads():
    model, optimizer, *controllers = build(0)
    train(model, optimizer, 4)
    saved = optimizer.state_dict()
    for key in KEYS:  # where and how hf_triaccel 0.2 kept them: plain dicts at the top
        saved[key] = torch.load(io.BytesIO(saved["param_groups"][0].pop(key)))
    _, optimizer2, *fresh = build(1)
    optimizer2.load_state_dict(saved)
    assert same(states(*fresh), states(*controllers))
