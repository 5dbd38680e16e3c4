"""AdaFisher under FSDP2 (torch's ``fully_shard``) in 2 and 3 CPU processes joined by gloo.

One spawn per world size runs everything that needs the process group: a 250-step sharded
run compared with one process on the global batch taken whole, a checkpoint at step 190 through
``torch.distributed.checkpoint`` resumed in fresh objects, the all-reduce count of every
optimizer step, what the hooks see, a bf16 mixed-precision run and the row ranges of
replicated and refused placements.

The model has an Embedding (7 rows), a Conv2d (5 output channels) and a GroupNorm in a
block checkpointed as FSDP2 recipes do (torch's ``checkpoint_wrapper``), a Linear (9 rows)
sharded as its own FSDP unit, a LayerNorm left out of the sharding (``ignored_params``:
plain tensors in the same optimizer) and a Linear head with 2 rows: every split is uneven,
and over 3 processes the last one holds no row of the head.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hf_triaccel import AdaFisherW
from hf_triaccel.curvature.collection.sharding import local_rows
from tests.distributed.compare import assert_matches, spawns_per_world

GLOBAL_BATCH = 12
STEPS = 250
SAVE_AT = 190
UPDATE_EVERY = 50  # refreshes at steps 0, 50, 100, 150, 200: the resumed run makes one
# Per world size, one EMA rule. In both, lr / F <= 0.1 keeps the run contracting, so that
# rounding differences do not grow, and the factor product g * a spans most of F, so that
# a wrong slice of the factors would show: with ema="paper" g and a lie in [0, 1] (F in
# [0.1, 1.1]); with ema="reference" they settle near 0.01 * gamma / (1 - 0.1 * gamma) <
# 0.0087 (F in [1e-5, 8.6e-5]).
HYPER = {
    2: dict(ema="paper", lr=1e-2, damping=0.1),
    3: dict(ema="reference", lr=1e-6, damping=1e-5),
}
COMMON = dict(weight_decay=1e-2, update_every=UPDATE_EVERY, impl="foreach")
DTYPE = torch.float64


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(7, 6)
        self.block = nn.Sequential(nn.Conv2d(3, 5, 3, padding=1), nn.GroupNorm(1, 5))
        self.fc = nn.Linear(5 * 16 + 6, 9)
        self.ln = nn.LayerNorm(9)
        self.head = nn.Linear(9, 2)

    def forward(self, img: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.block(img)).flatten(1)
        h = torch.cat([h, self.emb(tok).mean(1)], 1)
        return self.head(torch.tanh(self.ln(self.fc(h))))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return (
        torch.randn(GLOBAL_BATCH, 3, 4, 4, generator=gen, dtype=DTYPE),
        torch.randint(0, 7, (GLOBAL_BATCH, 3), generator=gen),
        torch.randint(0, 2, (GLOBAL_BATCH,), generator=gen),
    )


def share(rank: int, world: int, step: int) -> tuple[torch.Tensor, ...]:
    n = GLOBAL_BATCH // world
    return tuple(t[rank * n : (rank + 1) * n] for t in batch(step))


def shard(model: Net, mp_policy=None) -> Net:
    """``model`` as an FSDP2 recipe prepares it: the block checkpointed (as Accelerate's
    FSDP2 activation checkpointing wraps it), fc its own unit, then the root; the
    LayerNorm is left out of the sharding."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model.block = checkpoint_wrapper(model.block)
    kwargs = {"mp_policy": mp_policy or MixedPrecisionPolicy()}
    # kept gathered from its forward to its backward: one all-gather per step fewer
    fully_shard(model.fc, reshard_after_forward=False, **kwargs)
    fully_shard(model, ignored_params=set(model.ln.parameters()), **kwargs)
    return model


def average_ignored(model: Net, world: int) -> None:
    """Averages the gradients of the parameters left out of the sharding over the ranks, as
    a user of ``ignored_params`` does (FSDP2 averages the others)."""
    grads = [p.grad for p in model.ln.parameters()]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    parts = zip(flat.split([g.numel() for g in grads]), grads, strict=True)
    torch._foreach_copy_(grads, [t.view_as(g) / world for t, g in parts])


def train(model, opt, rank, world, steps, counts=None) -> None:
    """Each rank's loss is the mean over its share; counts the all-reduce calls that each
    ``opt.step()`` makes."""
    calls = [0]
    all_reduce = dist.all_reduce

    def counting(*args, **kwargs):
        calls[0] += 1
        return all_reduce(*args, **kwargs)

    for step in steps:
        img, tok, y = share(rank, world, step)
        F.cross_entropy(model(img, tok), y).backward()
        average_ignored(model, world)
        calls[0] = 0
        dist.all_reduce = counting
        try:
            opt.step()
        finally:
            dist.all_reduce = all_reduce
        if counts is not None:
            counts.append(calls[0])
        opt.zero_grad()


