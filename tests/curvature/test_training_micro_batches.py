"""The same training at any micro-batch: AdaFisherW on a float64 model, once on whole
batches and once on the same batches in 2 or 4 micro-batches (each loss weighted by its
share, gradients accumulated), refreshed every 5 steps for 12 steps.

After every fold the factors agree within the float32 rounding of
:mod:`tests.curvature.rounding`, and after 12 steps the parameters within 1e-6 relative.
(The bounds are those of the same inputs; the two runs' inputs also differ by their
parameters' drift, about 1e-10 relative here, far below them.)
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hf_triaccel import AdaFisherW
from tests.curvature.rounding import FactorBound, Recorder

BATCH = 16
STEPS = 12
UPDATE_EVERY = 5
LR = 1e-3  # the step size the tolerances below were derived at: they scale with it


class Net(nn.Module):
    """Conv and GroupNorm on images, Embedding and LayerNorm over tokens, Linear and
    LayerNorm on their features: every rule whose statistic squares a batch sum."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.gn = nn.GroupNorm(2, 6)
        self.emb = nn.Embedding(11, 8)
        self.ln_tokens = nn.LayerNorm(8)
        self.fc = nn.Linear(6 * 16 + 8, 12)
        self.ln = nn.LayerNorm(12)
        self.head = nn.Linear(12, 3)

    def forward(self, img: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.gn(self.conv(img))).flatten(1)
        t = self.ln_tokens(self.emb(tok)).mean(1)
        return self.head(torch.tanh(self.ln(self.fc(torch.cat([h, t], 1)))))


class BatchNormNet(nn.Module):
    """Conv, BatchNorm (run in eval mode: its running statistics) and a Linear head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.bn = nn.BatchNorm2d(6)
        self.head = nn.Linear(6 * 16, 3)
        self.bn.running_mean.uniform_(-0.5, 0.5)
        self.bn.running_var.uniform_(0.5, 2.0)

    def forward(self, img: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.bn(self.conv(img))).flatten(1))


def batches():
    gen = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        yield (
            torch.randn(BATCH, 3, 4, 4, generator=gen, dtype=torch.float64),
            torch.randint(0, 11, (BATCH, 5), generator=gen),
            torch.randint(0, 3, (BATCH,), generator=gen),
        )


def train(model: nn.Module, pieces: tuple[int, ...], ema: str, record: bool = False):
    """Trains ``model`` and returns its factors after each refresh, with (``record``) the
    factors' rounding bounds, as the list ``[(factors, bounds)]`` per refresh."""
    opt = AdaFisherW.from_model(model, lr=LR, update_every=UPDATE_EVERY, ema=ema, impl="reference")
    collector = opt.collector
    recorder = Recorder(collector) if record else None
    tracked = {(name, i): FactorBound(ema) for name in collector.layers for i in range(2)}
    folds = []
    for img, tok, y in batches():
        refresh = collector.collecting
        if recorder is not None:
            recorder.clear()
        start = 0
        for n in pieces:
            part = slice(start, start + n)
            (F.cross_entropy(model(img[part], tok[part]), y[part]) * n / BATCH).backward()
            start += n
        bounds = recorder.bounds() if recorder is not None and refresh else None
        opt.step()
        opt.zero_grad()
        if not refresh:
            continue
        factors, atols = {}, {}
        for name, ly in collector.layers.items():
            factors[name] = (ly.a.clone(), ly.g.clone())
            if bounds is not None:
                stats, emas = (ly.a_stat, ly.g_stat), (ly.a_ema, ly.g_ema)
                atols[name] = tuple(
                    tracked[name, i].fold(stats[i], bounds[name][i], emas[i]) for i in range(2)
                )
        folds.append((factors, atols))
    if recorder is not None:
        recorder.remove()
    collector.remove()
    return folds


def check_runs(net_cls: type[nn.Module], pieces: tuple[int, ...], ema: str) -> None:
    whole_model, split_model = net_cls().double(), net_cls().double()
    if net_cls is BatchNormNet:
        whole_model.eval()
        split_model.eval()
    whole = train(whole_model, (BATCH,), ema, record=True)
    split = train(split_model, pieces, ema)
    assert len(whole) == len(split) == 3  # refreshes at steps 0, 5 and 10
    for k, ((factors, atols), (got, _)) in enumerate(zip(whole, split, strict=True)):
        for name, pair in factors.items():
            for i, factor in enumerate(pair):
                torch.testing.assert_close(
                    got[name][i], factor, rtol=0, atol=atols[name][i], msg=f"{name}, fold {k}"
                )
    with torch.no_grad():
        pairs = zip(whole_model.named_parameters(), split_model.parameters(), strict=True)
        gaps = {name: float((p - q).abs().max() / p.abs().max()) for (name, p), q in pairs}
    for name, gap in gaps.items():
        assert gap <= 1e-6, f"{name}: {gap:.2e}"


@pytest.mark.parametrize("ema", ["reference", "paper"])
@pytest.mark.parametrize("pieces", [(8, 8), (4, 4, 4, 4), (11, 5)], ids=str)
def test_whole_and_micro_batched_training_agree(pieces, ema):
    check_runs(Net, pieces, ema)


@pytest.mark.parametrize("ema", ["reference", "paper"])
def test_batchnorm_in_eval_mode_trains_the_same_at_any_micro_batch(ema):
    """With its running statistics BatchNorm is a per-sample map: exact as any other layer
    (in training mode it normalises each micro-batch by its own statistics: see
    test_micro_batches.py)."""
    check_runs(BatchNormNet, (5, 11), ema)
