"""Activation checkpointing recomputes forwards in the backward: the Fisher statistics see
each sample's forward once, whichever checkpointing runs (hf_triaccel's own fallback,
transformers' ``gradient_checkpointing``, timm's ``set_grad_checkpointing``, torch's
``checkpoint_wrapper`` as FSDP2 recipes apply it, and a reentrant checkpoint).

Each test trains a model with checkpointing and its copy without, one refresh step on the
same batch, and compares every layer's gathered statistics. A recompute that took its own
statistic would need a second slot (the original forward's waits for its gradient until
after the recompute) and compute the statistic a second time: each layer keeps one slot.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from hf_triaccel.curvature.collection.hooks import in_checkpoint_recompute
from hf_triaccel.curvature.collector import FisherCollector
from hf_triaccel.memory import checkpoint_largest_blocks, enable_activation_checkpointing


def statistics(model: nn.Module, loss_of) -> tuple[FisherCollector, dict]:
    """One forward and backward with a fresh collector: each layer's (a, g) sums and
    counts, and how many activation slots it used."""
    collector = FisherCollector(model, impl="reference")
    loss_of(model).backward()
    out = {
        name: (*layer.statistics(), layer.a_count, layer.g_count, len(layer.slots))
        for name, layer in collector.layers.items()
    }
    collector.detach()
    return collector, out


def assert_counted_once(checkpointed: dict, plain: dict) -> None:
    """Keys may differ by the wrapper's name; layers come in the same order."""
    assert len(checkpointed) == len(plain)
    for (name, got), want in zip(checkpointed.items(), plain.values(), strict=True):
        a, g, a_count, g_count, slots = got
        assert (a_count, g_count, slots) == (1, 1, 1), name
        # the same operations on the same values, recomputed or not
        torch.testing.assert_close(a, want[0], rtol=1e-6, atol=0.0, msg=name)
        torch.testing.assert_close(g, want[1], rtol=1e-6, atol=0.0, msg=name)


class Block(nn.Module):
    """A residual-free block of two layers, as a transformer layer holds its sublayers."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d_in, d_out)
        self.norm = nn.LayerNorm(d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.norm(self.lin(x)))


def blocks_mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Block(6, 16), Block(16, 16), nn.Linear(16, 3))


def mlp_loss(model: nn.Module) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 6, generator=gen), torch.randint(0, 3, (8,), generator=gen)
    return F.cross_entropy(model(x), y)


def test_the_recompute_signal():
    """True in a non-reentrant checkpoint's recompute only: not in the original forward,
    not in a reentrant checkpoint's recompute (whose original forward ran without
    autograd and took no statistic)."""
    seen: list[tuple[bool, bool]] = []
    layer = nn.Linear(3, 3)
    layer.register_forward_pre_hook(
        lambda m, a: seen.append((torch.is_grad_enabled(), in_checkpoint_recompute()))
    )
    x = torch.randn(2, 3, requires_grad=True)
    for reentrant in (False, True):
        checkpoint(layer, x, use_reentrant=reentrant).sum().backward()
    assert seen == [(True, False), (True, True), (False, False), (True, False)]


def test_own_fallback_counts_once():
    model = blocks_mlp()
    plain = copy.deepcopy(model)
    handle = checkpoint_largest_blocks(model, 2)
    assert handle.names == ["1", "0"]  # the blocks, whose recompute calls their layers
    assert_counted_once(statistics(model, mlp_loss)[1], statistics(plain, mlp_loss)[1])


def test_torch_checkpoint_wrapper_counts_once():
    """torch's ``checkpoint_wrapper``, as Accelerate applies FSDP2's activation
    checkpointing (``fsdp2_apply_ac``), non-reentrant, without the RNG replay."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = blocks_mlp()
    plain = copy.deepcopy(model)
    model[0] = checkpoint_wrapper(model[0], preserve_rng_state=False)
    model[1] = checkpoint_wrapper(model[1], preserve_rng_state=False)
    assert_counted_once(statistics(model, mlp_loss)[1], statistics(plain, mlp_loss)[1])


class Reentrant(nn.Module):
    """A block run through a reentrant checkpoint: its original forward runs without
    autograd, so its statistics must come from the recompute."""

    def __init__(self, inner: nn.Module, reentrant: bool) -> None:
        super().__init__()
        self.inner = inner
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.reentrant:
            return self.inner(x)
        return checkpoint(self.inner, x, use_reentrant=True)


def test_reentrant_checkpoint_counts_once():
    model = blocks_mlp()
    plain = copy.deepcopy(model)
    # the second block: a reentrant checkpoint passes gradients only to inputs that need them
    model[1] = Reentrant(model[1], True)
    plain[1] = Reentrant(plain[1], False)
    assert_counted_once(statistics(model, mlp_loss)[1], statistics(plain, mlp_loss)[1])


def test_transformers_gradient_checkpointing_counts_once():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=2, n_embd=16, n_head=2, vocab_size=32, n_positions=16,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config).train()
    plain = copy.deepcopy(model)
    handle = enable_activation_checkpointing(model)
    assert handle.method in ("activation_checkpointing_enable", "gradient_checkpointing_enable")
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(2))

    def loss_of(m: nn.Module) -> torch.Tensor:
        return m(input_ids=ids, labels=ids).loss

    assert_counted_once(statistics(model, loss_of)[1], statistics(plain, loss_of)[1])


@pytest.mark.parametrize("reentrant", [False, True])
def test_timm_grad_checkpointing_counts_once(reentrant):
    timm = pytest.importorskip("timm")
    from timm.layers import set_reentrant_ckpt, use_reentrant_ckpt

    torch.manual_seed(0)
    model = timm.create_model(
        "vit_tiny_patch16_224", img_size=16, patch_size=8, depth=2, num_classes=3
    ).train()
    plain = copy.deepcopy(model)
    assert enable_activation_checkpointing(model).method == "set_grad_checkpointing"
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randn(4, 3, 16, 16, generator=gen), torch.randint(0, 3, (4,), generator=gen)

    def loss_of(m: nn.Module) -> torch.Tensor:
        return F.cross_entropy(m(x), y)

    before = use_reentrant_ckpt()
    set_reentrant_ckpt(reentrant)
    try:
        got = statistics(model, loss_of)[1]
    finally:
        set_reentrant_ckpt(before)
    assert_counted_once(got, statistics(plain, loss_of)[1])
