"""Gradient release: with float32 weights the run is the ordinary run bit for bit, the
gradients are freed during the backward pass, and what cannot release says so."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hf_triaccel.memory.ledger import held_gradient_bytes, measure_step
from hf_triaccel.optim.adafisher import AdaFisher, AdaFisherW

IMPLS = ("reference", "foreach", "triton")


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 6 * 6, 10),
        nn.ReLU(),
        nn.Linear(10, 5),
    ).to(dtype)


def _batches(n, dtype=torch.float32):
    g = torch.Generator().manual_seed(3)
    return [
        (torch.randn(8, 3, 6, 6, generator=g).to(dtype), torch.randint(0, 5, (8,), generator=g))
        for _ in range(n)
    ]


def _run(cls, impl, release, steps=7, watch=None):
    model = _model()
    opt = cls.from_model(
        model, lr=3e-3, weight_decay=0.01, update_every=3, impl=impl, release_grads=release
    )
    freed = []
    if watch is not None:
        # registered after the optimizer's hooks, on the first layer's weight, whose
        # gradient is complete last: were the later layers' gradients freed by then?
        last = list(model[-1].parameters())
        model[0].weight.register_post_accumulate_grad_hook(
            lambda p: freed.append(all(q.grad is None for q in last))
        )
    for x, y in _batches(steps):
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, opt, freed


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("cls", [AdaFisher, AdaFisherW])
def test_release_equals_the_ordinary_step_bitwise(cls, impl):
    plain, plain_opt, _ = _run(cls, impl, release=False)
    released, opt, freed = _run(cls, impl, release=True, watch=True)
    # steps 1, 2, 4, 5 release (0, 3, 6 refresh the factors): the last layer's gradients
    # were gone before the backward pass reached the first layer
    assert freed == [False, True, True, False, True, True, False]
    n_params = sum(1 for p in released.parameters())
    assert opt.release.total == 4 * n_params
    for a, b in zip(plain.parameters(), released.parameters(), strict=True):
        assert torch.equal(a, b)
        assert torch.equal(plain_opt.state[a]["momentum"], opt.state[b]["momentum"])
        assert torch.equal(plain_opt.state[a]["step"], opt.state[b]["step"])
    assert plain_opt.fisher_steps == opt.fisher_steps == 7


def test_a_releasing_step_holds_one_gradient_at_a_time():
    model = _model(torch.bfloat16)
    opt = AdaFisherW.from_model(
        model, update_every=2, state_dtype="bfloat16", weight_rounding="kahan", release_grads=True
    )
    ledgers = []
    for x, y in _batches(2, torch.bfloat16):

        def step(x=x, y=y):
            nn.functional.cross_entropy(model(x).float(), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        ledgers.append(measure_step(model, opt, step))
    held, released = ledgers
    assert (held.step, released.step) == ("held", "released")
    assert held.gradients == held_gradient_bytes(model, "held")
    assert released.gradients == held_gradient_bytes(model, "released")
    assert released.gradients < held.gradients


def test_two_backward_passes_before_a_step_are_refused():
    model = _model()
    opt = AdaFisherW.from_model(model, update_every=2, release_grads=True)
    (x, y), (x2, y2) = _batches(2)
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    with pytest.raises(RuntimeError, match="gradient accumulation over several backward"):
        nn.functional.cross_entropy(model(x2), y2).backward()


def test_without_a_collector_every_step_releases():
    model = nn.Linear(4, 2)
    with pytest.warns(UserWarning, match="without a FisherCollector"):
        opt = AdaFisherW(model.parameters(), release_grads=True)
    model(torch.randn(3, 4)).sum().backward()
    assert model.weight.grad is None and opt.release.released == 2
    opt.step()
    assert opt.release.total == 2 and opt.state[model.weight]["step"].item() == 1.0


def test_fp16_loss_scaling_is_refused_before_any_release():
    model = _model()
    opt = AdaFisherW.from_model(model, update_every=2, release_grads=True)
    opt.collector.grad_scaler = torch.amp.GradScaler("cpu", enabled=True)
    x, y = _batches(1)[0]
    nn.functional.cross_entropy(model(x), y).backward()  # a refresh step: nothing released
    with pytest.raises(ValueError, match="fp16 loss scaling"):
        opt.step()
    assert opt.release.total == 0
