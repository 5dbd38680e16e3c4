"""Smoke run of benchmarks/bench_elastic.py: tiny model, CPU, a fake device.

Checks that the script runs both parts end to end and writes the per-step record the
figures are read from, not the controller's behaviour: its acceptance is
tests/memory/test_elastic_acceptance.py.
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

    run = payload["controller_run"]
    assert run["error"] is None
    steps = run["steps"]
    assert [s["step"] for s in steps] == list(range(len(steps)))
    phases = [s["phase"] for s in steps]
    assert phases == sorted(phases, key=["sizing", "competing", "freed"].index)
    assert set(phases) == {"sizing", "competing", "freed"}
    for s in steps:
        # the record of each step: what ran, its peak and time
        assert sum(s["pieces"]) == s["samples"] and s["accumulation"] == len(s["pieces"])
        assert s["micro_batch"] == max(s["pieces"]) and s["each_sample_once"] is True
        assert 0 < s["peak_fraction"] <= 1 and s["step_ms"] > 0
    assert steps[0]["events"][0]["reason"] == "probe"
    summary = run["summary"]
    assert summary["every_step_exact"] and summary["reruns"] == sum(s["reruns"] for s in steps)
    assert summary["micro_batch"] * summary["accumulation"] >= E
    assert (
        summary["shrink_steps"] and summary["grow_steps"] and summary["slope_bytes_per_sample"] > 0
    )

    auto, elastic = payload["trainers"]
    assert (auto["mode"], elastic["mode"]) == ("auto_find_batch_size", "elastic_batch")
    steps_asked = payload["config"]["steps"]
    for row in (auto, elastic):
        assert row["status"] == "ok", row["note"]
        assert row["steps"] == steps_asked and 0 < row["first_step_s"] <= row["total_s"]
        assert row["samples_per_s"] > 0
    # auto_find_batch_size found a smaller batch by restarting; elastic kept the batch
    assert auto["oom_restarts"] > 0 and auto["samples_per_step"] < E
    assert elastic["oom_restarts"] == 0 and elastic["samples_per_step"] == E
    assert elastic["accumulation"] >= 2
    assert all(size["micro_batch"] * size["accumulation"] >= E for size in elastic["step_sizes"])
