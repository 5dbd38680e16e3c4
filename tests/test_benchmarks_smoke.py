"""End-to-end smoke runs of the benchmark scripts: tiny models, CPU, few repetitions.

They check that every script runs and writes the JSON record the results are copied
from, not the speed of anything.
"""

from __future__ import annotations

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
    yield importlib.import_module
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


def test_bench_optimizer_smoke(bench, tmp_path):
    module = bench("bench_optimizer")
    argv = ["--smoke", "--device", "cpu", "--impls", "foreach,reference", "--out", str(tmp_path)]
    assert module.main(argv) == 0
    payload = _load(tmp_path / "bench_optimizer.json")
    assert (tmp_path / "bench_optimizer.md").is_file()
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
    module = bench("bench_train_step")
    argv = ["--smoke", "--device", "cpu", "--impls", "foreach", "--out", str(tmp_path)]
    assert module.main(argv) == 0
    payload = _load(tmp_path / "bench_train_step.json")
    assert (tmp_path / "bench_train_step.md").is_file()
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
    module = bench("bench_train_step")
    argv = ["--smoke", "--device", "cpu", "--impls", "foreach", "--channels-last"]
    assert module.main([*argv, "--steps", "2", "--out", str(tmp_path)]) == 0
    payload = _load(tmp_path / "bench_train_step.json")
    assert payload["config"]["channels_last"] is True
    assert all(r["status"] == "ok" and r["median_ms"] > 0 for r in payload["results"])


def test_bench_train_step_host_smoke(bench, tmp_path):
    module = bench("bench_train_step")
    assert module.main(["--smoke", "--host", "--out", str(tmp_path)]) == 0
    payload = _load(tmp_path / "bench_train_step_host.json")
    rows = {row["refresh"]: row for row in payload["results"]}
    assert [r["impl"] for r in rows.values()] == ["fused", "triton", "triton"]
    assert all(
        r["status"] == "ok" and r["aten_ops"] > 0 and r["host_ms"] > 0 for r in rows.values()
    )
    # the Fisher refresh adds work to the step: more operators, and more Triton launches
    assert rows[True]["aten_ops"] > rows[False]["aten_ops"]
    assert rows[None]["launches"] == 0 < rows[False]["launches"] < rows[True]["launches"]


def test_bench_optimizer_host_smoke(bench, tmp_path):
    module = bench("bench_optimizer")
    assert module.main(["--smoke", "--host", "--out", str(tmp_path)]) == 0
    payload = _load(tmp_path / "bench_optimizer_host.json")
    assert payload["config"]["stub_kernels"] is True
    rows = {(r["model"], r["optimizer"]): r for r in payload["results"]}
    # the narrowed models keep the tensors of the full ones
    assert rows[("resnet18-cifar", "AdaFisherW")]["tensors"] == 62
    assert rows[("vit-b16", "AdaFisherW")]["tensors"] == 152
    for row in rows.values():
        assert row["status"] == "ok", row["note"]
        assert row["host_us"] > 0 and row["aten_ops"] > 0
    assert rows[("vit-b16", "AdamW")]["launches"] == 0 < rows[("vit-b16", "AdaFisherW")]["launches"]
