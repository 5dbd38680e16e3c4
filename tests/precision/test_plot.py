"""plot_precision_map writes a PNG from the event log."""

from __future__ import annotations

import pytest
from torch import nn

from hf_triaccel.precision import PrecisionController, PrecisionPolicy, plot_precision_map

pytest.importorskip("matplotlib")


def test_plot_writes_a_png(tmp_path):
    model = nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2), nn.Linear(2, 2), nn.Linear(2, 2))
    controller = PrecisionController(model, PrecisionPolicy(patience=1))
    controller.update({"0": 3.0, "2": 2.0, "3": 1.0}, step=200)
    controller.update({"0": 1.0, "2": 2.0, "3": 3.0}, step=400)
    path = plot_precision_map(controller.events, tmp_path / "map.png", last_step=600)
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    # the dicts of a saved state work too
    again = plot_precision_map(controller.state_dict()["events"], tmp_path / "again.png")
    assert (tmp_path / "again.png").stat().st_size > 1000 and again.endswith("again.png")


def test_plot_refuses_an_empty_log(tmp_path):
    with pytest.raises(ValueError):
        plot_precision_map([], tmp_path / "empty.png")
