"""ElasticBatchController on CPU: OOM injection, exactness against full-batch training,
probing on a fake linear memory model, shrink and grow, state round trip."""

from __future__ import annotations

import contextlib
import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hf_triaccel.memory.elastic import ElasticBatchController, ElasticBatchError
from hf_triaccel.testing import CountingProbe, FakeMemoryDevice, OOMInBackward, SampleLedger, oom

E = 16
STEPS = 4


def make_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3)).double()


def make_batches(steps: int = STEPS, n: int = E) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [
        {
            "x": torch.randn(n, 6, generator=gen, dtype=torch.float64),
            "y": torch.randint(0, 3, (n,), generator=gen),
            "idx": torch.arange(s * n, (s + 1) * n),
        }
        for s in range(steps)
    ]


def controller(**kw) -> ElasticBatchController:
    kw.setdefault("probe", CountingProbe())
    return ElasticBatchController(E, **kw)


def test_oom_halves_until_it_fits():
    ctrl = controller()
    model = make_mlp()
    sizes = []

    def loss_fn(piece):
        if len(piece["x"]) > 5:
            raise oom()
        sizes.append(len(piece["x"]))
        return F.cross_entropy(model(piece["x"]), piece["y"])

    for batch in make_batches(2):
        ctrl.run_step(batch, loss_fn, model=model)
    assert [(e.step, e.old, e.new, e.reason) for e in ctrl.events] == [
        (0, 16, 8, "oom"),
        (0, 8, 4, "oom"),
    ]
    assert sizes == [4] * 8
    assert ctrl.metrics() == {"micro_batch": 4, "accumulation": 4}
    assert ctrl.probe.releases == 2  # memory handed back after each OOM


def test_pieces_are_balanced():
    ctrl = ElasticBatchController(100, probe=CountingProbe(), max_micro_batch=40)
    assert (ctrl.micro_batch, ctrl.accumulation) == (34, 3)  # 34 + 34 + 32, not 40 + 40 + 20


def test_each_sample_kept_once_per_step():
    ctrl = controller(max_micro_batch=4)
    model = make_mlp()
    ledger = SampleLedger()
    attempted = []

    def loss_fn(piece):
        attempted.append(piece["idx"].tolist())
        if len(attempted) in (3, 9):  # the third piece of step 0, a piece of its re-run
            raise oom()
        ledger.add(piece["idx"])
        return F.cross_entropy(model(piece["x"]), piece["y"])

    batches = make_batches()
    for batch in batches:
        ctrl.run_step(batch, loss_fn, model=model, rollbacks=[ledger])
    assert ledger.restores == 2
    for kept, batch in zip(ledger.steps, batches, strict=True):
        assert sorted(kept) == batch["idx"].tolist()
    # the failed attempts did see samples, which were then run again
    assert sum(map(len, attempted)) > STEPS * E


def _full_batch_run(make_opt, batches):
    model = make_mlp()
    opt = make_opt(model)
    for b in batches:
        F.cross_entropy(model(b["x"]), b["y"]).backward()
        opt.step()
        opt.zero_grad()
    return model


