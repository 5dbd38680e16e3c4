"""The factor slice of a parameter's local rows: for every built-in rule and every split
of the rows over 1 to 4 processes (as FSDP2 splits them, empty shards included), the
preconditioner of the local shard, and one AdaFisher step on it with each implementation,
equal the matching rows of the whole parameter's."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from hf_triaccel._types import FactorLayout, ParamFactors
from hf_triaccel.curvature.collection.sharding import local_factors, local_rows
from hf_triaccel.curvature.collector import FisherCollector
from hf_triaccel.optim.functional import adafisher, preconditioner


def conv1d_hf() -> nn.Module:
    from transformers.pytorch_utils import Conv1D

    return Conv1D(5, 3)  # weight stored (in=3, out=5)


MODULES = {
    "linear": lambda: nn.Linear(4, 7),
    "conv": lambda: nn.Conv2d(3, 5, 3, groups=1),
    "grouped_conv": lambda: nn.Conv2d(4, 6, 3, groups=2),
    "embedding": lambda: nn.Embedding(9, 4),
    "layer_norm": lambda: nn.LayerNorm(5),
    "group_norm": lambda: nn.GroupNorm(2, 6),
    "batch_norm": lambda: nn.BatchNorm2d(5),
    "hf_conv1d": conv1d_hf,
}


def chunks(rows: int, world: int) -> list[tuple[int, int]]:
    """torch.chunk's split of ``rows`` rows over ``world`` processes, as FSDP2 shards."""
    size = math.ceil(rows / world)
    return [(min(r * size, rows), min((r + 1) * size, rows)) for r in range(world)]


def seeded_factors(module: nn.Module) -> dict[nn.Parameter, ParamFactors]:
    """The module's factors, filled with distinct values so that a wrong index shows."""
    collector = FisherCollector(module, impl="reference")
    for layer in collector.layers.values():
        for t in (layer.a, layer.g):
            t.copy_(torch.rand(t.shape, generator=torch.Generator().manual_seed(t.numel())) + 0.5)
    factors = collector.param_factors()
    collector.detach()
    return factors


@pytest.mark.parametrize("kind", sorted(MODULES))
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_local_preconditioner_is_the_rows_of_the_full_one(kind, world):
    torch.manual_seed(0)
    module = MODULES[kind]()
    for p, full in seeded_factors(module).items():
        whole = preconditioner(p, full, 1e-3)
        for rows in chunks(p.shape[0], world):
            shard = p.detach()[rows[0] : rows[1]]
            local = local_factors(full, p.shape, rows)
            got = preconditioner(shard, local, 1e-3)
            assert torch.equal(got, whole[rows[0] : rows[1]]), (kind, rows)
            # views of the full vectors: a fold reaches them
            assert local.g.untyped_storage().data_ptr() == full.g.untyped_storage().data_ptr()
            assert local.a.untyped_storage().data_ptr() == full.a.untyped_storage().data_ptr()


@pytest.mark.parametrize("impl", ["reference", "foreach", "triton"])
def test_a_step_on_the_shards_is_the_step_on_the_whole(impl):
    """The fused kernel (under Triton's CPU interpreter here) and the foreach path take the
    sliced factor views, offsets included; an empty shard is a no-op."""
    torch.manual_seed(0)
    modules = [MODULES[k]() for k in ("linear", "embedding", "layer_norm", "hf_conv1d")]
    factors = {p: f for m in modules for p, f in seeded_factors(m).items()}
    params = list(factors)
    grads = [torch.randn_like(p) for p in params]
    hyper = dict(lr=0.1, beta=0.9, weight_decay=0.01, damping=1e-3, decoupled=True)
    whole = [p.detach().clone() for p in params]
    moms = [torch.full_like(p, 0.1) for p in params]
    steps = [torch.tensor(3.0) for _ in params]
    adafisher(whole, grads, moms, [factors[p] for p in params], steps, impl=impl, **hyper)
    for world in (3, 4):
        for r in range(world):
            shards, g_shards, m_shards, f_shards = [], [], [], []
            for p, g in zip(params, grads, strict=True):
                start, stop = chunks(p.shape[0], world)[r]
                shards.append(p.detach()[start:stop].clone())
                g_shards.append(g[start:stop])
                m_shards.append(torch.full_like(shards[-1], 0.1))
                f_shards.append(local_factors(factors[p], p.shape, (start, stop)))
            steps = [torch.tensor(3.0) for _ in params]
            adafisher(shards, g_shards, m_shards, f_shards, steps, impl=impl, **hyper)
            for shard, p, w in zip(shards, params, whole, strict=True):
                start, stop = chunks(p.shape[0], world)[r]
                torch.testing.assert_close(shard, w[start:stop], rtol=1e-6, atol=1e-7)


def test_a_layout_that_does_not_split_by_rows_is_refused():
    # one a entry per pair of rows: a shard starting at an odd row cannot be a slice
    lay = FactorLayout(g_div=1, g_mod=1, a_div=6, a_mod=2)
    full = ParamFactors(torch.ones(1), torch.ones(2), lay)
    with pytest.raises(ValueError, match="does not split by rows"):
        local_factors(full, (4, 3), (1, 3))


def test_an_ordinary_tensor_holds_every_row():
    assert local_rows(torch.zeros(5, 3)) is None