def full(model) -> list[torch.Tensor]:
    return [
        (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for p in model.parameters()
    ]


def factors(opt) -> list[torch.Tensor]:
    return [t.clone() for ly in opt.collector.layers.values() for t in (ly.a_ema, ly.g_ema)]


def _what_the_hooks_see(model, rank, world) -> tuple:
    seen = []
    fc = model.fc

    def look(module, args):
        seen.append((type(module.weight).__name__, tuple(module.weight.shape), args[0].shape))

    handle = fc.register_forward_pre_hook(look)
    img, tok, _ = share(rank, world, 0)
    with torch.no_grad():
        model(img, tok)
    handle.remove()
    model.reshard()  # the root keeps its parameters gathered after a forward
    return seen[0][0], seen[0][1], tuple(seen[0][2])


def _placements(rank, world) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    out = {}
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("replicate", "shard"))
    hsdp = distribute_tensor(torch.zeros(7, 2), mesh, [Replicate(), Shard(0)])
    out["hsdp"] = local_rows(hsdp)
    flat = init_device_mesh("cpu", (world,))
    out["replicated"] = local_rows(distribute_tensor(torch.zeros(7, 2), flat, [Replicate()]))
    try:
        local_rows(distribute_tensor(torch.zeros(2, 7), flat, [Shard(1)]))
    except ValueError as err:
        out["columns"] = str(err)
    return out


def _bf16_run(rank, world) -> dict:
    """FSDP2's bf16 mixed precision: parameters kept float32 and sharded, gathered in bf16
    for the forward and backward, gradients reduced in float32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = shard(Net(), policy)
    opt = AdaFisherW.from_model(model, lr=1e-2, damping=0.1, update_every=2, impl="foreach")
    before = full(model)
    for step in range(4):
        img, tok, y = share(rank, world, step)
        F.cross_entropy(model(img.float(), tok), y).backward()
        average_ignored(model, world)
        opt.step()
        opt.zero_grad()
    moms = [opt.state[p]["momentum"] for p in model.parameters()]
    return {
        "momentum": sorted({(type(m).__name__, str(m.dtype)) for m in moms}),
        "factors_finite": all(bool(torch.isfinite(t).all()) for t in factors(opt)),
        "moved": all(not torch.equal(b, a) for b, a in zip(before, full(model), strict=True)),
        "refreshed": [name for name, ly in opt.collector.layers.items() if not (ly.a == 1).all()],
    }


ELASTIC_STEPS = 3


def _elastic_run(rank: int, world: int) -> dict:
    """The elastic batch under FSDP2: the ranks agree on the micro-batch (here from
    proposals that differ), then every rank runs its share in pieces of that size, with
    the same collectives in each."""
    from hf_triaccel.memory import ElasticBatchController, NullProbe

    agreed = ElasticBatchController(GLOBAL_BATCH, probe=NullProbe()).agree([3, 2, 4][rank])
    model = shard(Net().to(DTYPE))
    opt = AdaFisherW.from_model(model, **HYPER[world], **{**COMMON, "update_every": 1})
    n = GLOBAL_BATCH // world
    controller = ElasticBatchController(n, probe=NullProbe(), max_micro_batch=agreed)
    for step in range(ELASTIC_STEPS):
        controller.run_step(
            share(rank, world, step),
            lambda piece: F.cross_entropy(model(piece[0], piece[1]), piece[2]),
            model=model,
        )
        average_ignored(model, world)
        opt.step()
        opt.zero_grad()
    return {"agreed": agreed, "micro_batch": controller.micro_batch, "params": full(model)}


def _checkpoint_folder(rank: int) -> str:
    import tempfile

    folder = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(folder)
    return folder[0]


def _worker(rank: int, world: int) -> dict:
    import shutil

    from torch.distributed.checkpoint import load, save
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    folder = _checkpoint_folder(rank)
    model = shard(Net().to(DTYPE))
    opt = AdaFisherW.from_model(model, **HYPER[world], **COMMON)
    counts: list[int] = []
    train(model, opt, rank, world, range(SAVE_AT), counts)
    msd, osd = get_state_dict(model, opt)
    save({"model": msd, "optim": osd}, checkpoint_id=folder)
    train(model, opt, rank, world, range(SAVE_AT, STEPS), counts)

    # resumed in fresh objects, the optimizer built before the sharding and switched to
    # the sharded parameters afterwards, as Accelerate prepares FSDP2
    twin = Net().to(DTYPE)
    opt2 = AdaFisherW.from_model(twin, **HYPER[world], **COMMON)
    before = list(twin.parameters())
    sharded = dict(zip(before, shard(twin).parameters(), strict=True))
    for group in opt2.param_groups:
        group["params"] = [sharded[p] for p in group["params"]]
    msd2, osd2 = get_state_dict(twin, opt2)
    load({"model": msd2, "optim": osd2}, checkpoint_id=folder)
    set_state_dict(twin, opt2, model_state_dict=msd2, optim_state_dict=osd2)
    train(twin, opt2, rank, world, range(SAVE_AT, STEPS))
    dist.barrier()
    if rank == 0:
        shutil.rmtree(folder)

    momentum = opt.state[model.fc.weight]["momentum"]
    head_rows = local_rows(model.head.weight)
    return {
        "params": full(model),
        "factors": factors(opt),
        "counts": counts,
        "resumed": full(twin),
        "resumed_factors": factors(opt2),
        "momentum": (type(momentum).__name__, tuple(momentum.shape), str(momentum.placements)),
        "seen": _what_the_hooks_see(model, rank, world),
        "head_rows": head_rows,
        "placements": _placements(rank, world),
        "bf16": _bf16_run(rank, world),
        "elastic": _elastic_run(rank, world),
    }


def reference(world: int) -> tuple[Net, AdaFisherW]:
    """One process on the global batch, taken whole: the model and its optimizer."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = Net().to(DTYPE)
        opt = AdaFisherW.from_model(model, **HYPER[world], **COMMON)
        for step in range(STEPS):
            img, tok, y = batch(step)
            F.cross_entropy(model(img, tok), y).backward()
            opt.step()
            opt.zero_grad()
    finally:
        torch.set_num_threads(threads)
    return model, opt


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """What every rank of the spawned run of a world size returned (one spawn per size)."""
    return spawns_per_world(_worker, tmp_path_factory, "fsdp2")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
