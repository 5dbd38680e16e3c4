"""Every Fisher rule gives, after every fold, the same factors from a whole batch as from
that batch split into k micro-batches (k = 2 and 3, even and uneven pieces), under both EMA
rules with the default gamma: within the float32 rounding of :mod:`tests.curvature.rounding`.

Each case runs one module under a collector, fed the same inputs and the same output
gradients per sample, whole or in pieces, for three refreshes with new data each. That
covers the statistics themselves: a statistic is a function of the layer's input and
output gradient. (In a network, BatchNorm in training mode normalises each micro-batch by
its own statistics, which changes its output and every gradient: see
``test_acceptance.py`` for what holds there.)
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from hf_triaccel.curvature.collector import FisherCollector
from hf_triaccel.curvature.rules import a_statistic, g_statistic
from tests.curvature.rounding import GAMMA, FactorBound, Recorder

BATCH = 12
SPLITS = [(6, 6), (9, 3), (4, 4, 4), (2, 7, 3)]
FOLDS = 3

pytestmark = pytest.mark.filterwarnings("ignore:Using padding='same':UserWarning")


def _hf_conv1d():
    from transformers.pytorch_utils import Conv1D

    return Conv1D(6, 5)


def _timm(name: str, *args, **kwargs):
    import timm.layers

    return getattr(timm.layers, name)(*args, **kwargs)


def _convnext_norm():
    from transformers.models.convnext.modeling_convnext import ConvNextLayerNorm

    return ConvNextLayerNorm(4, data_format="channels_first")


def images(*shape):
    return lambda n, gen: torch.randn(n, *shape, generator=gen)


def tokens(vocab: int, length: int):
    return lambda n, gen: torch.randint(0, vocab, (n, length), generator=gen)


def channels_last(n, gen):
    return torch.randn(n, 4, 7, 6, generator=gen).contiguous(memory_format=torch.channels_last)


# name -> (module factory, input of n samples, whether to run the module in eval mode)
CASES = {
    "linear": (lambda: nn.Linear(5, 4), images(5), False),
    "linear_tokens": (lambda: nn.Linear(5, 4), images(3, 5), False),
    "linear_no_bias": (lambda: nn.Linear(5, 4, bias=False), images(5), False),
    "hf_conv1d": (_hf_conv1d, images(3, 5), False),
    "conv1d": (lambda: nn.Conv1d(3, 4, 3, stride=2, padding=1), images(3, 9), False),
    "conv2d": (lambda: nn.Conv2d(4, 6, 3, padding=1, groups=2), images(4, 7, 6), False),
    "conv2d_strided": (lambda: nn.Conv2d(4, 5, (3, 2), 2, dilation=(1, 2)), images(4, 7, 6), False),
    "conv2d_channels_last": (lambda: nn.Conv2d(4, 5, 3, padding=1), channels_last, False),
    "conv3d": (lambda: nn.Conv3d(2, 3, 2, padding=1), images(2, 3, 4, 3), False),
    "timm_conv2d_same": (lambda: _timm("Conv2dSame", 3, 4, 3, 2), images(3, 8, 6), False),
    "timm_std_conv2d_same": (lambda: _timm("StdConv2dSame", 3, 4, 3, 2), images(3, 8, 6), False),
    "batchnorm1d": (lambda: nn.BatchNorm1d(4), images(4), False),
    "batchnorm2d": (lambda: nn.BatchNorm2d(4), images(4, 5, 3), False),
    "timm_batchnormact2d": (lambda: _timm("BatchNormAct2d", 4), images(4, 5, 3), True),
    "groupnorm": (lambda: nn.GroupNorm(2, 4), images(4, 5, 3), False),
    "layernorm": (lambda: nn.LayerNorm(6), images(6), False),
    "layernorm_tokens": (lambda: nn.LayerNorm(6), images(5, 6), False),
    "layernorm_2d_shape": (lambda: nn.LayerNorm((5, 6)), images(5, 6), False),
    "rmsnorm_tokens": (lambda: nn.RMSNorm(6), images(5, 6), False),
    "timm_layernorm2d": (lambda: _timm("LayerNorm2d", 4), images(4, 5, 3), False),
    "convnext_layernorm": (_convnext_norm, images(4, 5, 3), False),
    "embedding": (lambda: nn.Embedding(11, 4), tokens(11, 5), False),
}


def run_folds(module, pieces, data, ema, impl="reference"):
    """Factors ``(a, g)`` after each fold, the module fed each fold's ``(x, dy)`` in
    ``pieces``, with the whole batch's recorded statistics and bounds."""
    collector = FisherCollector(module, ema=ema, impl=impl)
    recorder = Recorder(collector)
    layer = collector.layers[""]
    out = []
    for x, dy in data:
        start = 0
        for n in pieces:
            module(x[start : start + n]).backward(dy[start : start + n])
            start += n
        (da, dg) = recorder.bounds()[""]
        collector.fold(GAMMA)
        out.append(
            {
                "factors": (layer.a.clone(), layer.g.clone()),
                "emas": (layer.a_ema.clone(), layer.g_ema.clone()),
                "stats": (layer.a_stat.clone(), layer.g_stat.clone()),
                "bounds": (da, dg),
            }
        )
    collector.remove()
    recorder.remove()
    return out


