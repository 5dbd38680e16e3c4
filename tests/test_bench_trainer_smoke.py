"""Smoke run of ``benchmarks/bench_trainer.py`` on the CPU: tiny model, few steps.

It checks that every variant runs end to end through the hand-written loop and the
Trainer, and that the timed window covers exactly the steps asked for, not the speed.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("timm")
pytest.importorskip("transformers")

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
WARMUP, STEPS = 2, 3


@pytest.fixture
def bench_trainer(monkeypatch):
    """The script's module, imported the way ``python benchmarks/bench_trainer.py`` would."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    # the smoke run drops to one CPU thread; give the other tests theirs back
    threads = torch.get_num_threads()
    yield importlib.import_module("bench_trainer")
    torch.set_num_threads(threads)


def test_bench_trainer_smoke(bench_trainer, tmp_path):
    argv = ["--smoke", "--device", "cpu", "--warmup", str(WARMUP), "--steps", str(STEPS)]
    assert bench_trainer.main([*argv, "--out", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "bench_trainer.json").read_text())
    assert (tmp_path / "bench_trainer.md").is_file()
    assert "--smoke" in payload["env"]["command"]
    assert payload["config"]["world_size"] == 1
    assert payload["config"]["steps"] == STEPS

    rows = {r["variant"]: r for r in payload["results"]}
    assert list(rows) == list(bench_trainer.VARIANTS)
    for row in rows.values():
        assert row["status"] == "ok", row["note"]
        assert row["samples_per_second"] > 0 and row["vs_loop"] > 0
        assert row["steps"] == STEPS
        assert row["global_step"] == WARMUP + STEPS
    assert rows["loop_adamw_fused"]["vs_loop"] == 1.0
    assert rows["trainer_adafisherw"]["update_every"] >= 1
