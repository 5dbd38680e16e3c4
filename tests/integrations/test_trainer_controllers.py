"""The controllers through the Trainer: adaptive precision, step-size steering, their
reports and optional dependencies."""

from __future__ import annotations

import io
import json
import sys

import pytest
import torch

timm = pytest.importorskip("timm")
transformers = pytest.importorskip("transformers")

from hf_triaccel.integrations.trainer import TriAccelTrainer  # noqa: E402
from tests.integrations.tiny import MLP, ImageSet, Logs, VectorSet, make_args, tiny_timm  # noqa: E402


def test_adaptive_precision_through_the_trainer(tmp_path):
    args = make_args(
        tmp_path, max_steps=4, triaccel_precision=True, triaccel_signals_every=2, logging_steps=4
    )
    logs = Logs()
    trainer = TriAccelTrainer(
        model=tiny_timm(), args=args, train_dataset=ImageSet(), callbacks=[logs]
    )
    trainer.train()
    assert trainer.precision is not None and trainer.signals.steps == 4
    assert set(trainer.precision.decisions.values()) <= {"fp32", "bf16"}  # no fp16 without --fp16
    log = next(e for e in logs.entries if "loss" in e)
    assert log["precision_fp32"] + log["precision_bf16"] == len(trainer.precision.decisions)
    trainer.save_model()
    assert (tmp_path / "precision_map.png").stat().st_size > 0
    assert json.loads((tmp_path / "signals.json").read_text())
    saved = torch.load(
        io.BytesIO(trainer.optimizer.state_dict()["param_groups"][0]["triaccel_precision"])
    )
    assert saved["precision"] == trainer.precision.state_dict()


def test_step_size_steering_through_the_trainer(tmp_path):
    args = make_args(
        tmp_path, max_steps=4, triaccel_lr_steering=True, triaccel_signals_every=2, logging_steps=4
    )
    logs = Logs()
    trainer = TriAccelTrainer(
        model=tiny_timm(), args=args, train_dataset=ImageSet(), callbacks=[logs]
    )
    trainer.train()
    assert trainer.precision is None and trainer.signals is trainer.steering.tracker
    assert trainer.signals.steps == 4 and trainer.steering.scales
    log = next(e for e in logs.entries if "loss" in e)
    assert log["lr_scale_min"] == min(trainer.steering.scales.values())
    assert log["lr_scale_max"] == max(trainer.steering.scales.values())
    saved = torch.load(
        io.BytesIO(trainer.optimizer.state_dict()["param_groups"][0]["triaccel_steering"])
    )
    assert saved["steering"] == trainer.steering.state_dict()
    assert saved["signals"]["steps"] == 4


def test_missing_matplotlib_is_reported_at_the_start_and_never_crashes(tmp_path, monkeypatch):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    args = make_args(
        tmp_path / "out",
        max_steps=2,
        triaccel_precision=True,
        triaccel_signals_every=1,
        triaccel_report_dir=str(tmp_path / "reports"),
    )
    trainer = TriAccelTrainer(model=MLP(), args=args, train_dataset=VectorSet())
    with pytest.warns(UserWarning, match="matplotlib") as caught:
        trainer.train()
    assert "install" in str(caught[0].message) and "hf-triaccel[hf]" in str(caught[0].message)
    assert (tmp_path / "reports" / "signals.json").exists()
    assert not (tmp_path / "reports" / "precision_map.png").exists()
