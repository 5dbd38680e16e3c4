"""Refresh steps recorded and replayed (hf_triaccel.curvature.steady): a replayed step
gives the general path's factors bit for bit, also when it departs from its recording
partway, and costs less host work. CPU runs use Triton's interpreter."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import hf_triaccel.kernels
from hf_triaccel.curvature.collector import FisherCollector
from hf_triaccel.curvature.rules import FisherRule, per_entry_layout, register_fisher_rule, registry
from hf_triaccel.curvature.steady import MAX_MISSES
from tests.curvature.test_collector import ResidualNet

pytest.importorskip("triton")

GAMMA = 0.9
KERNELS = str(Path(hf_triaccel.kernels.__file__).parent)


def twins(model: nn.Module) -> tuple[FisherCollector, FisherCollector, nn.Module]:
    """A collector that replays on ``model``, and one that never does on a copy of it
    (returned too)."""
    twin = copy.deepcopy(model)
    replaying = FisherCollector(model, impl="triton")
    general = FisherCollector(twin, impl="triton")
    general.steady.enabled = False
    return replaying, general, twin


def step(model: nn.Module, collector: FisherCollector, x: torch.Tensor, w: torch.Tensor):
    """One refresh step: forward, backward, fold."""
    (model(x) * w).sum().backward()
    collector.fold(GAMMA)


def assert_same_factors(a: FisherCollector, b: FisherCollector) -> None:
    for name, layer in a.layers.items():
        other = b.layers[name]
        for mine, theirs in zip(layer.tensors(), other.tensors(), strict=True):
            assert torch.equal(mine, theirs), name
        assert (layer.a_count, layer.g_count) == (other.a_count, other.g_count), name


def warmed_twins(seed: int) -> tuple[tuple, tuple]:
    """(model, collector) of a ResidualNet and of its copy (:func:`twins`), after two
    refresh steps on the same batches: the first collector's second step replayed."""
    model = ResidualNet(inplace=True).to(memory_format=torch.channels_last)
    replaying, general, twin = twins(model)
    for m, collector in ((model, replaying), (twin, general)):
        torch.manual_seed(seed)
        for _ in range(2):
            step(m, collector, *batch())
    return (model, replaying), (twin, general)


def batch(n: int = 3, channels_last: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(n, 3, 6, 6)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    return x, torch.randn(n, 2)


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("channels_last", [False, True])
def test_replayed_refreshes_give_the_general_path_s_factors(autocast, channels_last):
    torch.manual_seed(0)
    model = ResidualNet(inplace=True)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    replaying, general, twin = twins(model)
    for _ in range(4):
        x, w = batch(channels_last=channels_last)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            (model(x) * w).sum().backward()
            # every input and gradient let go once its statistics are launched
            assert not any(t is not None for t in replaying.steady.stash)
            replaying.fold(GAMMA)
            step(twin, general, x, w)
        assert_same_factors(replaying, general)
    program = replaying.steady.program
    releases = [a.release for e in program.events for a in e.actions]
    assert sorted(s for r in releases for s in r) == sorted(set(s for r in releases for s in r))
    assert replaying.steady.refused == ""
    assert replaying.steady.replayed == 3  # the first step was recorded
    assert general.steady.replayed == 0


def test_replayed_refreshes_of_a_token_model_give_the_general_path_s_factors():
    """Layer norms and Linear layers over (batch, tokens, features), as in a transformer."""
    torch.manual_seed(6)
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.GELU(), nn.Linear(8, 2))
    replaying, general, twin = twins(model)
    for _ in range(3):
        x, w = torch.randn(2, 5, 4), torch.randn(2, 5, 2)
        step(model, replaying, x, w)
        step(twin, general, x, w)
        assert_same_factors(replaying, general)
    assert replaying.steady.replayed == 2


def _another_batch_size(model, collector):
    x, w = batch(n=5)
    step(model, collector, x, w)


def _an_evaluation_forward_first(model, collector):
    x, w = batch()
    model(x)  # autograd on, no backward: counts for nothing
    step(model, collector, x, w)