class FaultyMLP(nn.Module):
    """The MLP of :func:`make_mlp` with OOM faults: in the forward of pieces larger than
    ``limit``, and in the middle of the backward while ``armed[0]``."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.net = make_mlp()
        self.limit = limit
        self.armed = [False]

    def forward(self, x):
        if x.shape[0] > self.limit:
            raise oom()
        h = OOMInBackward.apply(self.net[1](self.net[0](x)), self.armed)
        return self.net[2](h)


OPTIMIZERS = {
    "sgd": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
    "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_parameters_match_full_batch(name):
    make_opt = OPTIMIZERS[name]
    batches = make_batches()
    faulty = FaultyMLP(limit=7)
    ctrl = controller()
    opt = make_opt(faulty)
    for step, b in enumerate(batches):
        faulty.armed[0] = step == 2  # a backward fails after the last layer's gradients
        ctrl.run_step(b, lambda p: F.cross_entropy(faulty(p["x"]), p["y"]), model=faulty)
        opt.step()
        opt.zero_grad()
    # 16 -> 8 -> 4 on forward OOMs at step 0, 4 -> 2 on the backward OOM of step 2
    assert [(e.step, e.new) for e in ctrl.events] == [(0, 8), (0, 4), (2, 2)]
    reference = _full_batch_run(make_opt, batches)
    for p, q in zip(faulty.net.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-12)


def test_oom_in_backward_drops_partial_gradients():
    faulty = FaultyMLP(limit=E)
    faulty.armed[0] = True
    ctrl = controller()
    b = make_batches(1)[0]
    loss = ctrl.run_step(b, lambda p: F.cross_entropy(faulty(p["x"]), p["y"]), model=faulty)
    reference = make_mlp()
    ref_loss = F.cross_entropy(reference(b["x"]), b["y"])
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-12, atol=1e-12)
    for p, q in zip(faulty.net.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12)


def test_token_counts_weight_the_pieces():
    """A per-token mean loss weighted by ``count`` equals the whole batch's token mean."""
    torch.manual_seed(0)
    emb = nn.Embedding(10, 4).double()
    ids = torch.randint(0, 10, (E, 5))
    labels = torch.randint(0, 4, (E, 5))
    labels[torch.rand(E, 5) < 0.4] = -100  # unequal token counts per sample
    batch = {"ids": ids, "labels": labels}

    def loss_fn(b):
        return F.cross_entropy(emb(b["ids"]).flatten(0, 1), b["labels"].flatten())

    ctrl = controller(max_micro_batch=3)
    ctrl.run_step(batch, loss_fn, model=emb, count=lambda b: (b["labels"] != -100).sum())
    grad = emb.weight.grad.clone()
    emb.weight.grad = None
    loss_fn(batch).backward()
    torch.testing.assert_close(grad, emb.weight.grad, rtol=1e-12, atol=1e-12)


def test_normalized_losses_are_added_as_they_are():
    model = make_mlp()
    b = make_batches(1)[0]
    ctrl = controller(max_micro_batch=5)
    loss = ctrl.run_step(
        b,
        lambda p: F.cross_entropy(model(p["x"]), p["y"], reduction="sum") / E,
        model=model,
        normalized=True,
    )
    torch.testing.assert_close(loss, F.cross_entropy(model(b["x"]), b["y"]).detach())


def test_fatal_error_is_not_retried():
    ctrl = controller()
    model = make_mlp()
    calls = 0

    def loss_fn(piece):
        nonlocal calls
        calls += 1
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    with pytest.raises(RuntimeError, match="illegal memory access"):
        ctrl.run_step(make_batches(1)[0], loss_fn, model=model)
    assert calls == 1 and ctrl.events == [] and ctrl.micro_batch == E


def test_other_errors_propagate_unchanged():
    ctrl = controller()
    with pytest.raises(KeyError):
        ctrl.run_step(make_batches(1)[0], lambda p: p["missing"], model=make_mlp())
    assert ctrl.micro_batch == E


def test_min_micro_batch_checkpointing_once_then_error():
    calls = []
    ctrl = controller(min_micro_batch=4, enable_activation_checkpointing=lambda: calls.append(1))

    def loss_fn(piece):
        raise oom()

    with pytest.raises(ElasticBatchError, match="even with activation checkpointing"):
        ctrl.run_step(make_batches(1)[0], loss_fn, model=make_mlp())
    assert calls == [1]
    assert [(e.old, e.new, e.reason) for e in ctrl.events] == [
        (16, 8, "oom"),
        (8, 4, "oom"),
        (4, 4, "activation_checkpointing"),
    ]


def test_without_checkpointing_hook_gives_up_at_min():
    ctrl = controller(min_micro_batch=8)
    with pytest.raises(ElasticBatchError, match="min_micro_batch=8"):
        ctrl.run_step(make_batches(1)[0], lambda p: (_ for _ in ()).throw(oom()), model=make_mlp())
    assert not ctrl.activation_checkpointing


def test_checkpointing_fallback_lets_the_step_finish():
    model = make_mlp()
    limit = [2]  # pieces of more samples fail, until checkpointing is switched on

    def enable():
        limit[0] = 4

    def loss_fn(piece):
        if len(piece["x"]) > limit[0]:
            raise oom()
        return F.cross_entropy(model(piece["x"]), piece["y"])

    ctrl = controller(min_micro_batch=4, enable_activation_checkpointing=enable)
    ctrl.run_step(make_batches(1)[0], loss_fn, model=model)
    assert ctrl.activation_checkpointing and ctrl.micro_batch == 4


