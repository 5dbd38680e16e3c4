"""The same training on any number of processes: AdaFisherW under DDP and FSDP2, over 2
and 3 CPU processes joined by gloo, against one process on the global batch taken whole.

A float32 model with an Embedding, a Conv2d and a GroupNorm, a Linear and a LayerNorm
(no BatchNorm, whose training-mode output depends on the batch it sees), 12 steps with a
Fisher refresh every 5, under both EMA rules and the default hyperparameters; under DDP
each process also splits its share into two uneven micro-batches. Parameters and factors
agree within tests/distributed/compare.py's tolerance.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hf_triaccel import AdaFisherW
from hf_triaccel.testing import run_distributed
from tests.distributed.compare import assert_matches, spawns_per_world
from tests.distributed.test_fsdp2 import GLOBAL_BATCH, factors, full

STEPS = 12
UPDATE_EVERY = 5
LR = 1e-3  # the step size the tolerances below were derived at: they scale with it
EMAS = ("reference", "paper")
CLASSES = 4


class Net(nn.Module):
    """``test_fsdp2.Net`` with a head of 4 classes. With 2, the head's ``g`` has two equal
    entries (a cross-entropy's gradient sums to zero over the classes), and min-max
    normalisation of a vector whose spread is rounding noise turns that noise into factor
    entries of 1e-4 (noise / 1e-6): a float32 run then follows its rounding."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(7, 6)
        self.block = nn.Sequential(nn.Conv2d(3, 5, 3, padding=1), nn.GroupNorm(1, 5))
        self.fc = nn.Linear(5 * 16 + 6, 9)
        self.ln = nn.LayerNorm(9)
        self.head = nn.Linear(9, CLASSES)

    def forward(self, img: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.block(img)).flatten(1)
        h = torch.cat([h, self.emb(tok).mean(1)], 1)
        return self.head(torch.tanh(self.ln(self.fc(h))))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(2000 + step)
    return (
        torch.randn(GLOBAL_BATCH, 3, 4, 4, generator=gen),
        torch.randint(0, 7, (GLOBAL_BATCH, 3), generator=gen),
        torch.randint(0, CLASSES, (GLOBAL_BATCH,), generator=gen),
    )


def train(model: nn.Module, opt: AdaFisherW, batches) -> None:
    """``batches(step)`` gives the step's pieces; each loss is weighted by its share of the
    pieces' samples."""
    for step in range(STEPS):
        pieces = batches(step)
        total = sum(len(y) for _, _, y in pieces)
        for img, tok, y in pieces:
            (F.cross_entropy(model(img, tok), y) * len(y) / total).backward()
        opt.step()
        opt.zero_grad()


def _worker(rank: int, world: int) -> dict:
    from torch.distributed.fsdp import fully_shard

    n = GLOBAL_BATCH // world
    cut = n - n // 3  # two uneven micro-batches per share under DDP

    def share(step: int) -> list[tuple[torch.Tensor, ...]]:
        return [tuple(t[rank * n : (rank + 1) * n] for t in batch(step))]

    def split_share(step: int) -> list[tuple[torch.Tensor, ...]]:
        (mine,) = share(step)
        return [tuple(t[:cut] for t in mine), tuple(t[cut:] for t in mine)]

    out = {}
    for ema in EMAS:
        model = Net()
        opt = AdaFisherW.from_model(model, lr=LR, update_every=UPDATE_EVERY, ema=ema)
        train(nn.parallel.DistributedDataParallel(model), opt, split_share)
        out["ddp", ema] = (full(model), factors(opt))

        model = Net()
        fully_shard(model.fc)
        fully_shard(model)
        opt = AdaFisherW.from_model(model, lr=LR, update_every=UPDATE_EVERY, ema=ema)
        train(model, opt, share)
        out["fsdp2", ema] = (full(model), factors(opt))
    return {f"{mode}/{ema}": run for (mode, ema), run in out.items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """What every rank returned, per world size (one spawn per size)."""
    return spawns_per_world(_worker, tmp_path_factory, "global")


@pytest.fixture(scope="module")
def whole():
    """One process on the global batch taken whole, per EMA rule."""
    out = {}
    for ema in EMAS:
        model = Net()
        opt = AdaFisherW.from_model(model, lr=LR, update_every=UPDATE_EVERY, ema=ema)
        train(model, opt, lambda step: [batch(step)])
        out[ema] = (list(model.parameters()), factors(opt))
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ema", EMAS)
@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
@pytest.mark.parametrize("world", [2, 3])
def test_processes_match_one_process_on_the_global_batch(world, mode, ema, runs, whole):
    params, fisher = whole[ema]
    for rank in runs(world):
        got_params, got_factors = rank[f"{mode}/{ema}"]
        assert_matches(got_params, params, f"{mode} parameters")
        assert_matches(got_factors, fisher, f"{mode} factors")


def _lengths_worker(rank: int, world: int) -> list[torch.Tensor]:
    """Each rank's tokens padded to its own length (as dynamic padding does)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6))
    opt = AdaFisherW.from_model(model, lr=LR, update_every=1)
    model(_tokens(rank)).square().mean().backward()
    opt.step()
    return factors(opt)


def _tokens(rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(rank)
    return torch.randn(3, 5 + 4 * rank, 4, generator=gen)


@pytest.mark.timeout(60)
def test_processes_with_different_sequence_lengths(tmp_path):
    """A LayerNorm's activation sums per position keep one length on every process, so
    ranks whose sequences differ in length still meet in the all-reduce; their factors are
    those of one process taking both ranks' batches as micro-batches."""
    ranks = run_distributed(_lengths_worker, 2, tmp_path)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6))
    opt = AdaFisherW.from_model(model, lr=LR, update_every=1)
    for rank in range(2):  # each loss a mean over its rank's share, halved: DDP's average
        (model(_tokens(rank)).square().mean() / 2).backward()
    opt.step()
    for rank in ranks:
        assert_matches(rank, factors(opt), "factors")
