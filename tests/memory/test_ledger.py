"""The memory ledger, counted from the tensors, against the bytes each configuration's
arithmetic gives."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hf_triaccel.memory.ledger import count_ledger, held_gradient_bytes, measure_step
from hf_triaccel.optim.adafisher import AdaFisherW


def _mlp(dtype):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).to(dtype)


def _step(model, opt):
    def run():
        x = torch.randn(8, 16, dtype=next(model.parameters()).dtype)
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return run


N = 16 * 32 + 32 + 32 * 4 + 4  # parameters of _mlp
TENSORS = 4


def test_mixed_precision_adamw_is_sixteen_bytes_and_its_step_counts():
    model = _mlp(torch.float32)
    opt = torch.optim.AdamW(model.parameters())
    ledger = measure_step(model, opt, _step(model, opt))
    assert ledger.step == "held" and ledger.parameters == N
    assert (ledger.weights, ledger.gradients) == (4 * N, 4 * N)
    assert ledger.optimizer_state == 8 * N + 4 * TENSORS  # two moments, a float32 step each
    assert ledger.compensation == ledger.fisher_factors == 0


def test_low_memory_adafisherw_is_six_bytes_released_and_eight_held():
    model = _mlp(torch.bfloat16)
    opt = AdaFisherW.from_model(
        model, update_every=2, state_dtype="bfloat16", weight_rounding="kahan", release_grads=True
    )
    held, released = (measure_step(model, opt, _step(model, opt)) for _ in range(2))
    # factors: per Linear, g over its outputs, a over its inputs plus one for the bias
    factors = 4 * ((32 + 17) + (4 + 33))
    for ledger in (held, released):
        assert (ledger.weights, ledger.optimizer_state) == (2 * N, 2 * N + 4 * TENSORS)
        assert ledger.compensation == 2 * N
        assert ledger.fisher_factors == factors
    assert held.gradients == 2 * N
    assert released.gradients == 2 * 16 * 32  # the largest gradient, alone
    assert held.total - released.total == 2 * N - 2 * 16 * 32


def test_tied_weights_are_counted_once():
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ledger = count_ledger(model, opt, step="held")
    assert ledger.parameters == 40 and ledger.weights == 160 and ledger.gradients == 160


def test_bad_step_kind_is_named():
    with pytest.raises(ValueError, match="step='worst'"):
        held_gradient_bytes(nn.Linear(2, 2), "worst")
