"""Two processes (gloo): an overflow seen by one process moves the module on both."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from hf_triaccel.precision import PrecisionController, PrecisionPolicy


def _worker(rank: int, world: int, init_file: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        model = nn.Linear(4, 4, bias=False)
        with torch.no_grad():
            model.weight.fill_(100.0)
        controller = PrecisionController(model, PrecisionPolicy(rules=[("", "fp16")]))
        scale = 1000.0 if rank == 0 else 0.01  # only rank 0 overflows
        model(torch.full((2, 4), scale))
        controller.check_overflow(step=1)
        torch.save(controller.state_dict(), f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_overflow_decisions_agree_across_processes(tmp_path):
    out = str(tmp_path / "state")
    mp.spawn(_worker, args=(2, str(tmp_path / "init"), out), nprocs=2, join=True)
    states = [torch.load(f"{out}.{rank}", weights_only=True) for rank in range(2)]
    assert states[0] == states[1]
    assert states[0]["decisions"] == {"": "bf16"}
    assert states[0]["overflowed"] == [""]