def _two_micro_batches(model, collector):
    for _ in range(2):
        x, w = batch()
        (model(x) * w).sum().backward()
    collector.fold(GAMMA)


def _a_second_backward(model, collector):
    x, w = batch()
    loss = (model(x) * w).sum()
    loss.backward(retain_graph=True)
    loss.backward()  # every gradient again: each forward is confirmed twice
    collector.fold(GAMMA)


def _a_layer_skipped(model, collector):
    x, w = batch()
    model.skip_conv2 = True
    try:
        step(model, collector, x, w)
    finally:
        model.skip_conv2 = False


class SkippingNet(ResidualNet):
    """ResidualNet whose second convolution can be left out of a forward."""

    skip_conv2 = False

    def forward(self, x):
        x = self.act(self.bn0(self.stem(x)))
        out = self.act(self.bn1(self.conv1(x)))
        if not self.skip_conv2:
            out = self.bn2(self.conv2(out))
        return self.head(self.act(out + x).mean((2, 3)))


@pytest.mark.parametrize(
    "departure",
    [
        _another_batch_size,
        _an_evaluation_forward_first,
        _two_micro_batches,
        _a_second_backward,
        _a_layer_skipped,
    ],
)
def test_a_step_that_departs_from_its_recording_gives_the_general_path_s_factors(departure):
    torch.manual_seed(1)
    model = SkippingNet(inplace=True).to(memory_format=torch.channels_last)
    replaying, general, twin = twins(model)
    for _ in range(2):  # recorded, then replayed
        x, w = batch()
        step(model, replaying, x, w)
        step(twin, general, x, w)
    assert replaying.steady.replayed == 1
    state = torch.get_rng_state()
    departure(model, replaying)
    torch.set_rng_state(state)
    departure(twin, general)
    assert_same_factors(replaying, general)
    assert replaying.steady.replayed == 1  # the departing step left the replay
    for _ in range(3):  # recorded again, then replayed
        x, w = batch()
        step(model, replaying, x, w)
        step(twin, general, x, w)
        assert_same_factors(replaying, general)
    assert replaying.steady.replayed == 3


def test_a_gradient_after_its_step_s_fold_is_not_taken():
    """A graph kept past the fold and run backward again: its forward belongs to a step
    already folded, on the replay as on the general path."""
    pairs = warmed_twins(seed=3)
    x, w = batch()
    for m, collector in pairs:
        loss = (m(x) * w).sum()
        loss.backward(retain_graph=True)
        collector.fold(GAMMA)
        loss.backward()
        assert all(ly.a_count == ly.g_count == 0 for ly in collector.layers.values())
    assert_same_factors(pairs[0][1], pairs[1][1])


def test_recording_stops_when_steps_keep_departing():
    model = ResidualNet(inplace=True).to(memory_format=torch.channels_last)
    collector = FisherCollector(model, impl="triton")
    for n in range(2, 4 + 2 * MAX_MISSES):  # a new batch size every step
        x, w = batch(n=n)
        step(model, collector, x, w)
    assert collector.steady.replayed == 0
    assert not collector.steady.enabled
    assert collector.steady.misses == MAX_MISSES


