"""checkpoint_largest_blocks: same gradients and BatchNorm statistics, fewer saved
activations, removable."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hf_triaccel.memory.checkpointing import (
    checkpoint_largest_blocks,
    enable_activation_checkpointing,
    find_blocks,
)


class Block(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, hidden)
        self.norm = nn.BatchNorm1d(hidden)
        self.drop = nn.Dropout(0.3)
        self.down = nn.Linear(hidden, width)

    def forward(self, x):
        return x + self.down(self.drop(torch.relu(self.norm(self.up(x)))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Linear(5, 8)
        self.blocks = nn.ModuleList([Block(8, h) for h in (16, 64, 32)])
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def saved_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes autograd keeps for the backward of one forward."""
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x).sum()
    return total


def test_blocks_are_the_repeated_units():
    assert [n for n, _ in find_blocks(Net())] == ["blocks.0", "blocks.1", "blocks.2"]

    class Plain(nn.Module):  # no container: the root's children
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

    assert [n for n, _ in find_blocks(Plain())] == ["a", "b"]


def test_largest_first_and_removable():
    model = Net()
    handle = checkpoint_largest_blocks(model, 2)
    assert handle.names == ["blocks.1", "blocks.2"]  # 64 and 32 hidden units
    assert "forward" in model.blocks[1].__dict__ and "forward" not in model.blocks[0].__dict__
    again = checkpoint_largest_blocks(model)  # already wrapped blocks are skipped
    assert again.names == ["blocks.0"]
    again.remove()
    handle.remove()
    handle.remove()
    assert all("forward" not in b.__dict__ for b in model.blocks)


def test_nested_blocks_are_skipped():
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), nn.Linear(4, 2))
    model.add_module("wrapped", nn.Sequential(Net()))
    names = checkpoint_largest_blocks(model).names
    assert "wrapped.0" in names and not any(n.startswith("wrapped.0.") for n in names)


def test_same_gradients_statistics_and_dropout():
    x = torch.randn(32, 5, dtype=torch.float64)
    y = torch.randint(0, 3, (32,))
    plain = Net().double().train()
    ckpt = copy.deepcopy(plain)
    handle = checkpoint_largest_blocks(ckpt)
    assert len(handle) == 3
    for model in (plain, ckpt):
        torch.manual_seed(7)  # the same dropout masks, replayed in the recompute
        F.cross_entropy(model(x), y).backward()
    for (name, p), q in zip(plain.named_parameters(), ckpt.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-12, atol=1e-12, msg=name)
    for (name, b), c in zip(plain.named_buffers(), ckpt.buffers(), strict=True):
        torch.testing.assert_close(c, b, rtol=0, atol=0, msg=name)  # updated once, not twice


def test_statistics_kept_after_the_model_moves():
    """model.double() after wrapping replaces the BatchNorm buffers: the recompute still
    restores the live ones."""
    x = torch.randn(32, 5, dtype=torch.float64)
    plain = Net().train()
    ckpt = copy.deepcopy(plain)
    checkpoint_largest_blocks(ckpt)
    for model in (plain.double(), ckpt.double()):
        torch.manual_seed(7)  # the same dropout masks
        model(x).sum().backward()
    for (name, b), c in zip(plain.named_buffers(), ckpt.buffers(), strict=True):
        torch.testing.assert_close(c, b, rtol=0, atol=0, msg=name)


def test_saves_activation_memory():
    x = torch.randn(256, 5)
    model = Net().train()
    before = saved_bytes(model, x)
    with checkpoint_largest_blocks(model):
        during = saved_bytes(model, x)
    assert during < before / 2
    assert saved_bytes(model, x) == before


def test_eval_and_no_grad_run_the_plain_forward(monkeypatch):
    import hf_triaccel.memory.checkpointing as ckpt_module

    calls = []
    real = ckpt_module.checkpoint
    monkeypatch.setattr(
        ckpt_module, "checkpoint", lambda *a, **kw: calls.append(1) or real(*a, **kw)
    )
    model = Net()
    checkpoint_largest_blocks(model, 1)
    x = torch.randn(4, 5)
    model.eval()
    model(x)
    model.train()
    with torch.no_grad():
        model(x)
    assert calls == []
    model(x)
    assert calls == [1]


def test_keeps_an_existing_instance_forward():
    block = Net().blocks[0]
    original = block.forward
    block.forward = lambda x: original(x) * 2  # e.g. a hook framework's wrapper
    outer = block.forward
    model = nn.ModuleList([block])
    handle = checkpoint_largest_blocks(model)
    assert block.forward is not outer
    handle.remove()
    assert block.forward is outer


def test_invalid_count():
    with pytest.raises(ValueError):
        checkpoint_largest_blocks(Net(), 0)


# -- the model's own switch first ----------------------------------------------------------


class OwnSwitch(Net):
    """A model with timm's switch; ``refuse``: it asserts, as some timm models do."""

    def __init__(self, refuse: bool = False) -> None:
        super().__init__()
        self.grad_checkpointing = False
        self.refuse = refuse

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        assert not (enable and self.refuse), "gradient checkpointing not supported"
        self.grad_checkpointing = enable


def test_the_model_own_switch_comes_first():
    model = OwnSwitch()
    handle = enable_activation_checkpointing(model, 1)
    assert handle.method == "set_grad_checkpointing" and model.grad_checkpointing
    assert handle.switched_on
    assert handle.names == [] and all("forward" not in b.__dict__ for b in model.blocks)
    handle.remove()
    assert not model.grad_checkpointing


def test_a_switch_already_on_is_left_on():
    model = OwnSwitch()
    model.set_grad_checkpointing()
    handle = enable_activation_checkpointing(model)
    assert not handle.switched_on  # nothing done here: the caller knows it was on
    handle.remove()
    assert model.grad_checkpointing


def test_a_refusing_switch_falls_back_to_the_blocks():
    model = OwnSwitch(refuse=True)
    handle = enable_activation_checkpointing(model, 2)
    assert handle.method == "blocks" and handle.names == ["blocks.1", "blocks.2"]
    assert handle.switched_on
    assert not model.grad_checkpointing
    handle.remove()
    assert all("forward" not in b.__dict__ for b in model.blocks)


def test_timm_and_transformers_models_use_their_own():
    timm = pytest.importorskip("timm")
    transformers = pytest.importorskip("transformers")
    resnet = timm.create_model("resnet10t", num_classes=3)
    assert enable_activation_checkpointing(resnet).method == "set_grad_checkpointing"
    assert resnet.grad_checkpointing
    config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=32)
    gpt2 = transformers.GPT2LMHeadModel(config)
    handle = enable_activation_checkpointing(gpt2)
    assert handle.method.endswith("checkpointing_enable") and handle.names == []
    on = getattr(type(gpt2), "is_activation_checkpointing", None)  # transformers 5 name
    state = "is_activation_checkpointing" if on is not None else "is_gradient_checkpointing"
    assert getattr(gpt2, state)
    handle.remove()
    assert not getattr(gpt2, state)
