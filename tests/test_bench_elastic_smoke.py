"""Smoke run of benchmarks/bench_elastic.py: tiny model, CPU, simulated device memory.

Checks that the script runs its three parts end to end and writes the per-step record
the acceptance is read from, not the controller's GPU behaviour.
"""

from __future__ import annotations

import gc
import importlib
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture
def bench_elastic(monkeypatch):
    """The script's module, imported the way ``python benchmarks/bench_elastic.py`` would."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    threads = torch.get_num_threads()  # a smoke run sets one thread for the process
    module = importlib.import_module("bench_elastic")
    # each auto_find_batch_size restart collects garbage three times, a quarter second
    # each over the test process's heap: objects alive now are left out of those scans
    gc.freeze()
    yield module
    gc.unfreeze()
    torch.set_num_threads(threads)


def test_bench_elastic_smoke(bench_elastic, tmp_path):
    assert bench_elastic.main(["--smoke", "--out", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "bench_elastic.json").read_text())
    assert (tmp_path / "bench_elastic.md").is_file()
    assert "--smoke" in payload["env"]["command"]
    E = payload["config"]["effective_batch"]
    assert all(part["status"] == "ok" for part in payload["parts"].values()), payload["parts"]

    run = payload["controller_run"]
    steps = run["steps"]
    assert [s["step"] for s in steps] == list(range(len(steps)))
    for s in steps:
        # every step runs its whole effective batch, each sample once, however it is split
        assert s["samples"] == E and sum(s["pieces"]) == E and s["each_sample_once"]
        assert s["accumulation"] == len(s["pieces"]) and s["micro_batch"] == max(s["pieces"])
        assert 0 < s["peak_fraction"] <= 1 and s["step_ms"] > 0
    assert steps[0]["events"][0]["reason"] == "probe"
    assert any(s["reruns"] for s in steps)  # the competing allocation caused an OOM re-run

    sizing, shrink_grow = payload["parts"]["sizing"], payload["parts"]["shrink_grow"]
    assert sizing["steps_to_settle"] <= 3 and sizing["accumulation"] >= 2
    assert 0.85 <= sizing["peak_fraction"] <= 0.95
    schedule = run["schedule"]
    assert schedule["competitor_at"] <= min(shrink_grow["shrink_steps"]) < schedule["release_at"]
    assert min(shrink_grow["grow_steps"]) >= schedule["release_at"]
    assert shrink_grow["micro_batch_held"] < shrink_grow["micro_batch_before"]

    auto, elastic = payload["trainers"]
    assert (auto["mode"], elastic["mode"]) == ("auto_find_batch_size", "elastic_batch")
    steps_asked = payload["config"]["trainer_steps"]
    for row in (auto, elastic):
        assert row["steps"] == steps_asked and 0 < row["first_step_s"] <= row["total_s"]
    # auto_find_batch_size found a smaller batch by restarting; elastic kept the batch
    assert auto["oom_restarts"] > 0 and auto["samples_per_step"] < E
    assert elastic["oom_restarts"] == 0 and elastic["samples_per_step"] == E
    assert elastic["accumulation"] >= 2
    assert all(size["micro_batch"] * size["accumulation"] >= E for size in elastic["step_sizes"])
