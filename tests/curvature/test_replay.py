"""The finish and fold replayed as a CUDA graph: when it captures, what it replays, and
that a collector folding through graphs ends with the factors of one folding eagerly."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hf_triaccel.curvature.collection import graphs as replay_module
from hf_triaccel.curvature.collection.graphs import Replay, capturable
from hf_triaccel.curvature.collector import FisherCollector

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def counting_run(out: torch.Tensor, calls: list[str], key: str):
    def run() -> None:
        calls.append(key)
        out.add_(1.0 if key == "a" else 10.0)

    return run


def test_off_cuda_every_call_runs_eagerly():
    assert not capturable(torch.device("cpu"))
    replay, out, calls = Replay(torch.device("cpu")), torch.zeros(1), []
    for key in "aaab":
        replay(key, counting_run(out, calls, key))
    assert calls == list("aaab") and replay.graphs == {}
    assert out.item() == 13.0


@pytest.mark.gpu
@needs_cuda
def test_captures_on_the_second_same_key_and_replays_after():
    device = torch.device("cuda")
    replay, out, calls = Replay(device), torch.zeros(1, device=device), []
    for key in "aaaaba":
        replay(key, counting_run(out, calls, key))
    # a: eager; a: eager, then captured (run again, but not executed); a, a: replayed;
    # b: eager (a new key); a: replayed
    assert calls == ["a", "a", "a", "b"]
    assert list(replay.graphs) == ["a"]
    torch.cuda.synchronize()
    assert out.item() == 15.0  # five a's and one b, each applied once


@pytest.mark.gpu
@needs_cuda
def test_no_capture_inside_another_capture():
    device = torch.device("cuda")
    replay, out, calls = Replay(device), torch.zeros(1, device=device), []
    replay("a", counting_run(out, calls, "a"))
    outer = torch.cuda.CUDAGraph()
    with torch.cuda.graph(outer):
        assert not capturable(device)
        replay("a", counting_run(out, calls, "a"))  # recorded into the outer graph
    assert replay.graphs == {}
    outer.replay()
    torch.cuda.synchronize()
    assert out.item() == 2.0


def refreshes(model: nn.Module, collector: FisherCollector, steps: int) -> None:
    torch.manual_seed(1)
    for _ in range(steps):
        x = torch.randn(16, 3, 8, 8, device="cuda")
        y = torch.randint(0, 4, (16,), device="cuda")
        F.cross_entropy(model(x), y).backward()
        collector.fold(gamma=0.8)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("ema", ["reference", "paper"])
def test_collector_through_graphs_equals_eager(ema, monkeypatch):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(512, 4)
    ).cuda()
    copies = [model, copy.deepcopy(model)]
    collectors = [FisherCollector(m, ema=ema) for m in copies]
    refreshes(copies[0], collectors[0], 5)
    with monkeypatch.context() as patch:
        patch.setattr(replay_module, "capturable", lambda device: False)
        refreshes(copies[1], collectors[1], 5)
    plans = next(iter(collectors[0]._fold_plans.plans.values()))
    assert plans[0].replay.graphs, "the fold was never captured"
    for name, layer in collectors[0].layers.items():
        other = collectors[1].layers[name]
        for mine, theirs in zip(layer.tensors()[:4], other.tensors()[:4], strict=True):
            assert torch.equal(mine, theirs), name