def make_data(factory, make_input, eval_mode, seed):
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    module = factory()
    module.train(not eval_mode)
    data = []
    for _ in range(FOLDS):
        x = make_input(BATCH, gen)
        with torch.no_grad():
            y = copy.deepcopy(module)(x)
        data.append((x, torch.randn(y.shape, generator=gen)))
    return module, data


def check_equal_factors(whole, split, ema):
    bounds = [FactorBound(ema), FactorBound(ema)]
    for fold, (w, s) in enumerate(zip(whole, split, strict=True)):
        for i, name in enumerate("ag"):
            atol = bounds[i].fold(w["stats"][i], w["bounds"][i], w["emas"][i])
            torch.testing.assert_close(
                s["factors"][i], w["factors"][i], rtol=0, atol=atol, msg=f"{name} of fold {fold}"
            )


@pytest.mark.parametrize("ema", ["reference", "paper"])
@pytest.mark.parametrize("case", list(CASES))
def test_whole_batch_and_micro_batches_give_the_same_factors(case, ema):
    factory, make_input, eval_mode = CASES[case]
    module, data = make_data(factory, make_input, eval_mode, seed=sum(map(ord, case)))
    whole = run_folds(copy.deepcopy(module), (BATCH,), data, ema)
    for pieces in SPLITS:
        split = run_folds(copy.deepcopy(module), pieces, data, ema)
        check_equal_factors(whole, split, ema)


@pytest.mark.parametrize("case", ["linear_tokens", "conv2d", "batchnorm2d", "layernorm_tokens"])
def test_triton_statistics_of_micro_batches(case):
    """The Triton kernels (under the CPU interpreter) accumulate the same sums."""
    pytest.importorskip("triton")
    factory, make_input, eval_mode = CASES[case]
    module, data = make_data(factory, make_input, eval_mode, seed=7)
    whole = run_folds(copy.deepcopy(module), (BATCH,), data, "paper", impl="reference")
    split = run_folds(copy.deepcopy(module), (5, 7), data, "paper", impl="triton")
    check_equal_factors(whole, split, "paper")


def test_the_old_average_over_micro_batches_is_caught():
    """The bounds are tight enough to see what this file guards against: squaring each
    micro-batch's sum, or weighting micro-batches equally, moves the factors further."""
    module, data = make_data(*CASES["groupnorm"], seed=3)
    whole = run_folds(copy.deepcopy(module), (BATCH,), data, "paper")
    dy = data[0][1].double()
    old = (dy[:9].sum((0, 2, 3)) ** 2 / 9 + dy[9:].sum((0, 2, 3)) ** 2 / 3) / 2
    gap = float((old - dy.sum((0, 2, 3)) ** 2 / BATCH).abs().max())
    assert gap > 10 * whole[0]["bounds"][1]
    linear, data = make_data(*CASES["linear"], seed=4)
    whole = run_folds(copy.deepcopy(linear), (BATCH,), data, "paper")
    x = data[0][0].double()
    old = (x[:9].square().mean(0) + x[9:].square().mean(0)) / 2
    gap = float((old - x.square().mean(0)).abs().max())
    assert gap > 10 * whole[0]["bounds"][0]


