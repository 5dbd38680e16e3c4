"""SignalTracker: curvature and concentration against the materialised preconditioner,
the gradient noise ratio on synthetic gradients, scheduling, state and hook removal."""

from __future__ import annotations

import io
import math

import pytest
import torch
from torch import nn

from hf_triaccel.curvature.collector import FisherCollector
from hf_triaccel.curvature.rules import (
    FactorLayout,
    FisherRule,
    in_out_layout,
    out_in_layout,
    per_entry_layout,
    register_fisher_rule,
)
from hf_triaccel.curvature.signals import SignalTracker
from hf_triaccel.curvature.signals.noise import noise_probes
from hf_triaccel.curvature.signals.terms import FactorTerm, kronecker_term, top_share
from hf_triaccel.optim.functional import preconditioner

DAMPING = 1e-3


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


class HFConv1D(nn.Module):
    """transformers' Conv1D (a Linear stored (in, out)), recognised by its name and ``nf``."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf))
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x):
        return x @ self.weight + self.bias


HFConv1D.__name__ = "Conv1D"


class Interleaved(nn.Module):
    """A parameter whose custom layout is not a Kronecker product (both digits cycle)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(12))


class InterleavedRule(FisherRule):
    def sizes(self, module):
        return 4, 3

    def layouts(self, module):
        return {"weight": FactorLayout(g_div=1, g_mod=3, a_div=1, a_mod=4)}


register_fisher_rule(Interleaved, InterleavedRule())


def every_layout_model() -> nn.Module:
    return nn.ModuleDict(
        {
            "fc": nn.Linear(7, 5),
            "fc_nobias": nn.Linear(5, 4, bias=False),
            "conv": nn.Conv2d(3, 4, 3, padding=1),
            "grouped": nn.Conv2d(4, 6, 3, groups=2),
            "bn": nn.BatchNorm2d(4),
            "ln": nn.LayerNorm(8),
            "emb": nn.Embedding(11, 6),
            "hf": HFConv1D(8, 6),
            "custom": Interleaved(),
        }
    )


