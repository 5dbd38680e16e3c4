"""The fold's reference path against float64 hand computations, for both normalisations
(docs/design.md, "AdaFisher as implemented")."""

from __future__ import annotations

import pytest
import torch

from hf_triaccel.curvature.collection.fold import (
    FactorFold,
    fold_factors,
    fold_reference,
    minmax_normalise,
)
from hf_triaccel.curvature.rules.finish import FinishPlan, Mean, SquareMean

TINY = torch.finfo(torch.float32).tiny
ULP = 2.0**-24  # float32's unit roundoff: the relative error of one rounding
# from float32 inputs: x - min (one rounding), the denominator (the range, the constant
# 1e-6 or 1 + 1e-6 in float32, the sum or product: three) and the division (one)
RTOL = 5 * ULP


def by_hand(x: torch.Tensor, normalise: str) -> torch.Tensor:
    """Min-max normalisation in float64 over the finite entries; +inf -> 1, else 0."""
    x = x.double()
    finite = torch.isfinite(x)
    lo, hi = x[finite].min(), x[finite].max()
    if normalise == "absolute":
        out = (x - lo) / (hi - lo + 1e-6)
    else:
        out = (x - lo) / ((hi - lo) * (1 + 1e-6) + TINY)
    out = torch.where(finite, out, 0.0)
    return torch.where(x == float("inf"), 1.0, out)


