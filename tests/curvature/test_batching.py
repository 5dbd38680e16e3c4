"""Statistics launched together: the grouped kernel against one launch per statistic, and
the collector's batches (what waits, for how long, and that nothing is lost). CPU runs
use Triton's interpreter."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from hf_triaccel.curvature.collection.hooks import RefreshBatches
from hf_triaccel.curvature.collector import FisherCollector
from hf_triaccel.curvature.rules.batching import StatisticsBatch, activate, queue_or_launch
from tests.curvature.test_collector import ResidualNet, forward_backward

pytest.importorskip("triton")
grouped = pytest.importorskip("hf_triaccel.kernels.grouped")
reductions = pytest.importorskip("hf_triaccel.kernels.reductions")

# float32 sums of positive terms added in another order: each entry's rounding differs
# by at most a few ulps per term added (the splits' partials, then the totals)
RTOL = 64 * torch.finfo(torch.float32).eps


def _cases() -> list[tuple[torch.Tensor, bool, tuple[int, float] | None]]:
    """Inputs of several geometries that share a grouped kernel (same dtype and block
    shape), some split over programs, with and without squares and a tail."""
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randn(300, 64, generator=g), True, None),  # split: 1 column block
        (torch.randn(300, 64, generator=g)[::2], True, (6, 5.0)),  # row stride 128
        (torch.randn(40, 64, generator=g), False, (3, 2.0)),
        (torch.randn(1000, 50, generator=g), True, None),
    ]


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_launch_matches_one_launch_per_statistic(accumulate, dtype):
    entries, expected, keys = [], [], set()
    for x, square, tail in _cases():
        x = x.to(dtype)
        launch = reductions.reduction_launch(x, square, tail)
        n = x.shape[1] + (tail[0] if tail else 0)
        out = torch.linspace(1.0, 2.0, n)
        want = out.clone()
        launch(x, want, 0.25, accumulate)
        entries.append((launch, x, out, 0.25, accumulate))
        expected.append(want)
        keys.add(grouped.group_key(launch, x))
    assert len(keys) == 1, keys  # one kernel for all of them
    assert any(e[0].group[4] > 1 for e in entries)  # the grouped split path is exercised
    key = keys.pop()
    for _ in range(2):  # the second launch reuses the tables and the tickets
        for _, _, out, _, _ in entries:
            out.copy_(torch.linspace(1.0, 2.0, out.numel()))
        grouped.launch_grouped(key, entries)
        for (_, _, out, _, _), want in zip(entries, expected, strict=True):
            torch.testing.assert_close(out, want, rtol=RTOL, atol=1e-6)


def test_grouped_launches_keep_the_tables_of_inputs_that_take_turns(monkeypatch):
    """A grouped launch of the same reductions called on inputs at a few addresses in turn
    (a loop's batches) copies each set of addresses to the device once, and sums the right
    inputs; more sets than it keeps are copied again, and still summed right."""
    cases = _cases()
    entries = []
    for x, square, tail in cases:
        launch = reductions.reduction_launch(x, square, tail)
        entries.append((launch, torch.zeros(x.shape[1] + (tail[0] if tail else 0)), 1.0, False))
    keys = {grouped.group_key(e[0], x) for e, (x, _, _) in zip(entries, cases, strict=True)}
    (key,) = keys
    grouped._group_plan(key, [e[0] for e in entries], torch.device("cpu"))  # its own tables
    copies = []
    to_device = grouped._to_device
    monkeypatch.setattr(grouped, "_to_device", lambda *a: copies.append(a[0]) or to_device(*a))

    def inputs(seed: int) -> list[torch.Tensor]:
        """New tensors laid out as the cases (a row stride of their own included), of
        positive terms, for which RTOL holds whatever order the sums take."""
        g = torch.Generator().manual_seed(seed)
        xs = []
        for x, _, _ in cases:
            storage = torch.rand(x.untyped_storage().nbytes() // x.element_size(), generator=g)
            xs.append(storage.as_strided(x.shape, x.stride(), x.storage_offset()))
        return xs

    def check(xs: list[torch.Tensor]) -> None:
        launches = [(e[0], x, e[1], e[2], e[3]) for e, x in zip(entries, xs, strict=True)]
        grouped.launch_grouped(key, launches)
        for (launch, out, _, _), x in zip(entries, xs, strict=True):
            want = torch.zeros_like(out)
            launch(x, want, 1.0, False)
            torch.testing.assert_close(out, want, rtol=RTOL, atol=1e-6)

    sets = [inputs(seed) for seed in range(grouped.TABLES_KEPT + 1)]
    for _ in range(3):
        for xs in sets[:2]:
            check(xs)
    assert len(copies) == 2
    for _ in range(2):
        for xs in sets:  # one set more than kept: each call evicts the one it needs next
            check(xs)
    # the first pass finds the two kept and copies the others; the second, every one
    assert len(copies) == 2 + (len(sets) - 2) + len(sets)


def test_grouped_gathers_match_matrix_products():
    """Per-position sums (channels-last: a transposed view) gathered by tap selectors
    (transposed too, as the conv rule caches them), of several widths, in two kernels."""
    g = torch.Generator().manual_seed(1)
    entries, expected = [], []
    for c, p, k in ((3, 40, 9), (37, 100, 9), (5, 64, 49), (2, 7, 1)):
        sums = torch.rand(p, c, generator=g).t()
        taps = (torch.rand(k, p, generator=g) > 0.5).float().t()
        entries.append((sums, taps, torch.full((c, k), -1.0)))
        expected.append(sums @ taps)
    widths: dict[int, list] = {}
    for entry in entries:
        widths.setdefault(grouped.gather_key(entry[1]), []).append(entry)
    assert sorted(widths) == [16, 64]
    for width, group in widths.items():
        grouped.launch_gathers(width, group)
    for (_, _, out), want in zip(entries, expected, strict=True):
        torch.testing.assert_close(out, want, rtol=RTOL, atol=0.0)


def test_a_channel_reduction_is_launched_at_once():
    x = torch.randn(2, 3, 7)  # (B, C, L) with unit stride along L: the channel kernel
    launch = reductions.reduction_launch(x, True)
    assert launch.rows is None and grouped.group_key(launch, x) is None
    batch, out = StatisticsBatch(), torch.zeros(3)
    previous = activate(batch)
    try:
        queue_or_launch(launch, x, out)
    finally:
        activate(previous)
    assert len(batch) == 0
    torch.testing.assert_close(out, x.square().sum((0, 2)), rtol=RTOL, atol=0.0)


def test_a_second_reduction_into_the_same_output_flushes_the_first():
    x = torch.rand(30, 8)
    launch = reductions.reduction_launch(x, True)
    batch, out = StatisticsBatch(), torch.zeros(8)
    previous = activate(batch)
    try:
        queue_or_launch(launch, x, out, 1.0, False)
        queue_or_launch(launch, 2 * x, out, 1.0, True)  # waits; the first was launched
        assert len(batch) == 1
    finally:
        activate(previous)
    batch.flush()
    torch.testing.assert_close(out, 5 * x.square().sum(0), rtol=RTOL, atol=0.0)


def _spy(monkeypatch) -> list[int]:
    sizes: list[int] = []
    launch = grouped.launch_grouped

    def spy(key, entries):
        sizes.append(len(entries))
        launch(key, entries)

    monkeypatch.setattr(grouped, "launch_grouped", spy)
    return sizes


def test_collector_launches_statistics_together_and_loses_none(monkeypatch):
    sizes = _spy(monkeypatch)
    torch.manual_seed(3)
    model = ResidualNet(inplace=True).to(memory_format=torch.channels_last)
    twin = copy.deepcopy(model)
    fast = FisherCollector(model, impl="triton")
    plain = FisherCollector(twin, impl="reference")
    fast.batches.gradients.budget = 1 << 30  # hold every gradient until the backward ends
    x = torch.randn(3, 3, 6, 6).contiguous(memory_format=torch.channels_last)
    model(x)  # a forward that no backward follows: its inputs wait, then count for nothing
    assert len(fast.batches.activations) > 0
    w = forward_backward(model, x)
    forward_backward(twin, x, w)
    assert len(fast.batches.activations) == len(fast.batches.gradients) == 0  # all launched
    assert max(sizes) > 1
    for name, layer in fast.layers.items():
        assert layer.a_count == layer.g_count == 1
        for got, want in zip(layer.statistics(), plain.layers[name].statistics(), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7, msg=name)


def test_gradients_held_stay_within_the_budget(monkeypatch):
    model = nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 3))
    collector = FisherCollector(model, impl="triton")
    # GRADIENT_BYTES_PER_PARAMETER (2) bytes per parameter of the hooked layers
    assert collector.batches.gradients.budget == 2 * sum(p.numel() for p in model.parameters())
    collector.batches.gradients.budget = 100  # one gradient fits, two do not
    held = []
    taken = RefreshBatches.gradient_taken

    def watch(batches):
        taken(batches)
        held.append(batches.gradients.nbytes)

    monkeypatch.setattr(RefreshBatches, "gradient_taken", watch)
    forward_backward(model, torch.randn(4, 5))
    assert held and max(held) <= 100


def test_a_gradient_over_the_budget_is_launched_at_once(monkeypatch):
    sizes = _spy(monkeypatch)
    model = nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 3))
    twin = copy.deepcopy(model)
    collector = FisherCollector(model, impl="triton")
    plain = FisherCollector(twin, impl="reference")
    collector.batches.gradients.budget = 0
    held = []
    taken = RefreshBatches.gradient_taken

    def watch(batches):
        held.append(len(batches.gradients))
        taken(batches)

    monkeypatch.setattr(RefreshBatches, "gradient_taken", watch)
    x = torch.randn(4, 5)
    w = forward_backward(model, x)
    forward_backward(twin, x, w)
    assert held and not any(held)  # no gradient waited
    assert sizes == [2]  # the two activation sums, together
    for name, layer in collector.layers.items():
        for got, want in zip(layer.statistics(), plain.layers[name].statistics(), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7, msg=name)


def test_inputs_cast_by_autocast_are_taken_at_once():
    model = nn.Linear(4, 3)
    collector = FisherCollector(model, impl="triton")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randn(2, 4))  # float32 in, cast: the forward keeps the cast copy
        assert len(collector.batches.activations) == 0
        model(torch.randn(2, 4, dtype=torch.bfloat16))  # kept as given: it may wait
        assert len(collector.batches.activations) == 1
    collector.fold(0.9)  # a fold launches what waits
    assert len(collector.batches.activations) == 0


def test_inputs_under_activation_checkpointing_are_taken_at_once():
    """A checkpointed forward keeps nothing it saves: holding its inputs until the
    backward would undo what checkpointing saves."""
    from torch.utils.checkpoint import checkpoint

    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    collector = FisherCollector(model, impl="triton")
    checkpoint(model, torch.randn(2, 4), use_reentrant=False)
    assert len(collector.batches.activations) == 0
    model(torch.randn(2, 4))  # without it, both inputs may wait
    assert len(collector.batches.activations) == 2


class _FailOnce(torch.autograd.Function):
    """Identity whose first backward raises: a backward that fails half-way."""

    failed = False

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if not _FailOnce.failed:
            _FailOnce.failed = True
            raise RuntimeError("a backward that fails")
        return grad


def test_a_backward_after_a_failed_one_still_launches_its_gradient_sums():
    first, second = nn.Linear(4, 5), nn.Linear(5, 3)
    collector = FisherCollector(nn.ModuleList([first, second]), impl="triton")
    collector.batches.gradients.budget = 1 << 30  # every gradient waits for the end

    def backward():
        second(_FailOnce.apply(first(torch.randn(2, 4)))).square().sum().backward()

    _FailOnce.failed = False
    with pytest.raises(RuntimeError, match="fails"):
        backward()  # the second layer's sums were queued; the end never came
    assert len(collector.batches.gradients) == 1
    backward()
    assert len(collector.batches.gradients) == 0
