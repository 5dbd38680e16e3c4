"""PNG plots of a run and its baseline from their log histories, over the optimizer steps."""

from __future__ import annotations

import pytest

pytest.importorskip("matplotlib")

from hf_triaccel.integrations.plots import plot_run, series  # noqa: E402
from hf_triaccel.precision import PrecisionEvent  # noqa: E402

PNG = b"\x89PNG\r\n\x1a\n"


def history(speed: float, memory: bool) -> list[dict]:
    """Training logs every step and an evaluation every 4 steps, ``speed`` steps a second;
    each evaluation takes half a second, and is logged when it ends."""
    entries = []
    for step in range(1, 13):
        entry = {"wall_time_s": step / speed, "step": step, "loss": 2.3 / step}
        if memory:
            entry["peak_memory_gb"] = 1.0 + 0.01 * step
        entries.append(entry)
        if step % 4 == 0:
            entries.append(
                {
                    "wall_time_s": step / speed + 0.5,
                    "step": step,
                    "eval_loss": 2.0 / step,
                    "eval_accuracy": 0.1 * step,
                }
            )
    return entries


def test_points_sit_at_the_step_they_belong_to():
    # an evaluation is the model at its step, whenever its log arrived
    steps, values = series(history(2.0, memory=False), "eval_accuracy")
    assert steps == [4, 8, 12] and values == pytest.approx([0.4, 0.8, 1.2])
    steps, _ = series(history(2.0, memory=False), "loss")
    assert steps == list(range(1, 13))


def test_run_and_baseline_with_memory_and_precision_map(tmp_path):
    events = [
        PrecisionEvent(0, "bn1", None, "fp32", "norm"),
        PrecisionEvent(4, "layer1", None, "bf16", "initial"),
        PrecisionEvent(8, "layer1", "bf16", "fp16", "rank"),
    ]
    written = plot_run(
        tmp_path / "plots",
        {"adafisher": history(2.0, True), "adamw_torch_fused (baseline)": history(1.8, True)},
        precision_events=events,
        last_step=12,
    )
    assert written == {
        "loss": "loss.png",
        "accuracy": "accuracy.png",
        "memory": "memory.png",
        "precision_map": "precision_map.png",
    }
    for file in written.values():
        assert (tmp_path / "plots" / file).read_bytes().startswith(PNG)


def test_plots_without_data_are_skipped(tmp_path):
    written = plot_run(tmp_path, {"adafisher": history(2.0, memory=False)}, precision_events=[])
    assert written == {"loss": "loss.png", "accuracy": "accuracy.png"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["accuracy.png", "loss.png"]
    assert plot_run(tmp_path / "empty", {"adafisher": []}) == {}
