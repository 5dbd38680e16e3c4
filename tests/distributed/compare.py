"""Comparing a data-parallel run with one process on the global batch taken whole.

Both runs take the same float32 statistics from the same samples, added in another order:
one process sums each entry's terms in one reduction, the processes sum their shares and
the all-reduce adds the partial sums. Where a statistic squares a sum of signed gradients
(the normalisation layers' ``g``) the terms may cancel, and the worst-case bound on
reordering (``tests/curvature/rounding.py``) is then far looser than the error it bounds:
of no use over a run of many steps. Each statistic is held to that bound, fold by fold,
against its whole batch in ``tests/curvature``; a run here is held to the acceptance
tolerance of several processes against one: every tensor within ``RTOL`` of its largest
entry. (Statistics taken per share and averaged, as before the sums were added over the
processes, moved a 12-step run by 4e-2 relative.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from hf_triaccel.testing import run_distributed

RTOL = 1e-4


def assert_matches(got: list[torch.Tensor], want: list[torch.Tensor], what: str) -> None:
    """Every tensor of ``got`` within ``RTOL`` of the largest entry of its match in
    ``want``."""
    assert len(got) == len(want), what
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        b = b.detach()
        atol = RTOL * float(b.abs().max())
        torch.testing.assert_close(a, b, rtol=0.0, atol=atol, msg=f"{what}, tensor {i}")


def spawns_per_world(
    worker: Callable[[int, int], Any], factory: pytest.TempPathFactory, name: str
) -> Callable[[int], list[Any]]:
    """``get(world)``: what every rank of ``worker`` returned in a spawn of ``world``
    processes, spawned once per world size (a module fixture returns it)."""
    runs: dict[int, list[Any]] = {}

    def get(world: int) -> list[Any]:
        if world not in runs:
            runs[world] = run_distributed(worker, world, factory.mktemp(name))
        return runs[world]

    return get