def test_gradients_from_before_the_step_make_an_oom_fatal():
    model = make_mlp()
    b = make_batches(1)[0]
    F.cross_entropy(model(b["x"]), b["y"]).backward()  # accumulated outside the controller
    ctrl = controller()

    def loss_fn(piece):
        if len(piece["x"]) > 8:
            raise oom()
        return F.cross_entropy(model(piece["x"]), piece["y"])

    with pytest.raises(ElasticBatchError, match="gradients from before this step"):
        ctrl.run_step(b, loss_fn, model=model)


def test_running_stats_are_updated_once_per_sample():
    """A re-run step leaves BatchNorm statistics as a run that never failed."""

    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)).double()

    batches = make_batches(2)
    results = []
    for fail in (True, False):
        model = make()
        ctrl = controller(max_micro_batch=E if fail else 8)

        def loss_fn(piece, model=model):
            out = model(piece["x"])  # updates the running statistics, then fails
            if len(piece["x"]) > 8:
                raise oom()
            return F.cross_entropy(out, piece["y"])

        for b in batches:
            ctrl.run_step(b, loss_fn, model=model)
        assert ctrl.micro_batch == 8 and len(ctrl.events) == int(fail)
        results.append(model[1].state_dict())
    for key in results[0]:
        torch.testing.assert_close(results[0][key], results[1][key], rtol=0, atol=0)