class Scale(nn.Module):
    """y = weight * x, with a rule of its own (FisherRule's example)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return self.weight * x


class ScaleRule(FisherRule):
    """Writes its statistics with tensor operations of its own: not replayable."""

    def sizes(self, module):
        return 1, 4

    def layouts(self, module):
        return {"weight": per_entry_layout(4, 0)}

    def a_write(self, module, x, out, impl, cache):
        out[0] = x.float().square().sum()
        return x.numel()

    def g_write(self, module, grad, out, accumulate, impl, cache):
        stat = grad.float().reshape(-1, 4).square().sum(0)
        out.add_(stat) if accumulate else out.copy_(stat)
        return grad.numel() // 4


def test_a_rule_that_writes_its_own_statistics_is_not_replayed(monkeypatch):
    monkeypatch.setattr(registry, "_RULES", dict(registry._RULES))
    register_fisher_rule(Scale, ScaleRule())
    model = nn.Sequential(nn.Linear(4, 4), Scale())
    collector = FisherCollector(model, impl="triton")
    for _ in range(2):
        model(torch.randn(3, 4)).sum().backward()
        collector.fold(GAMMA)
    assert collector.steady.refused == "ScaleRule is not replayable"
    assert not collector.steady.enabled and collector.steady.replayed == 0


def test_replayed_refreshes_of_a_language_model_give_the_general_path_s_factors():
    """Token embeddings, whose activation statistic counts the rows looked up (a step
    that reads the hook's tensor), layer norms and Linear layers."""
    torch.manual_seed(7)
    model = nn.Sequential(nn.Embedding(11, 8), nn.LayerNorm(8), nn.Linear(8, 11))
    replaying, general, twin = twins(model)
    for _ in range(3):
        ids, w = torch.randint(0, 11, (2, 5)), torch.randn(2, 5, 11)
        step(model, replaying, ids, w)
        step(twin, general, ids, w)
        assert_same_factors(replaying, general)
    assert replaying.steady.refused == ""
    assert replaying.steady.replayed == 2
    ids, w = torch.randint(0, 11, (2, 5)), torch.randn(2, 5, 11)
    model(ids[:1])  # an evaluation forward first: the step leaves its replay
    step(model, replaying, ids, w)
    twin(ids[:1])
    step(twin, general, ids, w)
    assert_same_factors(replaying, general)


def test_a_discarded_attempt_is_forgotten_and_the_step_replayed_again():
    """The elastic batch's rollback: an attempt's statistics are dropped mid-step, and
    the step's next attempt starts the replay again."""
    pairs = warmed_twins(seed=5)
    x, w = batch()
    for m, collector in pairs:
        m(x)  # the failed attempt: a forward, then out of memory
        collector.discard()
        step(m, collector, x, w)
    (_, replaying), (_, general) = pairs
    assert_same_factors(replaying, general)
    assert replaying.steady.replayed == 2


def test_a_replayed_refresh_runs_far_less_python():
    """The point of the replay: the hooks' decisions are not taken again (counted as
    the package's Python calls outside the kernels, which the host's speed does not
    change; under Triton's CPU interpreter a kernel's body runs as Python calls too)."""
    model = ResidualNet(inplace=True).to(memory_format=torch.channels_last)
    replaying, general, twin = twins(model)

    def calls(m, collector) -> int:
        x, w = batch()
        count = 0

        def profile(frame, event, arg):
            nonlocal count
            name = frame.f_code.co_filename
            if event == "call" and "hf_triaccel" in name and KERNELS not in name:
                count += 1

        sys.setprofile(profile)
        try:
            step(m, collector, x, w)
        finally:
            sys.setprofile(None)
        return count

    for _ in range(2):
        calls(model, replaying), calls(twin, general)
    replayed, taken = calls(model, replaying), calls(twin, general)
    assert replaying.steady.replayed == 2
    assert replayed < taken / 2, (replayed, taken)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", ["resnet18_channels_last", "efficientnet_b0"])
def test_gpu_replayed_refreshes_give_the_general_path_s_factors(case, monkeypatch):
    """Real models at training sizes under bf16 autocast: four refresh steps, the last
    three replayed, every factor bit for bit the general path's (cuDNN's deterministic
    algorithms, so that both models' gradients are the same bits too)."""
    from tests.curvature.test_gpu_statistics import CASES

    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    torch.manual_seed(0)
    model, run = CASES[case]()
    model = model.cuda()
    replaying, general, twin = twins(model)
    for _ in range(4):
        for m, collector in ((model, replaying), (twin, general)):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = run(m)
            out.square().mean().backward()
            collector.fold(GAMMA)
        assert_same_factors(replaying, general)
    assert replaying.steady.refused == ""
    assert replaying.steady.replayed == 3
