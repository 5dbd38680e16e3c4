"""Two-process DDP on CPU (gloo): parameters equal a one-process run on the global batch."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from hf_triaccel import AdaFisherW
from tests.optim.oracle import rounding_bound

GLOBAL_BATCH = 8
STEPS = 4


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5)
    )


def make_data():
    gen = torch.Generator().manual_seed(1)
    return [
        (
            torch.randn(GLOBAL_BATCH, 3, 6, 6, generator=gen),
            torch.randint(0, 5, (GLOBAL_BATCH,), generator=gen),
        )
        for _ in range(STEPS)
    ]


def train(model, forward_model, data, rank: int = 0, world: int = 1):
    opt = AdaFisherW.from_model(model, lr=1e-2, weight_decay=1e-3, update_every=2)
    share = GLOBAL_BATCH // world
    for x, y in data:
        xs, ys = x[rank * share : (rank + 1) * share], y[rank * share : (rank + 1) * share]
        F.cross_entropy(forward_model(xs), ys).backward()
        opt.step()
        opt.zero_grad()
    return opt


def _worker(rank: int, world: int, init_file: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        model = make_model()
        ddp = nn.parallel.DistributedDataParallel(model)
        opt = train(model, ddp, make_data(), rank, world)
        if rank == 0:
            torch.save(
                {
                    "params": [p.detach() for p in model.parameters()],
                    "factors": opt.collector.state_dict(),
                },
                out,
            )
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(300)
def test_two_process_ddp_matches_single_process(tmp_path):
    out = str(tmp_path / "ddp.pt")
    mp.spawn(_worker, args=(2, str(tmp_path / "init"), out), nprocs=2, join=True)
    ddp = torch.load(out, weights_only=True)

    single = make_model()
    opt = train(single, single, make_data())
    for name, layer in opt.collector.state_dict().items():
        torch.testing.assert_close(ddp["factors"][name]["a"], layer["a"], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(ddp["factors"][name]["g"], layer["g"], rtol=1e-5, atol=1e-7)
    # the all-reduce adds the two halves' gradients in another order than one backward:
    # the drift of two float32 trajectories, relative to each parameter's norm
    drift = rounding_bound(torch.float32, STEPS, 1e-3)
    for p_ddp, p in zip(ddp["params"], single.parameters(), strict=True):
        assert (p_ddp - p.detach()).norm() <= drift * p.norm()
    assert os.path.exists(out)