def randomise_factors(collector: FisherCollector) -> None:
    """Spread factors (with ties and zeros) rather than the ones they start at."""
    for layer in collector.layers.values():
        for t in (layer.a, layer.g):
            values = torch.rand(t.numel()) ** 3
            values[torch.rand(t.numel()) < 0.2] = 0.0
            values[: max(1, t.numel() // 4)] = values[0]  # ties
            t.copy_(values)


def brute_force(collector: FisherCollector, name: str) -> torch.Tensor:
    """Every entry of the module's F - damping, from the materialised preconditioner."""
    layer = collector.layers[name]
    entries = []
    for attr in layer.layouts:
        p = getattr(layer.module, attr)
        entries.append((preconditioner(p, collector.factors_for(p), DAMPING) - DAMPING).flatten())
    return torch.cat(entries).double()


def test_kronecker_term_recognises_every_builtin_layout():
    g, a = torch.rand(5), torch.rand(8)
    assert kronecker_term(out_in_layout(5, 7), 35, g, a).mult == 1
    assert kronecker_term(in_out_layout(7, 5), 35, g, a).a.numel() == 7
    bias = kronecker_term(per_entry_layout(5, 7), 5, g, a)
    assert bias.a.tolist() == [a[7].item()]
    assert kronecker_term(FactorLayout(1, 3, 1, 4), 12, g, a) is None


def test_curvature_and_concentration_match_the_materialised_preconditioner():
    model = every_layout_model()
    collector = FisherCollector(model)
    randomise_factors(collector)
    tracker = SignalTracker(collector, top_fraction=0.1)
    signals = tracker.compute()
    assert set(signals) == set(collector.layers)
    for name, s in signals.items():
        entries = brute_force(collector, name)
        assert s.params == entries.numel()
        assert s.curvature == pytest.approx(entries.mean().item(), rel=1e-5, abs=1e-9), name
        k = math.ceil(0.1 * entries.numel())
        top = entries.sort(descending=True).values[:k].sum() / entries.sum()
        assert s.concentration == pytest.approx(top.item(), rel=1e-5, abs=1e-7), name


def test_concentration_of_flat_and_peaked_factors():
    flat = FisherCollector(nn.Linear(10, 10, bias=False))
    assert SignalTracker(flat).compute()[""].concentration == pytest.approx(0.1)
    peaked = FisherCollector(nn.Linear(10, 10, bias=False))
    layer = peaked.layers[""]
    layer.a.zero_()
    layer.g.zero_()
    layer.a[3] = layer.g[7] = 1.0
    assert SignalTracker(peaked).compute()[""].concentration == pytest.approx(1.0)


def test_top_share_with_multiplicity_equals_repeated_entries():
    g, a = torch.rand(3), torch.rand(4)
    repeated = torch.outer(g, a).flatten().repeat(5).double()
    k = math.ceil(0.3 * repeated.numel())
    expected = repeated.sort(descending=True).values[:k].sum() / repeated.sum()
    got = top_share([FactorTerm(g, a, 5)], repeated.numel(), 0.3)
    assert got.item() == pytest.approx(expected.item(), rel=1e-6)


def test_top_shares_of_many_modules_match_one_at_a_time_in_any_chunking(monkeypatch):
    from hf_triaccel.curvature.signals import terms as term_maths

    modules = []
    for rows, cols, mult in ((3, 40, 1), (7, 2, 3), (1, 9, 1), (16, 16, 2)):
        g, a = torch.rand(rows), torch.rand(cols)
        bias = FactorTerm(torch.rand(1), torch.rand(rows), 1)
        modules.append(([FactorTerm(g, a, mult), bias], rows * cols * mult + rows))
    whole = term_maths.top_shares(modules, 0.2)
    monkeypatch.setattr(term_maths, "SEARCH_BLOCK", 1)  # one term per chunk
    chunked = term_maths.top_shares(modules, 0.2)
    for i, (terms, total) in enumerate(modules):
        entries = torch.cat(
            [torch.outer(t.g, t.a).flatten().repeat(t.mult).double() for t in terms]
        )
        k = math.ceil(0.2 * total)
        expected = entries.sort(descending=True).values[:k].sum() / entries.sum()
        assert whole[i].item() == pytest.approx(expected.item(), rel=1e-6)
        assert chunked[i].item() == pytest.approx(expected.item(), rel=1e-6)


def train_synthetic(tracker_kwargs, mean, sigma, steps=600):
    """Feeds gradients mean + sigma * N(0, 1) to an optimizer that does not move."""
    model = nn.Linear(16, 8)
    collector = FisherCollector(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    tracker = SignalTracker(collector, optimizer, every=10**9, **tracker_kwargs)
    for _ in range(steps):
        for p in model.parameters():
            p.grad = mean[: p.numel()].view_as(p) + sigma * torch.randn_like(p)
        optimizer.step()
    return tracker, model


@pytest.mark.parametrize("samples", [1000, 24])
def test_noise_ratio_on_gradients_with_known_variance(samples):
    mean = torch.linspace(-2.0, 2.0, 128)
    sigma = 1.5
    tracker, model = train_synthetic(
        dict(noise_samples=samples, noise_every=1, noise_beta=0.95), mean, sigma
    )
    # the weight (128 elements) dominates; the bias sees the first 8 means
    n_w, n_b = 128, 8
    var = sigma**2 * (n_w + n_b)
    second = var + mean.square().sum() + mean[:n_b].square().sum()
    expected = (var / second).item()
    got = tracker.compute()[""].noise
    assert got == pytest.approx(expected, abs=0.04 if samples > 128 else 0.1)


def test_noise_ratio_is_zero_for_constant_gradients_and_nan_before_two_samples():
    mean = torch.linspace(0.5, 1.0, 128)
    tracker, _ = train_synthetic(dict(noise_every=1), mean, 0.0, steps=1)
    assert math.isnan(tracker.compute()[""].noise)
    assert math.isnan(tracker.signals[""].sensitivity)
    tracker, _ = train_synthetic(dict(noise_every=1), mean, 0.0, steps=20)
    assert tracker.compute()[""].noise == pytest.approx(0.0, abs=1e-5)


def test_sensitivity_is_curvature_times_weight_norm_times_noise():
    tracker, model = train_synthetic(dict(noise_every=1), torch.zeros(128), 1.0, steps=50)
    s = tracker.compute()[""]
    w_sq = sum(p.detach().double().square().sum().item() for p in model.parameters())
    assert s.weight_norm_sq == pytest.approx(w_sq, rel=1e-6)
    assert s.sensitivity == pytest.approx(s.curvature * s.weight_norm_sq * s.noise, rel=1e-12)


def test_signals_are_computed_every_k_steps_and_listeners_hear_every_step():
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
    collector = FisherCollector(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    tracker = SignalTracker(collector, optimizer, every=3, noise_every=1)
    heard = []
    tracker.add_listener(lambda step, signals: heard.append((step, signals is not None)))
    for _ in range(7):
        model(torch.randn(5, 4)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    assert heard == [
        (1, False),
        (2, False),
        (3, True),
        (4, False),
        (5, False),
        (6, True),
        (7, False),
    ]
    assert tracker.steps == 7
    table = tracker.table().splitlines()
    assert table[0].split()[0] == "module" and len(table) == 3
    assert set(tracker.as_dict()["0"]) == {
        "kind",
        "params",
        "curvature",
        "concentration",
        "noise",
        "weight_norm_sq",
        "sensitivity",
    }


def test_wrapped_optimizer_is_unwrapped():
    class Wrapper(torch.optim.Optimizer):
        def __init__(self, optimizer):
            self.optimizer = optimizer

        def step(self, closure=None):
            return self.optimizer.step(closure)

    model = nn.Linear(3, 2)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    wrapped = Wrapper(inner)
    tracker = SignalTracker(FisherCollector(model), wrapped, every=1)
    model(torch.randn(2, 3)).sum().backward()
    wrapped.step()
    assert tracker.steps == 1 and len(inner._optimizer_step_pre_hooks) == 1


def test_state_dict_round_trip_and_remove():
    mean = torch.linspace(-1.0, 1.0, 128)
    tracker, model = train_synthetic(dict(noise_every=1, noise_samples=16), mean, 0.7, steps=30)
    tracker.compute()
    buffer = io.BytesIO()
    torch.save(tracker.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)

    restored = SignalTracker(tracker.collector, noise_samples=16, seed=123)
    restored.load_state_dict(state)
    assert restored.steps == 30
    assert restored.as_dict() == tracker.as_dict()
    assert restored.compute()[""] == tracker.compute()[""]

    smaller = SignalTracker(tracker.collector, noise_samples=8)
    with pytest.raises(ValueError, match="same noise_samples"):
        smaller.load_state_dict(state)

    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    other = SignalTracker(FisherCollector(nn.Linear(2, 2)))
    with pytest.raises(KeyError):
        other.load_state_dict({**state, "probes": {"x": state["probes"]["weight"]}})
    restored.attach(optimizer)
    restored.add_listener(lambda step, signals: None)
    assert optimizer._optimizer_step_pre_hooks and optimizer._optimizer_step_post_hooks
    restored.remove()
    assert not optimizer._optimizer_step_pre_hooks and not optimizer._optimizer_step_post_hooks
    assert not restored._listeners


def test_noise_state_of_all_parameters_shares_three_buffers():
    """A probe per parameter, but one index and two EMA buffers in all: each tensor
    would otherwise take its own allocator block."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4), nn.Linear(4, 2))
    probes = list(noise_probes(dict(model.named_parameters()), 5, torch.Generator()).values())
    assert len(probes) == 6
    for attr in ("index", "m1", "m2"):
        storages = {getattr(p, attr).untyped_storage().data_ptr() for p in probes}
        assert len(storages) == 1
    # parameters of fewer than noise_samples elements are sampled whole (biases of 4 and 2)
    assert [p.index.numel() for p in probes] == [5, 5, 5, 4, 5, 2]
