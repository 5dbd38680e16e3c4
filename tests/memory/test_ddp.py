"""Two processes (gloo, CPU): ranks agree on the micro-batch, and an OOM re-run on one
rank under DDP keeps the collectives matched and the result equal to one process on the
global batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hf_triaccel.memory.elastic import ElasticBatchController
from hf_triaccel.memory.probe import NullProbe
from hf_triaccel.testing import oom, run_distributed

GLOBAL_BATCH = 16
STEPS = 4


class Model(nn.Module):
    """An MLP with a buffer (so DDP broadcasts buffers in the first forward of a step)
    and an injectable OOM in its forward, after DDP's own pre-forward work."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3)).double()
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 6, dtype=torch.float64))
        self.limit = GLOBAL_BATCH
        self.fail_next = False

    def forward(self, x):
        if x.shape[0] > self.limit or self.fail_next:
            self.fail_next = False
            raise oom()
        return self.net(x * self.scale)


def make_data():
    gen = torch.Generator().manual_seed(3)
    return [
        (
            torch.randn(GLOBAL_BATCH, 6, generator=gen, dtype=torch.float64),
            torch.randint(0, 3, (GLOBAL_BATCH,), generator=gen),
        )
        for _ in range(STEPS)
    ]


def _worker(rank: int, world: int) -> dict:
    agreed = ElasticBatchController(16, probe=NullProbe()).agree([12, 5][rank])
    model = Model()
    ddp = nn.parallel.DistributedDataParallel(model)
    share = GLOBAL_BATCH // world
    ctrl = ElasticBatchController(share, probe=NullProbe(), check_every=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step, (x, y) in enumerate(make_data()):
        if rank == 1:
            model.limit = 4 if step == 0 else share  # rank 1 shrinks alone at step 0
            model.fail_next = step == 2  # first forward of step 2 fails once
        batch = {
            "x": x[rank * share : (rank + 1) * share],
            "y": y[rank * share : (rank + 1) * share],
        }
        ctrl.run_step(batch, lambda p: F.cross_entropy(ddp(p["x"]), p["y"]), model=ddp)
        opt.step()
        opt.zero_grad()
    return {
        "agreed": agreed,
        "events": [(e.step, e.old, e.new, e.reason) for e in ctrl.events],
        "params": [p.detach().clone() for p in model.parameters()],
    }


@pytest.mark.timeout(120)
def test_two_ranks_agree_and_match_one_process(tmp_path):
    ranks = run_distributed(_worker, 2, tmp_path)
    assert [r["agreed"] for r in ranks] == [5, 5]
    # rank 1 halves on its OOMs; rank 0 follows at the check that ends the step
    assert ranks[1]["events"] == [(0, 8, 4, "oom"), (2, 4, 2, "oom")]
    assert ranks[0]["events"] == [(0, 8, 4, "agree"), (2, 4, 2, "agree")]

    single = Model()
    opt = torch.optim.SGD(single.parameters(), lr=0.1, momentum=0.9)
    for x, y in make_data():
        F.cross_entropy(single(x), y).backward()
        opt.step()
        opt.zero_grad()
    for rank in ranks:
        for p, q in zip(rank["params"], single.parameters(), strict=True):
            torch.testing.assert_close(p, q.detach(), rtol=1e-10, atol=1e-12)