def statistic(scale: float, n: int = 300, seed: int = 0) -> torch.Tensor:
    """Positive float32 values of about ``scale`` with +inf, -inf and NaN entries."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand(n, generator=gen, dtype=torch.float64).mul(scale).float()
    x[[5, 17, 40]] = torch.tensor([float("inf"), float("-inf"), float("nan")])
    return x


def assert_matches(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=RTOL, atol=0.0)


@pytest.mark.parametrize("normalise", ["absolute", "relative"])
@pytest.mark.parametrize("scale", [1.0, 1e-11])
def test_minmax_normalise_matches_float64(normalise, scale):
    x = statistic(scale)
    assert_matches(minmax_normalise(x, normalise), by_hand(x, normalise))


def test_a_tiny_range_reaches_one_only_relatively():
    """A statistic of range 1e-11 (squared gradients of a mean loss over a large batch):
    the published normalisation peaks at 1e-11 / (1e-11 + 1e-6) ~ 1e-5, the relative
    one at 1 / (1 + 1e-6)."""
    x = torch.tensor([3e-11, 4e-11, 3.5e-11, 2e-11, 1e-11])
    absolute = minmax_normalise(x, "absolute")
    relative = minmax_normalise(x, "relative")
    span = float(x.double().max() - x.double().min())  # the float32 values' range, ~3e-11
    assert absolute.max().item() == pytest.approx(span / (span + 1e-6), rel=RTOL)
    assert absolute.max().item() < 1e-4
    assert relative.max().item() == pytest.approx(1 / (1 + 1e-6), rel=RTOL)
    assert relative.max().item() < 1.0
    assert relative.min().item() == 0.0


@pytest.mark.parametrize("normalise", ["absolute", "relative"])
def test_a_constant_statistic_gives_zeros(normalise):
    for value in (0.0, 1e-30, 2.5):
        out = minmax_normalise(torch.full((7,), value), normalise)
        assert torch.equal(out, torch.zeros(7)), (value, out)


@pytest.mark.parametrize("normalise", ["absolute", "relative"])
def test_non_finite_entries(normalise):
    x = torch.tensor([1.0, float("inf"), 3.0, float("-inf"), float("nan"), 2.0])
    out = minmax_normalise(x, normalise)
    assert out[[1, 3, 4]].tolist() == [1.0, 0.0, 0.0]
    assert_matches(out, by_hand(x, normalise))
    nothing_finite = torch.tensor([float("inf"), float("nan"), float("-inf")])
    assert minmax_normalise(nothing_finite, normalise).tolist() == [1.0, 0.0, 0.0]


@pytest.mark.parametrize("normalise", ["absolute", "relative"])
@pytest.mark.parametrize("scale", [1.0, 1e-11])
def test_fold_reference_rule_matches_float64(normalise, scale):
    gamma = 0.8
    new = statistic(scale)
    ema = torch.rand(new.numel(), generator=torch.Generator().manual_seed(1))
    want = 0.1 * gamma * ema.double() + 0.01 * gamma * by_hand(new, normalise)
    used = torch.empty_like(ema)
    fold_reference(ema, new, used, "reference", gamma, normalise)
    # both terms positive: the two coefficients in float32, their products and the sum
    # add five roundings to the normalisation's
    torch.testing.assert_close(ema.double(), want, rtol=RTOL + 5 * ULP, atol=0.0)
    assert torch.equal(used, ema)


@pytest.mark.parametrize("normalise", ["absolute", "relative"])
@pytest.mark.parametrize("scale", [1.0, 1e-11])
def test_fold_paper_rule_matches_float64(normalise, scale):
    gamma = 0.8
    new = statistic(scale)[50:]  # the finite entries: an EMA of +-inf or NaN stays so
    ema = torch.rand(new.numel(), generator=torch.Generator().manual_seed(1)).mul(scale)
    want = gamma * ema.double() + (1 - gamma) * new.double()
    used = torch.empty_like(ema)
    fold_reference(ema, new, used, "paper", gamma, normalise)
    # both terms positive: two coefficients in float32, two products and the sum
    torch.testing.assert_close(ema.double(), want, rtol=5 * ULP, atol=0.0)
    # the normalisation of the float32 EMA the fold stored
    assert_matches(used, by_hand(ema, normalise))


@pytest.mark.parametrize("mode", ["reference", "paper"])
def test_fold_entry_points_pass_the_normalisation_on(mode):
    new = torch.tensor([1e-11, 3e-11, 2e-11])
    want_ema, want_used = torch.zeros(3), torch.zeros(3)
    fold_reference(want_ema, new, want_used, mode, 0.5, "relative")
    ema, used = torch.zeros(3), torch.zeros(3)
    FactorFold([ema], [new], [used], impl="reference")(mode, 0.5, "relative")
    assert torch.equal(ema, want_ema) and torch.equal(used, want_used)
    ema, used = torch.zeros(3), torch.zeros(3)
    fold_factors([ema], [new], [used], mode, 0.5, impl="reference", normalise="relative")
    assert torch.equal(ema, want_ema) and torch.equal(used, want_used)
    used = torch.zeros(3)
    fold_reference(torch.zeros(3), new, used, mode, 0.5)  # the default: the published rule
    assert used.max() < 1e-4 < want_used.max()


def test_unknown_normalisation_is_refused():
    x = torch.ones(3)
    with pytest.raises(ValueError, match="normalise='scaled' is not one of"):
        minmax_normalise(x, "scaled")
    with pytest.raises(ValueError, match="normalise='scaled'"):
        fold_reference(x, x, x, "reference", 0.5, "scaled")
    with pytest.raises(ValueError, match="normalise='scaled'"):
        FactorFold([x], [x], [x], impl="reference")("paper", 0.5, "scaled")
    with pytest.raises(ValueError, match="normalise='scaled'"):
        fold_factors([x], [x], [x], "paper", 0.5, normalise="scaled")


def test_a_finish_plan_follows_its_counts():
    """The multipliers of the last counts are kept for a step that counts the same: a
    step with other counts must not reuse them."""

    def finished(counts_seq):
        a, g = torch.tensor([3.0, 9.0, 0.0]), torch.tensor([3.0])
        plan = FinishPlan([(Mean(last=1.0), a, a), (SquareMean(), g, g)])
        for counts in counts_seq:
            a.copy_(torch.tensor([3.0, 9.0, 0.0]))
            g.copy_(torch.tensor([3.0]))
            plan(counts)
        return a, g

    for first, then in (([3.0, 3.0], [2.0, 4.0]), ([2.0, 4.0], [2.0, 4.0])):
        a, g = finished([first, then])
        fresh_a, fresh_g = finished([then])
        assert torch.equal(a, fresh_a) and torch.equal(g, fresh_g)
    assert torch.equal(finished([[3.0, 3.0], [2.0, 4.0]])[0], torch.tensor([1.5, 4.5, 1.0]))
