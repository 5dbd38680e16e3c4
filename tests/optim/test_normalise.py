"""The relative normalisation through the optimizer: on statistics of a mean loss over a
large batch, whose range is far below the absolute normalisation's 1e-6, it lets the
preconditioner vary as the published normalisation of a statistic of range >> 1e-6
would."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hf_triaccel.optim.adafisher import AdaFisher, AdaFisherW

DAMPING = 1e-3
BATCH = 4096
EPS = 1e-6


def span(x: torch.Tensor) -> float:
    return (x.max() - x.min()).item()


def train(normalise: str, steps: int = 4, cls: type[AdaFisher] = AdaFisherW) -> AdaFisher:
    """A few steps of an MLP without biases (each factor is normalised over the weight's
    own entries), on a mean loss over a large batch, with the paper's EMA rule (the factors
    the update reads are the normalised EMAs themselves)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32, bias=False), nn.Tanh(), nn.Linear(32, 4, bias=False))
    opt = cls.from_model(
        model, lr=1e-3, damping=DAMPING, ema="paper", normalise=normalise, impl="reference"
    )
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(BATCH, 16, generator=gen)
        y = torch.randn(BATCH, 4, generator=gen)
        F.mse_loss(model(x), y).backward()  # a mean over the batch: tiny output gradients
        opt.step()
        opt.zero_grad()
    return opt


@pytest.mark.parametrize("cls", [AdaFisher, AdaFisherW])
def test_relative_normalisation_lets_the_preconditioner_vary(cls):
    """max F / min F over a weight, F = g a^T + damping with g, a >= 0 and both with a 0
    entry (the minimum, normalised): 1 + max g * max a / damping."""
    for normalise in ("absolute", "relative"):
        opt = train(normalise, cls=cls)
        assert opt.normalise == normalise
        for name, layer in opt.collector.layers.items():
            fisher = torch.outer(layer.g, layer.a) + DAMPING
            ratio = (fisher.max() / fisher.min()).item()
            r_g, r_a = span(layer.g_ema), span(layer.a_ema)  # the raw EMAs' ranges
            assert r_g < 1e-8, name  # the premise: gradient statistics far below EPS
            if normalise == "absolute":
                peak = r_g / (r_g + EPS) * (r_a / (r_a + EPS))  # below 0.01: ratio < 11
            else:
                peak = (1 / (1 + EPS)) ** 2  # both factors reach 1 / (1 + 1e-6): ratio ~ 1001
            # float32: the normalisations, the product and the sum round a few times
            assert ratio == pytest.approx(1 + peak / DAMPING, rel=1e-5), (name, normalise)


def test_an_optimizer_pickled_without_the_setting_folds_as_published():
    opt = train("absolute", steps=1)
    state = opt.__getstate__()
    del state["normalise"]
    copy = AdaFisherW.__new__(AdaFisherW)
    copy.__setstate__(state)
    assert copy.normalise == "absolute"