def test_batchnorm_in_training_mode_changes_the_model_not_the_rule():
    """In training mode BatchNorm normalises each micro-batch by its own mean and variance:
    split, a network computes other outputs and gradients than whole (as it would without
    AdaFisher). The statistics still follow the rule exactly: the factors of the split run
    are the statistics of the inputs and output gradients that run produced."""
    torch.manual_seed(5)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
    x, w = torch.randn(BATCH, 3, 5, 5), torch.randn(BATCH, 4, 5, 5)
    grads = []
    for pieces in ((BATCH,), (7, 5)):
        net = copy.deepcopy(model)
        collector = FisherCollector(net, impl="reference")
        recorder = Recorder(collector)
        start = 0
        for n in pieces:
            (net(x[start : start + n]) * w[start : start + n]).sum().backward()
            start += n
        seen = recorder.seen
        bounds = recorder.bounds()
        for name, layer in collector.layers.items():
            a, g = layer.statistics()
            xs, dys = seen[name]
            da, dg = bounds[name]
            torch.testing.assert_close(
                a, a_statistic(layer.rule, layer.module, xs), rtol=0, atol=da
            )
            torch.testing.assert_close(
                g, g_statistic(layer.rule, layer.module, dys), rtol=0, atol=dg
            )
        grads.append(net[0].weight.grad)
    assert not torch.allclose(grads[0], grads[1], rtol=1e-3)


def test_uneven_micro_batches_are_weighted_by_samples():
    """410 + 102 samples: each piece counts by its samples, as the whole batch does."""
    lin = nn.Linear(3, 2)
    collector = FisherCollector(lin, impl="reference")
    x = torch.cat([torch.ones(410, 3), 3 * torch.ones(102, 3)])
    for piece in (x[:410], x[410:]):
        lin(piece).sum().backward()
    a, g = collector.layers[""].statistics()
    expected = (410 * 1.0 + 102 * 9.0) / 512
    torch.testing.assert_close(a, torch.tensor([expected] * 3 + [1.0]))
    torch.testing.assert_close(g, torch.ones(2))


def _norm_a(pieces: list[torch.Tensor], positions: int) -> torch.Tensor:
    """A LayerNorm's ``a`` over pieces of (B_j, T_j, D) inputs: per-position sums (wrapped
    modulo ``positions``, shorter pieces adding to the first positions), then squared."""
    sums = torch.zeros(positions, dtype=torch.float64)
    n = sum(len(x) for x in pieces)
    for x in pieces:
        u = x.double().sum((0, 2)) / x.shape[2] ** 2
        sums.index_add_(0, torch.arange(len(u)) % positions, u)
    mean_length = sum(len(x) * x.shape[1] for x in pieces) / n
    return torch.stack([(sums / n).square().sum(), torch.tensor(mean_length / n**2)])


@pytest.mark.parametrize("wrap", [False, True])
def test_sequences_of_several_lengths(wrap, monkeypatch):
    """Pieces of different lengths add position by position, the shorter zero-padded, and
    the size entry takes the mean length; past ``POSITIONS`` positions wrap around."""
    from hf_triaccel.curvature.rules import norm

    positions = 4 if wrap else norm.POSITIONS
    monkeypatch.setattr(norm, "POSITIONS", positions)
    ln = nn.LayerNorm(3)  # fewer features than positions: the positions are POSITIONS
    collector = FisherCollector(ln, impl="reference")
    gen = torch.Generator().manual_seed(8)
    pieces = [torch.randn(3, 7, 3, generator=gen), torch.randn(5, 2, 3, generator=gen)]
    for x in pieces:
        ln(x).sum().backward()
    a, _ = collector.layers[""].statistics()
    torch.testing.assert_close(a.double(), _norm_a(pieces, positions), rtol=1e-6, atol=0)
