"""End-to-end smoke runs of the benchmark scripts: tiny models, CPU, few repetitions.

They check that every script runs and writes the JSON record the results are copied
from, not the speed of anything.
"""

from __future__ import annotations

import gc
import importlib
import json
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture
def bench(monkeypatch):
    """Imports a benchmark script the way ``python benchmarks/<script>.py`` would."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    # tiny tensors on a shared CPU: waking a thread pool costs more than the work, and
    # made the same smoke run several times slower
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    # each auto_find_batch_size restart collects garbage three times, a quarter second
    # each over the test process's heap: objects alive now are left out of those scans
    gc.freeze()
    yield importlib.import_module
    gc.unfreeze()
    torch.set_num_threads(threads)


def _load(path: Path) -> dict:
    payload = json.loads(path.read_text())
    env = payload["env"]
    for key in ("device", "versions", "git_commit", "date_utc", "command"):
        assert key in env
    assert set(env["versions"]) >= {"torch", "triton", "timm", "transformers", "hf-triaccel"}
    assert env["versions"]["torch"] and env["versions"]["timm"]
    assert "--smoke" in env["command"]
    return payload


def _run(bench, script: str, tmp_path: Path, *flags: str, record: str | None = None) -> dict:
    """Runs ``script`` with ``--smoke`` and ``flags``; returns its JSON record (``record``:
    the record's name when it is not the script's)."""
    assert bench(script).main(["--smoke", "--device", "cpu", *flags, "--out", str(tmp_path)]) == 0
    assert (tmp_path / f"{record or script}.md").is_file()
    return _load(tmp_path / f"{record or script}.json")


def test_bench_optimizer_smoke(bench, tmp_path):
    payload = _run(bench, "bench_optimizer", tmp_path, "--impls", "foreach,reference")
    assert payload["copy_bandwidth"]["gbytes_per_s"] > 0
    assert set(payload["models"]) == {"resnet18-cifar", "vit-b16"}
    for model in payload["models"].values():
        assert model["n_params"] > 0 and model["hbm_floor_ms"] > 0
    eager = [r for r in payload["results"] if not r["cuda_graph"]]
    measured = {(r["model"], r["optimizer"], r["impl"]) for r in eager}
    for model in payload["models"]:
        assert (model, "AdamW", "fused") in measured
        for impl in ("foreach", "reference"):
            assert (model, "AdaFisher", impl) in measured
            assert (model, "AdaFisherW", impl) in measured
    for row in eager:
        assert row["status"] == "ok", row["note"]
        assert row["median_ms"] > 0 and row["vs_adamw"] > 0 and row["vs_hbm_floor"] > 0
    graphs = [r for r in payload["results"] if r["cuda_graph"]]
    assert graphs and all(r["status"] == "skipped" and r["note"] for r in graphs)


def test_bench_train_step_smoke(bench, tmp_path):
    payload = _run(bench, "bench_train_step", tmp_path, "--impls", "foreach")
    assert payload["config"]["autocast"] == "bfloat16"
    rows = payload["results"]
    assert [(r["optimizer"], r["impl"], r["refresh"]) for r in rows] == [
        ("AdamW", "fused", None),
        ("AdaFisherW", "foreach", True),
        ("AdaFisherW", "foreach", False),
    ]
    for row in rows:
        assert row["status"] == "ok", row["note"]
        assert row["median_ms"] > 0 and row["vs_adamw"] > 0
        assert row["reps"] == payload["config"]["steps"]
    assert rows[0]["vs_adamw"] == 1.0


def test_bench_train_step_channels_last_smoke(bench, tmp_path):
    flags = ("--impls", "foreach", "--channels-last", "--steps", "2")
    payload = _run(bench, "bench_train_step", tmp_path, *flags)
    assert payload["config"]["channels_last"] is True
    assert all(r["status"] == "ok" and r["median_ms"] > 0 for r in payload["results"])


def test_bench_train_step_host_smoke(bench, tmp_path):
    payload = _run(bench, "bench_train_step", tmp_path, "--host", record="bench_train_step_host")
    rows = {row["refresh"]: row for row in payload["results"]}
    assert [r["impl"] for r in rows.values()] == ["fused", "triton", "triton"]
    assert all(
        r["status"] == "ok" and r["aten_ops"] > 0 and r["host_ms"] > 0 for r in rows.values()
    )
    # the Fisher refresh adds work to the step: more operators, and more Triton launches
    assert rows[True]["aten_ops"] > rows[False]["aten_ops"]
    assert rows[None]["launches"] == 0 < rows[False]["launches"] < rows[True]["launches"]


def test_bench_optimizer_host_smoke(bench, tmp_path):
    payload = _run(bench, "bench_optimizer", tmp_path, "--host", record="bench_optimizer_host")
    assert payload["config"]["stub_kernels"] is True
    rows = {(r["model"], r["optimizer"]): r for r in payload["results"]}
    # the narrowed models keep the tensors of the full ones
    assert rows[("resnet18-cifar", "AdaFisherW")]["tensors"] == 62
    assert rows[("vit-b16", "AdaFisherW")]["tensors"] == 152
    for row in rows.values():
        assert row["status"] == "ok", row["note"]
        assert row["host_us"] > 0 and row["aten_ops"] > 0
    assert rows[("vit-b16", "AdamW")]["launches"] == 0 < rows[("vit-b16", "AdaFisherW")]["launches"]


def test_bench_trainer_smoke(bench, tmp_path):
    warmup, steps = 2, 3
    payload = _run(bench, "bench_trainer", tmp_path, "--warmup", str(warmup), "--steps", str(steps))
    assert payload["config"]["world_size"] == 1 and payload["config"]["steps"] == steps
    rows = {r["variant"]: r for r in payload["results"]}
    assert list(rows) == list(bench("bench_trainer").VARIANTS)
    for row in rows.values():
        assert row["status"] == "ok", row["note"]
        assert row["samples_per_second"] > 0 and row["vs_loop"] > 0
        assert row["steps"] == steps and row["global_step"] == warmup + steps
    assert rows["loop_adamw_fused"]["vs_loop"] == 1.0
    assert rows["trainer_adafisherw"]["update_every"] >= 1


def test_bench_elastic_smoke(bench, tmp_path):
    """The figures are recorded; the controller's acceptance is
    tests/memory/test_elastic_acceptance.py."""
    payload = _run(bench, "bench_elastic", tmp_path)
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
    assert summary["shrink_steps"] and summary["grow_steps"]
    assert summary["slope_bytes_per_sample"] > 0

    auto, elastic = payload["trainers"]
    assert (auto["mode"], elastic["mode"]) == ("auto_find_batch_size", "elastic_batch")
    for row in (auto, elastic):
        assert row["status"] == "ok", row["note"]
        assert row["steps"] == payload["config"]["steps"]
        assert 0 < row["first_step_s"] <= row["total_s"] and row["samples_per_s"] > 0
    # auto_find_batch_size found a smaller batch by restarting; elastic kept the batch
    assert auto["oom_restarts"] > 0 and auto["samples_per_step"] < E
    assert elastic["oom_restarts"] == 0 and elastic["samples_per_step"] == E
    assert elastic["accumulation"] >= 2
    assert all(size["micro_batch"] * size["accumulation"] >= E for size in elastic["step_sizes"])