def test_no_sync_for_every_piece_but_the_last():
    syncs = []

    class Wrapper(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = make_mlp()
            self.syncing = True

        @contextlib.contextmanager
        def no_sync(self):
            self.syncing = False
            try:
                yield
            finally:
                self.syncing = True

        def forward(self, x):
            syncs.append(self.syncing)
            return self.inner(x)

    model = Wrapper()
    ctrl = controller(max_micro_batch=5)
    b = make_batches(1)[0]
    ctrl.run_step(b, lambda p: F.cross_entropy(model(p["x"]), p["y"]), model=model)
    assert syncs == [False, False, False, True]  # 16 = 4 + 4 + 4 + 4 with max 5


# -- sizing from a memory probe --------------------------------------------------------


def _probe_run(device: FakeMemoryDevice, effective: int = 64, **kw):
    """A controller on ``device`` and a step of ``effective`` samples; ``seen``: the sizes
    of the pieces run."""
    ctrl = ElasticBatchController(effective, probe=device, **kw)
    model = make_mlp()
    seen = []

    def loss_fn(piece):
        device.use(len(piece))
        seen.append(len(piece))
        return model(piece).sum() * 0

    def step():
        ctrl.run_step(torch.randn(effective, 6, dtype=torch.float64), loss_fn, model=model)
        model.zero_grad()

    return ctrl, step, seen


@pytest.mark.parametrize(
    ("effective", "capacity", "base", "slope"),
    [(256, 3000.0, 1000.0, 10.0), (100, 10_000.0, 700.0, 233.0), (64, 1e9, 10.0, 1.0)],
)
def test_probe_picks_the_largest_size_under_target(effective, capacity, base, slope):
    device = FakeMemoryDevice(capacity, base, slope)
    ctrl, step, seen = _probe_run(device, effective)
    step()
    probe_events = [e for e in ctrl.events if e.reason == "probe"]
    assert len(probe_events) <= 1
    m = ctrl.micro_batch
    # largest size under target, with the fewest pieces
    best = min(effective, math.floor((0.9 * capacity - base) / slope))
    assert ctrl.accumulation == math.ceil(effective / best)
    assert base + slope * m <= 0.9 * capacity
    assert ctrl.predicted_peak(m) == pytest.approx(base + slope * m)
    p = max(1, effective // 8)
    assert seen[:3] == [p, p, 2 * p]  # three probe pieces: a warm-up and two measured
    assert device.ooms == 0


def test_probe_pieces_that_do_not_fit_shrink_and_probe_again():
    device = FakeMemoryDevice(capacity=150.0, base=100.0, slope=10.0)
    ctrl, step, seen = _probe_run(device)
    step()
    # the first probe piece (64 // 8 = 8) fails; probing again from m = 4: 1, 1, 2;
    # then floor((135 - 100) / 10) = 3 samples per piece
    assert [(e.old, e.new, e.reason) for e in ctrl.events] == [(64, 4, "oom"), (4, 3, "probe")]
    assert seen[:3] == [1, 1, 2] and set(seen[3:]) <= {3, 1} and sum(seen) == 64
    assert device.ooms == 1


def test_shrinks_on_low_memory_then_grows_back():
    device = FakeMemoryDevice(capacity=1000.0, base=100.0, slope=10.0)
    ctrl, step, _ = _probe_run(device, check_every=5, grow_after=10)
    step()
    assert ctrl.micro_batch == 64  # (900 - 100) / 10 = 80 >= 64
    device.capacity = 760.0  # another process takes memory: 64 still fits, not in target
    step()  # step 1 is checked
    assert ctrl.micro_batch == 32  # floor((684 - 100) / 10) = 58 -> two pieces of 32
    assert ctrl.events[-1].reason == "low_memory"
    device.capacity = 1000.0  # memory returns: grow back after 10 stable steps, at a check
    while ctrl.steps < 14:
        step()
        assert ctrl.micro_batch == 32
    step()  # step 14: 13 steps since the shrink, and a check
    assert ctrl.micro_batch == 64 and ctrl.events[-1].reason == "grow"
    assert device.ooms == 0


def test_failed_size_is_not_proposed_again_until_memory_returns():
    """An OOM the peaks did not predict (fragmentation): the measured model still says
    64 fits, but 64 is not tried again until more memory is available than then."""
    device = FakeMemoryDevice(capacity=1000.0, base=100.0, slope=10.0)
    ctrl, step, _ = _probe_run(device, check_every=1, grow_after=0)
    step()
    assert ctrl.micro_batch == 64
    device.hidden = 300.0
    step()
    assert [(e.step, e.new, e.reason) for e in ctrl.events[-1:]] == [(1, 32, "oom")]
    for _ in range(5):
        step()
    assert ctrl.micro_batch == 32 and device.ooms == 1
    device.capacity = 2000.0
    step()
    assert ctrl.micro_batch == 64 and ctrl.events[-1].reason == "grow" and device.ooms == 1


def test_grows_back_when_a_tensor_of_its_own_is_freed_under_a_budget():
    """Under a budget, memory freed by this process never shows as more available: the
    failed size comes back once the process holds less than at the OOM."""
    device = FakeMemoryDevice(capacity=1000.0, base=100.0, slope=10.0)
    ctrl, step, _ = _probe_run(device, check_every=1, grow_after=3)
    step()
    assert ctrl.micro_batch == 64
    device.base += 300.0  # a tensor of this process: allocated and in every peak
    step()
    assert ctrl.events[-1].reason == "oom" and ctrl.micro_batch == 32
    for _ in range(5):
        step()
    assert ctrl.micro_batch == 32 and device.ooms == 1
    device.base -= 300.0
    for _ in range(5):
        step()
    assert ctrl.micro_batch == 64 and ctrl.events[-1].reason == "grow" and device.ooms == 1


# -- state -----------------------------------------------------------------------------


def test_state_dict_round_trip():
    calls = []
    ctrl = controller(min_micro_batch=4, enable_activation_checkpointing=lambda: calls.append(1))
    model = make_mlp()
    limit = [2]

    def loss_fn(piece):
        if len(piece["x"]) > limit[0]:
            raise oom()
        return F.cross_entropy(model(piece["x"]), piece["y"])

    limit[0] = 3
    with pytest.raises(ElasticBatchError):
        ctrl.run_step(make_batches(1)[0], loss_fn, model=model)
    limit[0] = 4
    ctrl.run_step(make_batches(1)[0], loss_fn, model=model)
    state = json.loads(json.dumps(ctrl.state_dict()))

    restored_calls = []
    restored = controller(
        min_micro_batch=4, enable_activation_checkpointing=lambda: restored_calls.append(1)
    )
    restored.load_state_dict(state)
    assert restored.state_dict() == ctrl.state_dict()
    assert restored.micro_batch == 4 and restored.steps == 1
    assert restored.events == ctrl.events
    assert restored.activation_checkpointing and restored_calls == [1]


def test_loaded_size_is_clamped_to_bounds():
    state = controller().state_dict()
    state["micro_batch"] = 12
    small = controller(max_micro_batch=6)
    small.load_state_dict(state)
    assert small.micro_batch == 6


@pytest.mark.parametrize(
    "kw",
    [
        {"min_micro_batch": 0},
        {"min_micro_batch": 17},
        {"max_micro_batch": 20},
        {"target_fraction": 1.5},
        {"check_every": 0},
    ],
)
def test_invalid_arguments(kw):
    with pytest.raises(ValueError):
        controller(**kw)
