"""The factors' seed (``factor_init``) under the published fold rule: from ones, the first
refresh leaves each factor near 0.08 and the step grows at the second refresh, when the
factors settle near 0.0087; from zeros they are near their settled scale from the first
refresh on, and the step stays the same."""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hf_triaccel.curvature.collector import FisherCollector
from hf_triaccel.optim.adafisher import AdaFisher, AdaFisherW

DAMPING = 1e-3
GAMMA = 0.8


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))


def refreshes(factor_init: str, n: int, cls: type[AdaFisher] = AdaFisherW) -> list[dict]:
    """Each Linear's factors and its largest preconditioner entry after each of ``n``
    refreshes (a refresh every step), on the same data whatever the seed."""
    net = model()
    opt = cls.from_model(
        net,
        lr=1e-3,
        damping=DAMPING,
        gamma=GAMMA,
        update_every=1,
        factor_init=factor_init,
        impl="reference",
    )
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        x, y = torch.randn(64, 8, generator=gen), torch.randint(0, 3, (64,), generator=gen)
        F.cross_entropy(net(x), y).backward()
        opt.step()
        opt.zero_grad()
        out.append(
            {
                name: (ly.a.clone(), ly.g.clone(), (torch.outer(ly.g, ly.a) + DAMPING).max())
                for name, ly in opt.collector.layers.items()
            }
        )
    return out


@pytest.mark.parametrize("cls", [AdaFisher, AdaFisherW])
def test_zeros_differ_from_ones_by_the_seeds_share_only(cls):
    """The fold is linear in the seed: after k refreshes a factor from ones holds the
    seed's share (0.1 gamma)^k more than the same factor from zeros."""
    ones, zeros = refreshes("ones", 1, cls), refreshes("zeros", 1, cls)
    # the first step's statistics do not depend on the seed (taken before the update)
    for name, (a1, g1, _) in ones[0].items():
        a0, g0, _ = zeros[0][name]
        share = 0.1 * GAMMA
        # float32 factors near 0.08: a few ulps of 0.08 (~7.5e-9 each)
        torch.testing.assert_close(a1, a0 + share, rtol=0, atol=3e-8)
        torch.testing.assert_close(g1, g0 + share, rtol=0, atol=3e-8)


def test_the_step_grows_at_the_second_refresh_from_ones_only():
    """Largest F = g a^T + damping (the step is lr / F): from ones it falls by 1 +
    ~0.0064 / damping between the first and the second refresh; from zeros it stays
    within the settled bound, damping + (0.01 gamma / (1 - 0.1 gamma))^2."""
    keep, add = 0.1 * GAMMA, 0.01 * GAMMA  # a fold: keep * factor + add * (stat in [0, 1])
    settled = DAMPING + (add / (1 - keep)) ** 2
    ones, zeros = refreshes("ones", 2), refreshes("zeros", 2)
    for name in ones[0]:
        first, second = ones[0][name][2].item(), ones[1][name][2].item()
        assert first > DAMPING + keep**2  # a, g >= keep after the first fold
        assert second <= DAMPING + (keep * (keep + add) + add) ** 2
        assert first / second > 5, name
        for step in zeros:
            assert DAMPING <= step[name][2].item() <= settled, name


def test_the_optimizer_and_its_collector_must_agree():
    net = model()
    collector = FisherCollector(net, factor_init="ones")
    with pytest.raises(ValueError, match="factor_init='zeros' but the collector was built with"):
        AdaFisher(net.parameters(), collector)
    opt = AdaFisher(net.parameters(), collector, factor_init="ones")
    assert all(torch.equal(ly.a_ema, torch.ones_like(ly.a_ema)) for ly in collector.layers.values())
    assert "factor_init='ones'" in repr(collector)
    # built alone, both take the default: zeros
    plain = FisherCollector(model())
    assert plain.factor_init == AdaFisher(plain.layers["0"].module.parameters(), plain).factor_init
    assert all(ly.a_ema.sum() == 0 for ly in plain.layers.values())
    with pytest.raises(ValueError, match="factor_init='twos' is not one of"):
        FisherCollector(model(), factor_init="twos")
    copy = pickle.loads(pickle.dumps(opt))
    assert copy.factor_init == "ones"


def test_objects_pickled_before_the_setting_start_from_ones():
    opt = AdaFisherW.from_model(model())
    state = opt.__getstate__()
    del state["factor_init"]
    copy = AdaFisherW.__new__(AdaFisherW)
    copy.__setstate__(state)
    assert copy.factor_init == "ones"
    collector_state = opt.collector.__getstate__()
    del collector_state["factor_init"]
    revived = FisherCollector.__new__(FisherCollector)
    revived.__setstate__(collector_state)
    assert revived.factor_init == "ones"