def test_fsdp2_matches_one_process(world, sharded):
    """Parameters and factors within the tolerance of tests/distributed/compare.py of one
    process on the global batch taken whole; every rank holds the same factors."""
    ranks = sharded(world)
    model, opt = reference(world)
    for rank in ranks:
        assert_matches(rank["params"], list(model.parameters()), "parameters")
    assert_matches(ranks[0]["factors"], factors(opt), "factors")
    for rank in ranks[1:]:
        assert all(map(torch.equal, rank["factors"], ranks[0]["factors"]))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
def test_fsdp2_checkpoint_resumes_exactly(world, sharded):
    """Saved at step 190 with torch.distributed.checkpoint, loaded into fresh objects
    (the optimizer built before the sharding), run to the end: the same arithmetic as the
    uninterrupted run, so the same bits, factors and refresh schedule included."""
    for rank in sharded(world):
        assert all(map(torch.equal, rank["resumed"], rank["params"]))
        assert all(map(torch.equal, rank["resumed_factors"], rank["factors"]))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
def test_one_all_reduce_per_refresh(world, sharded):
    expected = [int(step % UPDATE_EVERY == 0) for step in range(STEPS)]
    for rank in sharded(world):
        assert rank["counts"] == expected


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
def test_what_each_rank_sees_and_holds(world, sharded):
    ranks = sharded(world)
    split = [min(r * math.ceil(2 / world), 2) for r in range(world + 1)]  # the head's 2 rows
    for r, rank in enumerate(ranks):
        # the forward gathers parameters, not activations: the full weight, the rank's share
        assert rank["seen"] == ("Parameter", (9, 86), (GLOBAL_BATCH // world, 86))
        assert rank["momentum"] == ("DTensor", (9, 86), "(Shard(dim=0),)")
        assert rank["head_rows"] == (split[r], split[r + 1])
        chunk = math.ceil(7 / world)
        placed = rank["placements"]
        assert placed["hsdp"] == (min(r * chunk, 7), min((r + 1) * chunk, 7))
        assert placed["replicated"] == (0, 7)
        assert "Shard(0)" in placed["columns"]
        bf16 = rank["bf16"]
        assert bf16["momentum"] == [("DTensor", "torch.float32"), ("Tensor", "torch.float32")]
        assert bf16["factors_finite"] and bf16["moved"] and len(bf16["refreshed"]) == 6


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
def test_elastic_batch_under_fsdp2(world, sharded):
    """The ranks agree on the smallest proposal and run their shares in pieces of it: the
    same as one process on the global batch taken whole (tolerance of
    tests/distributed/compare.py)."""
    ranks = sharded(world)
    m = ranks[0]["elastic"]["micro_batch"]
    assert [r["elastic"]["agreed"] for r in ranks] == [2] * world and m == 2
    model = Net().to(DTYPE)
    opt = AdaFisherW.from_model(model, **HYPER[world], **{**COMMON, "update_every": 1})
    for step in range(ELASTIC_STEPS):
        img, tok, y = batch(step)
        F.cross_entropy(model(img, tok), y).backward()
        opt.step()
        opt.zero_grad()
    for rank in ranks:
        assert_matches(rank["elastic"]["params"], list(model.parameters()), "parameters")
