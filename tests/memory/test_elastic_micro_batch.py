"""AdaFisher trains the same whatever micro-batch the elastic batch picks: a run whose
micro-batch shrinks in the middle (an out-of-memory error at step 8 halves it twice and
re-runs the step) matches the run at a fixed micro-batch within 1e-5 relative after 20
steps, in float32, and both match the whole batch.

The model has the layers whose statistics square a batch sum (GroupNorm, LayerNorm) beside
a convolution and Linear layers; the factors are refreshed every 5 steps, the step of the
shrink among them, so the re-run step's statistics are rolled back
(``FisherStatisticsRollback``) and taken again in the new pieces.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hf_triaccel import AdaFisherW
from hf_triaccel.integrations.elastic import FisherStatisticsRollback
from hf_triaccel.memory import ElasticBatchController
from hf_triaccel.testing import CountingProbe, oom

E = 24
STEPS = 20
SHRINK_AT = 10  # a refresh step (update_every=5): its statistics are rolled back and retaken
UPDATE_EVERY = 5
LR = 1e-3  # the step size the tolerances below were derived at: they scale with it
RTOL = 1e-5


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.gn = nn.GroupNorm(2, 6)
        self.fc = nn.Linear(6 * 16, 10)
        self.ln = nn.LayerNorm(10)
        self.head = nn.Linear(10, 4)
        self.limit = E  # pieces larger than this raise an out-of-memory error

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if len(x) > self.limit:
            raise oom()
        h = torch.tanh(self.gn(self.conv(x))).flatten(1)
        return self.head(torch.tanh(self.ln(self.fc(h))))


def batches():
    gen = torch.Generator().manual_seed(4)
    for _ in range(STEPS):
        yield torch.randn(E, 3, 4, 4, generator=gen), torch.randint(0, 4, (E,), generator=gen)


def run(micro_batch: int | None, shrink: bool = False):
    """Parameters after the run, with the controller's events; ``micro_batch=None``: the
    whole batch in one backward, no controller."""
    model = Net()
    opt = AdaFisherW.from_model(model, lr=LR, update_every=UPDATE_EVERY, ema="reference")
    controller = None
    if micro_batch is not None:
        controller = ElasticBatchController(E, max_micro_batch=micro_batch, probe=CountingProbe())
    rollbacks = [FisherStatisticsRollback(opt.collector)]
    for step, (x, y) in enumerate(batches()):
        if shrink and step == SHRINK_AT:
            model.limit = 7  # from here on, only pieces of 7 or fewer fit: 24 -> 12 -> 6
        if controller is None:
            F.cross_entropy(model(x), y).backward()
        else:
            loss_fn = lambda piece: F.cross_entropy(model(piece[0]), piece[1])  # noqa: E731
            controller.run_step((x, y), loss_fn, model=model, rollbacks=rollbacks)
        opt.step()
        opt.zero_grad()
    events = [] if controller is None else [(e.step, e.new, e.reason) for e in controller.events]
    return [p.detach() for p in model.parameters()], events


@pytest.fixture(scope="module")
def fixed():
    return run(micro_batch=10)[0]  # pieces of 8: the controller balances 24 over 3


def assert_matches(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for p, q in zip(got, want, strict=True):
        torch.testing.assert_close(p, q, rtol=0.0, atol=RTOL * float(q.abs().max()))


def test_a_shrinking_micro_batch_trains_as_a_fixed_one(fixed):
    params, events = run(micro_batch=E, shrink=True)
    assert events == [(SHRINK_AT, 12, "oom"), (SHRINK_AT, 6, "oom")]
    assert_matches(params, fixed)


def test_the_fixed_micro_batch_trains_as_the_whole_batch(fixed):
    assert_matches(fixed, run(micro_batch=None)[0])
