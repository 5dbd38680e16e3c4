"""The ``foreach`` path's broadcast preconditioner against the index-arithmetic one."""

from __future__ import annotations

import pytest
import torch

from hf_triaccel._types import FactorLayout, ParamFactors
from hf_triaccel.curvature.collection.sharding import local_factors
from hf_triaccel.curvature.rules.base import in_out_layout, out_in_layout, per_entry_layout
from hf_triaccel.optim.functional import broadcast_preconditioner, preconditioner

DAMPING = 1e-3


def _factors(layout: FactorLayout, g_len: int, a_len: int, seed: int = 0) -> ParamFactors:
    gen = torch.Generator().manual_seed(seed)
    return ParamFactors(torch.rand(g_len, generator=gen), torch.rand(a_len, generator=gen), layout)


CASES = {
    "linear weight": ((5, 3), out_in_layout(5, 3), 5, 3),
    "conv weight": ((4, 3, 3, 3), out_in_layout(4, 27), 4, 28),
    "conv bias": ((4,), per_entry_layout(4, 27), 4, 28),
    "norm bias": ((6,), per_entry_layout(6, 1), 6, 2),
    "embedding": ((7, 4), in_out_layout(7, 4), 4, 7),
    "one element": ((1,), per_entry_layout(1, 0), 1, 1),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_broadcast_equals_index_arithmetic(name):
    shape, layout, g_len, a_len = CASES[name]
    param, factors = torch.zeros(shape), _factors(layout, g_len, a_len)
    fast = broadcast_preconditioner(param, factors, DAMPING)
    # the same products and sums, so the same values, in the parameter's shape
    assert fast.shape == param.shape
    assert torch.equal(fast, preconditioner(param, factors, DAMPING))
    as64 = broadcast_preconditioner(param, factors, DAMPING, torch.float64)
    assert torch.equal(as64, preconditioner(param, factors, DAMPING, torch.float64))


def test_shard_layouts_broadcast_too():
    """Rows of a sharded weight: a factor repeating within each row, or one entry a row."""
    full = _factors(out_in_layout(6, 4), 6, 4)
    for shape, rows in (((6, 4), (2, 5)), ((6, 2, 2), (0, 1))):
        shard = torch.zeros(rows[1] - rows[0], *shape[1:])
        local = local_factors(full, shape, rows)
        assert torch.equal(
            broadcast_preconditioner(shard, local, DAMPING),
            preconditioner(shard, local, DAMPING),
        )


def test_standard_layouts_build_no_index_tensors(monkeypatch):
    def refuse(self, numel, device):
        raise AssertionError("per-element indices built")

    monkeypatch.setattr(FactorLayout, "indices", refuse)
    shape, layout, g_len, a_len = CASES["conv weight"]
    assert broadcast_preconditioner(torch.zeros(shape), _factors(layout, g_len, a_len), 0.0).shape
    assert broadcast_preconditioner(torch.zeros(3), None, DAMPING) is None


def test_a_layout_without_a_broadcast_form_uses_the_indices():
    # g over k // 2 (period 6), a over k // 3 (period 6): 2 does not divide 3
    layout = FactorLayout(g_div=2, g_mod=3, a_div=3, a_mod=2)
    param, factors = torch.zeros(2, 3), _factors(layout, 3, 2)
    got = broadcast_preconditioner(param, factors, DAMPING)
    k = torch.arange(6)
    expected = factors.g[k // 2] * factors.a[k // 3] + DAMPING
    assert torch.equal(got, expected.view(2, 3))
