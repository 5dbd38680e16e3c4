"""PrecisionController: ranking, hysteresis, fp16 overflow, telemetry, state, and the
tracker-driven loop."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from hf_triaccel import AdaFisherW
from hf_triaccel.curvature.signals import SignalTracker
from hf_triaccel.precision import PrecisionController, PrecisionEvent, PrecisionPolicy

from .test_hooks import Probe


def four_linears() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(4, 4) for _ in range(4)))


# the fractions these tests were written for: a quarter of four equal modules each
QUARTERS = PrecisionPolicy(fp32_fraction=0.25, fp16_fraction=0.25, margin=0.05)


def ranked(order: str) -> dict[str, float]:
    """Sensitivities that rank the modules named by ``order``'s characters first to last."""
    return {name: float(len(order) - i) for i, name in enumerate(order)}


def test_ranking_assigns_fp32_bf16_fp16_by_fraction():
    controller = PrecisionController(four_linears(), QUARTERS)
    controller.update(ranked("2031"), step=200)
    assert controller.decisions == {"2": "fp32", "0": "bf16", "3": "bf16", "1": "fp16"}
    assert [e.reason for e in controller.events] == ["initial"] * 4
    assert controller.counts() == {
        "precision_fp32": 1,
        "precision_bf16": 2,
        "precision_fp16": 1,
        "precision_changes": 4,
    }


def test_ranking_weighs_sensitivity_by_measured_compute_and_activations():
    """Costs come from the first forward (multiply-adds, input and output elements); a
    module's cost is the larger of its compute and activation shares, and fp32 takes the
    most sensitive modules per unit of cost while both shares stay within the fraction."""
    model = nn.Sequential(
        nn.Linear(4, 256), nn.Linear(256, 256), nn.Linear(256, 4), nn.Linear(4, 4)
    )
    controller = PrecisionController(
        model, PrecisionPolicy(fp32_fraction=0.1, fp16_fraction=0.0, margin=0.0)
    )
    model(torch.randn(1, 4))
    assert controller.costs == {"0": 4 * 256, "1": 256 * 256, "2": 256 * 4, "3": 4 * 4}
    assert controller.activations == {"0": 260, "1": 512, "2": 260, "3": 8}
    assert not controller._cost_hooks  # measured once, then removed
    # "1" is 97% of the compute; "0" and "2" are 1.5% of it each but hold a quarter of
    # the activations each (fp32 doubles what their backward holds): only "3" is cheap
    controller.update({"0": 1.0, "1": 10.0, "2": 1.0, "3": 1.0}, step=200)
    assert controller.decisions == {"3": "fp32", "1": "bf16", "0": "bf16", "2": "bf16"}
    controller.remove()


def test_modules_not_measured_yet_are_ranked_by_count():
    controller = PrecisionController(four_linears(), QUARTERS)
    assert controller.costs == {}
    controller.update(ranked("2031"), step=200)
    assert controller.decisions["2"] == "fp32" and controller.decisions["1"] == "fp16"
    controller.remove()
    assert not controller._cost_hooks


def test_fixed_modules_are_not_ranked_and_non_finite_signals_keep_their_precision():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 4), nn.Linear(4, 4))
    controller = PrecisionController(
        model, PrecisionPolicy(rules=[("3", "bf16")], fp32_fraction=0.5, fp16_fraction=0.5)
    )
    controller.update({"0": 1.0, "1": 5.0, "2": 2.0, "3": 9.0}, step=10)
    assert controller.decisions == {"1": "fp32", "3": "bf16", "2": "fp32", "0": "fp16"}
    controller.update({"0": float("nan"), "2": 2.0}, step=20)
    assert controller.decisions["0"] == "fp16"
    with pytest.raises(KeyError):
        controller.update({"nope": 1.0}, step=30)


def test_alternating_borderline_signals_do_not_flap():
    controller = PrecisionController(four_linears(), QUARTERS)
    controller.update(ranked("0123"), step=0)
    start = dict(controller.decisions)
    for i in range(10):  # modules 0 and 1 swap places at every evaluation
        controller.update(ranked("1023" if i % 2 == 0 else "0123"), step=200 * (i + 1))
    assert controller.decisions == start
    assert len(controller.events) == 4


def test_a_lasting_change_is_made_after_patience_evaluations():
    controller = PrecisionController(four_linears(), QUARTERS)
    controller.update(ranked("0123"), step=0)
    controller.update(ranked("1023"), step=200)
    assert controller.decisions["0"] == "fp32"
    assert controller.state_dict()["pending"] == {"0": ["bf16", 1], "1": ["fp32", 1]}
    controller.update(ranked("1023"), step=400)
    assert controller.decisions["0"] == "bf16" and controller.decisions["1"] == "fp32"
    assert controller.events[-2:] == [
        PrecisionEvent(400, "1", "bf16", "fp32", "rank"),
        PrecisionEvent(400, "0", "fp32", "bf16", "rank"),
    ]
    assert controller.state_dict()["pending"] == {}


def overflowing_model() -> nn.Sequential:
    model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))
    with torch.no_grad():
        model[0].weight.fill_(100.0)  # 4 * 100 * 1000 = 4e5 > 65504, the fp16 maximum
        model[1].weight.copy_(torch.eye(4))
    return model


def test_overflow_moves_an_fp16_module_up_at_the_next_poll():
    model = overflowing_model()
    controller = PrecisionController(model, PrecisionPolicy(fp32_fraction=0.0, fp16_fraction=1.0))
    controller.update({"0": 1.0, "1": 2.0}, step=10)
    assert controller.decisions == {"1": "fp16", "0": "fp16"}
    x = torch.full((2, 4), 1000.0)
    assert not torch.isfinite(model(x)).all()
    # flagged on the device, not acted on until the poll
    assert controller.decisions["0"] == "fp16"
    assert controller.check_overflow(step=11) == ["0"]
    assert controller.decisions["0"] == "bf16"
    assert controller.events[-1] == PrecisionEvent(11, "0", "fp16", "bf16", "overflow")
    # module 1 was fed inf before, so it was not blamed; now its finite input of 4e5
    # overflows on the cast to fp16, which is its own overflow
    assert not torch.isfinite(model(x)).all()
    assert controller.check_overflow(step=12) == ["1"]
    assert torch.isfinite(model(x)).all()
    # the ranking never puts it back in fp16
    for step in (200, 400, 600):
        controller.update({"0": 1.0, "1": 2.0}, step=step)
    assert controller.decisions == {"1": "bf16", "0": "bf16"}
    assert controller.counts()["precision_fp16"] == 0


def test_overflow_overrides_an_fp16_rule():
    model = overflowing_model()
    controller = PrecisionController(model, PrecisionPolicy(rules=[("0", "fp16")]))
    model(torch.full((2, 4), 1000.0))
    controller.check_overflow(step=3)
    assert controller.decisions["0"] == "bf16"
    assert controller.overflowed == {"0"}


def test_state_dict_round_trip():
    policy = PrecisionPolicy(rules=[("3", "fp32")])
    model = nn.Sequential(*(Probe() for _ in range(6)))
    controller = PrecisionController(model, policy)
    controller.update(ranked("01245"), step=200)
    controller.update(ranked("10245"), step=400)  # leaves a pending change
    controller.overflowed.add("5")
    state = controller.state_dict()
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)

    torch.manual_seed(1)
    other_model = nn.Sequential(*(Probe() for _ in range(6)))
    restored = PrecisionController(other_model, policy)
    restored.load_state_dict(loaded)
    assert restored.state_dict() == state
    assert restored.events == controller.events
    other_model(torch.randn(2, 4))
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    for name, precision in restored.decisions.items():
        assert other_model[int(name)].seen[0][1] == dtypes[precision], name
    # the pending change completes after the restore exactly as it would have before
    restored.update(ranked("10245"), step=600)
    controller.update(ranked("10245"), step=600)
    assert restored.state_dict() == controller.state_dict()
    with pytest.raises(KeyError):
        restored.load_state_dict({**state, "decisions": {"99": "fp32"}})


def test_driven_by_the_signal_tracker_during_training():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 4)
    )
    # AdaFisher's step is about lr / damping: 0.1 here, a stable training to rank
    optimizer = AdaFisherW.from_model(model, lr=1e-4, update_every=1)
    tracker = SignalTracker(optimizer.collector, optimizer, every=4, noise_every=1)
    policy = PrecisionPolicy(fp32_fraction=0.34, fp16_fraction=0.34, patience=1)
    controller = PrecisionController(model, policy, tracker=tracker, poll_every=2)
    assert controller.events == [PrecisionEvent(0, "3", None, "fp32", "norm")]
    for _ in range(8):
        x = torch.randn(16, 8)
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    steps = {e.step for e in controller.events if e.reason == "initial"}
    assert steps == {4}
    assert set(controller.decisions) == {"0", "2", "3", "4"}
    assert sorted(controller.decisions[n] for n in "024") == ["bf16", "fp16", "fp32"]
    assert controller.evaluations == 2
    controller.remove()
    tracker.remove()
    assert not tracker._listeners


def test_counts_feed_the_efficiency_telemetry():
    pytest.importorskip("transformers")
    from hf_triaccel.integrations.telemetry import EfficiencyTelemetry

    controller = PrecisionController(four_linears(), QUARTERS)
    controller.update(ranked("0123"), step=200)
    telemetry = EfficiencyTelemetry()
    telemetry.add_provider(controller.counts)
    metrics = telemetry.window_metrics()
    assert metrics["precision_fp32"] == 1 and metrics["precision_fp16"] == 1
    assert metrics["precision_bf16"] == 2
