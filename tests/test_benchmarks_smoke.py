"""End-to-end smoke runs of the benchmark scripts: tiny models, CPU, few repetitions.

They check that every script runs and writes the JSON record the results are copied
from, not the speed of anything.
"""

from __future__ import annotations

import doctest
import gc
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import TrainingArguments

from benchmarks import records
from benchmarks.__main__ import SUBCOMMANDS, main, parser

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture
def bench():
    """Imports a subcommand's module of the ``benchmarks`` package."""
    # tiny tensors on a shared CPU: waking a thread pool costs more than the work, and
    # made the same smoke run several times slower
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    # each auto_find_batch_size restart collects garbage three times, a quarter second
    # each over the test process's heap: objects alive now are left out of those scans
    gc.freeze()
    yield lambda name: importlib.import_module(f"benchmarks.{name}")
    gc.unfreeze()
    torch.set_num_threads(threads)


def _load(path: Path) -> dict:
    payload = json.loads(path.read_text())
    env = payload["env"]
    for key in ("device", "versions", "git_commit", "date_utc", "command"):
        assert key in env
    assert set(env["versions"]) >= {"torch", "triton", "timm", "transformers", "hf-triaccel"}
    assert env["versions"]["torch"] and env["versions"]["timm"]
    assert env["command"].startswith("python -m benchmarks ") and "--smoke" in env["command"]
    return payload


def _run(bench, command: str, tmp_path: Path, *flags: str, record: str | None = None) -> dict:
    """Runs ``python -m benchmarks COMMAND --smoke FLAGS``; checks the record it appended
    and returns its JSON payload (``record``: the payload's name when it is not the
    command's)."""
    argv = [command, "--smoke", "--device", "cpu", *flags, "--out", str(tmp_path)]
    assert main(argv) == 0
    name = record or command
    assert (tmp_path / f"{name}.md").is_file()
    payload = _load(tmp_path / f"{name}.json")
    last = records.read(tmp_path / "records.jsonl")[-1]
    assert (last["kind"], last["name"]) == (command, name)
    assert set(last) >= set(records.FIELDS) | {"metrics"}
    env = payload["env"]
    assert (last["date"], last["commit"], last["machine"]) == (
        env["date_utc"],
        env["git_commit"],
        env["device"],
    )
    assert last["versions"] == env["versions"] and last["config"] == payload["config"]
    return payload


def test_every_subcommand_is_listed_with_its_interface(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    listing = capsys.readouterr().out
    names = [module.NAME for module in SUBCOMMANDS]
    assert len(set(names)) == len(names)
    for module in SUBCOMMANDS:
        assert module.NAME in listing and module.HELP
        assert callable(module.add_arguments) and callable(module.run)
    scripts = {p.stem for p in BENCHMARKS.glob("*.py")} - {"__init__", "__main__"}
    shared = {"harness", "records"}
    assert scripts - shared == {m.__name__.rsplit(".", 1)[-1] for m in SUBCOMMANDS}


def test_the_record_format_and_report_examples_run():
    for module in ("records", "report"):
        result = doctest.testmod(importlib.import_module(f"benchmarks.{module}"))
        assert result.attempted > 0 and result.failed == 0, module


def test_benchmarks_md_tables_match_the_records(capsys):
    assert main(["report", "--check"]) == 0, capsys.readouterr().out[-3000:]


def test_a_bad_list_is_refused_at_the_start(bench):
    with pytest.raises(SystemExit, match="--layouts 'sideways'"):
        main(["step", "--smoke", "--layouts", "sideways"])


def test_bench_optimizer_smoke(bench, tmp_path):
    payload = _run(bench, "optimizer", tmp_path, "--impls", "foreach,reference")
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
    payload = _run(bench, "step", tmp_path, "--impls", "foreach", record="step_resnet18_cifar")
    assert payload["config"]["autocast"] == "bfloat16"
    rows = payload["results"]
    assert [(r["optimizer"], r["impl"], r["refresh"], r["layout"]) for r in rows] == [
        ("AdamW", "fused", None, "channels_last"),
        ("AdamW", "fused", None, "nchw"),
        ("AdaFisherW", "foreach", True, "channels_last"),
        ("AdaFisherW", "foreach", False, "channels_last"),
        ("AdaFisherW", "foreach", True, "nchw"),
        ("AdaFisherW", "foreach", False, "nchw"),
    ]
    for row in rows:
        assert row["status"] == "ok", row["note"]
        assert row["median_ms"] > 0 and row["vs_adamw"] > 0
        assert row["reps"] == payload["config"]["steps"]
    # a refresh row counts what its refresh reads; the others read nothing of the kind
    assert all((r.get("refresh_bytes", 0) > 0) == bool(r["refresh"]) for r in rows)
    # the baseline is the fastest AdamW row, whichever layout it ran in
    adamw = [r for r in rows if r["optimizer"] == "AdamW"]
    fastest = min(adamw, key=lambda r: r["median_ms"])
    assert fastest["vs_adamw"] == 1.0 and min(r["vs_adamw"] for r in adamw) == 1.0
    assert payload["config"]["baseline"]["layout"] == fastest["layout"]


def test_bench_train_step_rounds_smoke(bench, tmp_path):
    """Every variant measured in turn, twice: medians and ratios over the rounds."""
    args = ("--impls", "foreach", "--layouts", "channels_last", "--rounds", "2")
    rows = _run(bench, "step", tmp_path, *args, record="step_resnet18_cifar")["results"]
    assert len(rows) == 3
    for row in rows:
        assert row["status"] == "ok", row["note"]
        assert len(row["round_ms"]) == len(row["round_vs_adamw"]) == 2
        assert row["median_ms"] == pytest.approx(sum(row["round_ms"]) / 2)
        assert row["p20_ms"] == min(row["round_ms"]) and row["p80_ms"] == max(row["round_ms"])
        assert row["vs_adamw"] == pytest.approx(sum(row["round_vs_adamw"]) / 2)
    assert rows[0]["round_vs_adamw"] == [1.0, 1.0]  # AdamW against itself, each round


def test_bench_train_step_vit_smoke(bench, tmp_path):
    flags = ("--model", "vit_base_patch16_224", "--impls", "foreach", "--layouts", "channels_last")
    payload = _run(
        bench,
        "step",
        tmp_path,
        *flags,
        "--steps",
        "2",
        record="step_vit_base_patch16_224",
    )
    assert payload["config"]["image_size"] == 32  # the tiny ViT's
    rows = payload["results"]
    assert {r["layout"] for r in rows} == {"channels_last"} and len(rows) == 3
    assert all(r["status"] == "ok" and r["median_ms"] > 0 for r in rows)


def test_refresh_bytes_counts_each_layers_input_and_output_gradient(bench):
    from torch import nn

    from hf_triaccel import AdaFisherW

    harness = bench("harness")
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = AdaFisherW.from_model(model, update_every=1)
    x = torch.randn(5, 4)

    def step() -> None:
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()

    step()
    # float32, 5 samples: the inputs (4 and 8 wide) and output gradients (8 and 2 wide)
    assert harness.refresh_bytes(opt.collector, step) == 4 * 5 * (4 + 8 + 8 + 2)
    opt.collector.remove()


@pytest.mark.parametrize(
    ("model", "layout"), [("efficientnet_b0_cifar", "channels_last"), ("gpt2", "none")]
)
def test_bench_train_step_more_models_smoke(bench, tmp_path, model, layout):
    """The CIFAR EfficientNet-B0 on images, GPT-2 on random tokens (one layout: none)."""
    flags = ("--model", model, "--impls", "foreach", "--layouts", "channels_last", "--steps", "2")
    payload = _run(bench, "step", tmp_path, *flags, record=f"step_{model}")
    rows = payload["results"]
    assert [(r["optimizer"], r["refresh"], r["layout"]) for r in rows] == [
        ("AdamW", None, layout),
        ("AdaFisherW", True, layout),
        ("AdaFisherW", False, layout),
    ]
    assert all(r["status"] == "ok" and r["median_ms"] > 0 for r in rows)


def test_bench_train_step_host_smoke(bench, tmp_path):
    payload = _run(bench, "step", tmp_path, "--host", record="step_host_resnet18_cifar")
    rows = {row["refresh"]: row for row in payload["results"]}
    assert [r["impl"] for r in rows.values()] == ["fused", "triton", "triton"]
    assert all(
        r["status"] == "ok" and r["aten_ops"] > 0 and r["host_ms"] > 0 for r in rows.values()
    )
    # the Fisher refresh adds work to the step: more operators, and more Triton launches
    assert rows[True]["aten_ops"] > rows[False]["aten_ops"]
    assert rows[None]["launches"] == 0 < rows[False]["launches"] < rows[True]["launches"]
    # ... and Python work, counted per function: the statistics hooks run only then
    hook = "hf_triaccel/curvature/collection/hooks.py:ActivationHook.take"
    assert rows[True]["python"][hook][1] > 0
    assert hook not in rows[False]["python"]
    total = {r: sum(v[0] for v in row["python"].values()) for r, row in rows.items()}
    assert total[True] > total[False]


def test_count_python_counts_each_function_once_per_call(bench):
    harness = bench("harness")

    def twice() -> int:
        return sum(square(i) for i in range(2))

    def square(i: int) -> int:
        return i * i

    counts = harness.count_python(twice)
    assert counts == harness.count_python(twice)  # the same work counts the same
    mine = {name.rsplit(".", 1)[-1].rsplit(":", 1)[-1]: v for name, v in counts.items()}
    assert mine["square"][1] == 2 and mine["twice"][1] == 1
    assert mine["square"][0] > 0  # its opcodes


def test_bench_optimizer_host_smoke(bench, tmp_path):
    payload = _run(bench, "optimizer", tmp_path, "--host", record="optimizer_host")
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
    payload = _run(bench, "trainer", tmp_path, "--warmup", str(warmup), "--steps", str(steps))
    assert payload["config"]["world_size"] == 1 and payload["config"]["steps"] == steps
    rows = {r["variant"]: r for r in payload["results"]}
    assert list(rows) == list(bench("trainer").DEFAULT_VARIANTS)
    for row in rows.values():
        assert row["status"] == "ok", row["note"]
        assert row["samples_per_second"] > 0 and row["vs_loop"] > 0
        assert row["steps"] == steps and row["global_step"] == warmup + steps
        assert row["layout"] == "channels_last" and row["compile_seconds"] is None
    assert rows["loop_adamw_fused"]["vs_loop"] == 1.0
    assert payload["config"]["baseline"] == "loop_adamw_fused"
    assert rows["trainer_adafisherw"]["update_every"] >= 1


def test_bench_trainer_compiled_smoke(bench, tmp_path):
    """The compiled variants (dynamo's eager backend here: the routing and the records,
    not inductor's code)."""
    variants = "loop_adamw_fused,loop_adamw_fused_compiled,trainer_adafisherw_compiled"
    flags = ("--warmup", "3", "--steps", "2", "--compile-backend", "eager", "--variants", variants)
    payload = _run(bench, "trainer", tmp_path, *flags)
    rows = {r["variant"]: r for r in payload["results"]}
    assert list(rows) == variants.split(",")
    for row in rows.values():
        assert row["status"] == "ok", row["note"]
        assert row["compiled"] == row["variant"].endswith("_compiled")
        assert (row["compile_seconds"] is not None) == row["compiled"]
    # the ratios are against the faster of the two loops
    assert (
        max(rows["loop_adamw_fused"]["vs_loop"], rows["loop_adamw_fused_compiled"]["vs_loop"])
        == 1.0
    )


def test_bench_trainer_nchw_layout_smoke(bench, tmp_path):
    flags = (
        "--warmup",
        "2",
        "--steps",
        "2",
        "--layout",
        "nchw",
        "--variants",
        "trainer_adafisherw",
    )
    payload = _run(bench, "trainer", tmp_path, *flags)
    (row,) = payload["results"]
    assert row["status"] == "ok" and row["layout"] == "nchw" and row["vs_loop"] is None


def test_bench_elastic_smoke(bench, tmp_path):
    """The figures are recorded; the controller's acceptance is
    tests/memory/test_elastic_acceptance.py."""
    payload = _run(bench, "elastic", tmp_path)
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

    auto, elastic, fixed = payload["trainers"]
    modes = ("auto_find_batch_size", "elastic_batch", "fixed_micro_batch")
    assert (auto["mode"], elastic["mode"], fixed["mode"]) == modes
    for row in (auto, elastic, fixed):
        assert row["status"] == "ok", row["note"]
        assert row["steps"] == payload["config"]["steps"]
        assert 0 < row["first_step_s"] <= row["total_s"] and row["samples_per_s"] > 0
    # auto_find_batch_size found a smaller batch by restarting; elastic kept the batch
    assert auto["oom_restarts"] > 0 and auto["samples_per_step"] < E
    assert elastic["oom_restarts"] == 0 and elastic["samples_per_step"] == E
    assert elastic["accumulation"] >= 2
    assert all(size["micro_batch"] * size["accumulation"] >= E for size in elastic["step_sizes"])
    # the same micro-batch and accumulation without the controller: the ratio's base
    assert (fixed["micro_batch"], fixed["accumulation"]) == (
        elastic["micro_batch"],
        elastic["accumulation"],
    )
    assert fixed["samples_per_step"] == elastic["micro_batch"] * elastic["accumulation"]
    assert fixed["oom_restarts"] == 0 and fixed["events"] == [] and fixed["step_sizes"] == []
    assert fixed["vs_fixed"] == 1.0
    assert elastic["vs_fixed"] == elastic["samples_per_s"] / fixed["samples_per_s"]


def test_bench_elastic_fixed_micro_batch_needs_the_elastic_run():
    with pytest.raises(SystemExit, match="fixed_micro_batch runs the size"):
        main(["elastic", "--smoke", "--parts", "controller,fixed_micro_batch"])


def test_time_to_accuracy_smoke_appends_resumes_and_times(bench, tmp_path, capsys):
    results, times = tmp_path / "tta.jsonl", tmp_path / "times.jsonl"
    flags = ["--smoke", "--results", str(results), "--times", str(times), "--budgets", "1,2"]
    assert main(["time-to-accuracy", *flags]) == 0
    records = [json.loads(line) for line in results.read_text().splitlines()]
    # each budget its own run of every arm, in the order given
    assert [(r["budget_epochs"], r["arm"]) for r in records] == [
        (1, "adamw"),
        (1, "adafisher"),
        (2, "adamw"),
        (2, "adafisher"),
    ]
    assert all(r["steps"] == 2 and r["workers"] == 1 and "env" in r for r in records)
    assert "| arm | time to target | budget | x the better baseline |" in capsys.readouterr().out
    # a second call runs only what the file lacks: one more budget
    assert main(["time-to-accuracy", *flags[:-1], "1,2,3"]) == 0
    records = [json.loads(line) for line in results.read_text().splitlines()]
    assert [(r["budget_epochs"], r["arm"]) for r in records[4:]] == [(3, "adamw"), (3, "adafisher")]
    # timing: the arms in turn, each round once, resumable
    timing = [*flags[:5], "--timing", "--timing_epochs", "1", "--timing_rounds", "2"]
    assert main(["time-to-accuracy", *timing]) == 0
    rounds = [json.loads(line) for line in times.read_text().splitlines()]
    assert [r["arm"] for r in rounds] == ["adamw", "adafisher", "adamw", "adafisher"]
    assert all(r["epoch_seconds"] > 0 and r["batch_size"] == 8 for r in rounds)
    assert main(["time-to-accuracy", *timing]) == 0 and len(times.read_text().splitlines()) == 4


def _budget_run(arm: str, epochs: int, accuracy: float, seed: int = 0, lr: float = 1e-2) -> dict:
    run = dict(dataset="c", arm=arm, lr=lr, weight_decay=0.0, seed=seed, test_accuracy=accuracy)
    run.update(model="resnet18_cifar", budget_epochs=epochs, batch_size=512, workers=4)
    return {**run, "train_seconds": 1.0}


def _timing(arm: str, seconds: float) -> dict:
    timing = {"dataset": "c", "arm": arm, "model": "resnet18_cifar", "batch_size": 512}
    return {**timing, "epoch_seconds": seconds}


def test_time_to_accuracy_summary(bench, tmp_path):
    tta = bench("time_to_accuracy")
    records = [
        _budget_run("adamw", 10, 0.80),
        _budget_run("adamw", 20, 0.86),
        _budget_run("adamw", 40, 0.88),
        _budget_run("adamw", 60, 0.95),  # past the target's budgets: not the target
        _budget_run("sgd", 20, 0.87),
        _budget_run("sgd", 40, 0.885),
        _budget_run("adafisher", 20, 0.89),
        _budget_run("adafisher", 20, 0.85, seed=1),  # the mean of the seeds: 0.87
        _budget_run("adafisher", 40, 0.90),
        _budget_run("adafisher", 40, 0.89, lr=2e-2),  # a worse lr at seed 0: not chosen
        _budget_run("curvature_off", 20, 0.70),
    ]
    times = [_timing("adamw", 1.0), _timing("sgd", 0.9), _timing("sgd", 1.1), _timing("sgd", 2.0)]
    times += [_timing("adafisher", 1.2)]
    entry = tta.summarise(records, times)[("c", "resnet18_cifar", 512)]
    assert entry["target"] == pytest.approx(88.0)
    assert entry["arms"]["adafisher"][20]["accuracy"] == pytest.approx(87.0)
    assert entry["arms"]["adafisher"][40]["lr"] == 1e-2
    assert entry["reached"] == {"adamw": 40, "sgd": 40, "adafisher": 40, "curvature_off": None}
    # time: the budget times the median epoch time; the better baseline is AdamW's 40 s
    assert entry["arms"]["sgd"][40]["seconds"] == pytest.approx(44.0)
    assert entry["ratio"]["adafisher"] == pytest.approx(48.0 / 40.0)
    assert entry["ratio"]["sgd"] == pytest.approx(44.0 / 40.0)
    text = tta.report({("c", "resnet18_cifar", 512): entry})
    assert "| adafisher | 48.0 s | 40 epochs | 1.20x |" in text
    assert "| curvature_off | not reached | | |" in text
    # the plot takes budgets run at 3 seeds: these have 1 or 2
    with pytest.raises(ValueError, match="3 seeds"):
        tta.plot({("c", "resnet18_cifar", 512): entry}, records, tmp_path / "curves.png")
    seeded = [{**r, "seed": s} for r in records if r["seed"] == 0 for s in (0, 1, 2)]
    tta.plot(tta.summarise(seeded, times), seeded, tmp_path / "curves.png")
    assert (tmp_path / "curves.png").read_bytes().startswith(b"\x89PNG")
    # without timing records, a run made alone times itself and a shared one is n/a
    alone = [{**r, "workers": 1, "train_seconds": 30.0} for r in records if r["arm"] == "sgd"]
    entry = tta.summarise([*records[:4], *alone], [])[("c", "resnet18_cifar", 512)]
    assert entry["arms"]["sgd"][40]["seconds"] == 30.0
    assert entry["arms"]["adamw"][40]["seconds"] is None and entry["ratio"]["sgd"] == 1.0


def _stage_run(dataset: str, arm: str, lr: float, seed: int, accuracy: float) -> dict:
    run = _budget_run(arm, 15, accuracy, seed=seed, lr=lr)
    return {**run, "dataset": dataset, "weight_decay": 5e-4}


def test_chosen_values_change_the_rule_only_beyond_the_noise(bench):
    tta = bench("time_to_accuracy")
    records = []
    for dataset in ("cifar10", "cifar100"):
        for seed, (published, paper) in enumerate([(0.80, 0.83), (0.81, 0.84), (0.79, 0.85)]):
            records += [_stage_run(dataset, "adafisher", 1e-2, seed, published)]
            records += [_stage_run(dataset, "adafisher_paper", 3e-2, seed, paper)]
            records += [_stage_run(dataset, "adamw", 2e-2, seed, 0.8)]
    chosen = tta.chosen_values(records)
    # the paper rule wins on both data sets by more than either spread (2 points)
    assert chosen["rule"] == "adafisher_paper"
    assert chosen["adafisher"] == {
        "ema": "paper",
        "normalise": "absolute",
        "factor_init": "zeros",
        "update_every": 1,
        "damping": 1e-3,
        "lr": 3e-2,
    }
    assert chosen["margins"]["adafisher_paper"]["cifar100/resnet18_cifar/15/512"] == {
        "difference": 4.0,
        "noise": 2.0,
    }
    assert chosen["recipes"]["cifar100_resnet18"]["baseline_learning_rate"] == 2e-2

    def shifted(by: float) -> list[dict]:
        return [
            {**r, "test_accuracy": r["test_accuracy"] + by}
            if r["dataset"] == "cifar100" and r["arm"] == "adafisher_paper"
            else r
            for r in records
        ]

    # within the noise on one data set, beyond it on the other: still a win
    assert tta.chosen_values(shifted(-0.025))["rule"] == "adafisher_paper"
    # worse beyond the noise on one data set: the published rule stays
    assert tta.chosen_values(shifted(-0.065))["rule"] == "adafisher"
    # a single seed in another comparison counts with the largest 3-seed spread as noise
    other = [{**r, "batch_size": 2048, "seed": 0} for r in records if r["seed"] == 0]
    far = [{**r, "test_accuracy": 0.70} if r["arm"] == "adafisher_paper" else r for r in other]
    assert tta.chosen_values(records + far)["rule"] == "adafisher"  # 10 points worse
    near = [{**r, "test_accuracy": 0.785} if r["arm"] == "adafisher_paper" else r for r in other]
    assert tta.chosen_values(records + near)["rule"] == "adafisher_paper"  # 1.5 < 2 worse
    # within the noise everywhere: no change
    level = [{**r, "test_accuracy": 0.80} if r["arm"] == "adafisher_paper" else r for r in records]
    assert tta.chosen_values(level)["rule"] == "adafisher"


def test_bench_commits_smoke(tmp_path, capsys):
    """Two commits' packages (here HEAD given as its hash and as its git archive, the form
    for a machine without the history), each assembled and timed in its own process: rows
    for every variant of each, and the summary of their medians."""
    archive = tmp_path / "head.tar"
    with archive.open("wb") as f:
        git = ["git", "-C", str(BENCHMARKS.parent), "archive", "HEAD", "hf_triaccel"]
        subprocess.run(git, stdout=f, check=True)
    rev = ["git", "-C", str(BENCHMARKS), "rev-parse", "HEAD"]
    head = subprocess.run(rev, capture_output=True, text=True, check=True).stdout.strip()
    commits = [str(archive), head]
    out = ["--rounds", "1", "--out", str(tmp_path)]
    assert main(["commits", *commits, "--smoke", *out]) == 0
    rows = json.loads((tmp_path / "commits_rounds.json").read_text())
    assert rows == _load(tmp_path / "commits.json")["results"]
    assert [r["commit"] for r in rows] == [c for c in commits for _ in range(3)]
    assert {(r["optimizer"], r["update_every"]) for r in rows} == {
        ("adamw", 0),
        ("adafisherw", 1),
        ("adafisherw", 10**9),
    }
    assert all(r["train_step_ms"] > 0 and r["optimizer_step_ms"] > 0 for r in rows)
    stdout = capsys.readouterr().out
    summary = stdout[stdout.index("| commit | optimizer | update_every | train step ms,") :]
    summary = summary[: summary.index("wrote ")]
    assert summary.count("\n| ") == len(rows)  # one round: a median a row
    assert all(f"| {c} | adamw | 0 |" in summary for c in commits)
    assert summary.count(" 1.000x |") >= len(commits)  # AdamW against itself


def test_commits_assemble_the_kernels_of_a_commit_before_they_moved(tmp_path):
    """Up to dbf24d3 the kernels lived in a top-level kernels/ folder: the assembled
    package holds them as hf_triaccel.kernels."""
    commits = importlib.import_module("benchmarks.commits")
    listed = ["git", "-C", str(BENCHMARKS), "cat-file", "-e", "dbf24d3^{commit}"]
    if subprocess.run(listed, capture_output=True).returncode:
        pytest.skip("a clone without dbf24d3")
    tree = commits.assemble("dbf24d3", tmp_path / "old")
    assert (tree / "hf_triaccel" / "kernels" / "stats.py").is_file()
    assert not (tree / "kernels").exists()


def test_equal_epochs_smoke_appends_resumes_and_summarises(bench, tmp_path, capsys):
    ee, results = bench("accuracy"), tmp_path / "ee.jsonl"
    assert main(["accuracy", "--smoke", "--results", str(results)]) == 0
    records = [json.loads(line) for line in results.read_text().splitlines()]
    assert [r["arm"] for r in records] == ["adamw", "curvature_off", "adafisher_paper"]
    # each arm trains with its own optimizer and fold rule
    assert [(r["optimizer"], r["ema"]) for r in records] == [
        ("adamw", None),
        ("sgd_ema", None),
        ("adafisher", "paper"),
    ]
    assert all(r["steps"] == ee.SMOKE_STEPS and r["budget_epochs"] == 15 for r in records)
    # the paper rule's factors vary; no spread is recorded for the other optimizers
    assert records[0]["preconditioner_spread"] is None
    assert (
        records[2]["preconditioner_spread"]["max"]
        >= records[2]["preconditioner_spread"]["median"]
        >= 1
    )
    assert "| adamw | 0.003 | 0.05 | 1 |" in capsys.readouterr().out
    # a second call runs only what the file lacks: one more seed of one arm
    assert (
        main(
            [
                "accuracy",
                "--smoke",
                "--results",
                str(results),
                "--seeds",
                "0,1",
                "--grid",
                "adamw:lr=3e-3:wd=0.05",
            ]
        )
        == 0
    )
    records = [json.loads(line) for line in results.read_text().splitlines()]
    assert [(r["arm"], r["seed"]) for r in records[3:]] == [("adamw", 1)]


def _grid_run(arm: str, lr: float, seed: int, accuracy: float, wd: float = 0.05) -> dict:
    run = dict(dataset="c", arm=arm, lr=lr, weight_decay=wd, seed=seed, test_accuracy=accuracy)
    return {**run, "model": "m", "budget_epochs": 15, "batch_size": 512}


def test_equal_epochs_summary_chooses_at_the_sweep_seed(bench):
    ee = bench("accuracy")
    records = [
        _grid_run("adamw", 1e-3, 0, 0.60),
        _grid_run("adamw", 2e-3, 0, 0.64),
        _grid_run("adamw", 2e-3, 1, 0.62),
        _grid_run("adamw", 4e-3, 0, 0.63),
        _grid_run("adamw", 4e-3, 1, 0.70),  # a better second seed does not choose it
        _grid_run("adamw", 2e-3, 0, 0.66, wd=0.1),  # another weight decay: its own neighbours
    ]
    arm = ee.summarise(records)[("c", "m", 15, 512)]["adamw"]
    assert arm["best"] == (2e-3, 0.1)
    assert arm["neighbours"] == [None, None]
    arm = ee.summarise(records[:5])[("c", "m", 15, 512)]["adamw"]
    assert arm["best"] == (2e-3, 0.05)
    assert arm["configs"][arm["best"]]["mean"] == pytest.approx(63.0)
    assert arm["configs"][arm["best"]]["spread"] == pytest.approx(2.0)
    assert [n["acc"][0] for n in arm["neighbours"]] == [60.0, 63.0]
    assert "| adamw | 0.002 | 0.05 | 2 | 63.00% | 2.00 | 60.00% | 63.00% |" in ee.report(
        ee.summarise(records[:5])
    )


@pytest.mark.parametrize("kind", ["sgd", "sgd_ema"])
def test_sgd_arms(bench, kind):
    harness = bench("harness")
    model = torch.nn.Linear(3, 2)
    opt = harness.make_optimizer(kind, model, lr=0.5, weight_decay=0.0)
    group = opt.param_groups[0]
    # sgd: Nesterov; sgd_ema: AdaFisher's momentum, m <- 0.9 m + 0.1 g
    assert group["momentum"] == 0.9 and group["nesterov"] == (kind == "sgd")
    assert group["dampening"] == (0.9 if kind == "sgd_ema" else 0.0)


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_baselines_decay_every_parameter_or_exempt_the_ones_adafisher_exempts(bench, kind):
    harness = bench("harness")
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    everything = harness.make_optimizer(kind, model, weight_decay=0.1)
    assert [(len(g["params"]), g["weight_decay"]) for g in everything.param_groups] == [(4, 0.1)]
    exempt = harness.make_optimizer(kind, model, weight_decay=0.1, decay="exempt")
    ours = harness.make_optimizer("adafisher", model, weight_decay=0.1)
    for groups in (exempt.param_groups, ours.param_groups):
        assert [(g["params"], g["weight_decay"]) for g in groups] == [
            ([model[0].weight], 0.1),
            ([model[0].bias, model[1].weight, model[1].bias], 0.0),
        ]
    ours.collector.remove()
    with pytest.raises(ValueError, match="decay='some': choose one of"):
        harness.make_optimizer(kind, model, decay="some")


def test_profile_refresh_smoke(bench, tmp_path):
    from torch import nn

    from hf_triaccel.curvature.collection.layer import LayerFactors
    from hf_triaccel.curvature.rules.batching import StatisticsBatch

    taken, flush = LayerFactors.take_activation, StatisticsBatch.flush
    payload = _run(bench, "refresh", tmp_path, "--trace", record="refresh_resnet18_cifar")
    # the labels are gone after profiling
    assert LayerFactors.take_activation is taken and StatisticsBatch.flush is flush
    results = payload["results"]
    refresh = results["AdaFisherW, refresh every step"]["ranges"]
    convs = sum(
        isinstance(m, nn.Conv2d)
        for m in bench("harness").build_model("resnet18_cifar", "tiny").modules()
    )
    # every conv writes its a and g once a step; the fold runs once, inside the step
    assert refresh["a: ConvRule"][0] == refresh["g: ConvRule"][0] == convs
    assert refresh["fold"][0] == 1
    assert refresh["flush"][0] >= 2  # the fold launches what the batches still hold
    for name in ("AdamW(fused)", "AdaFisherW, no refresh"):
        ranges = results[name]["ranges"]
        assert set(ranges) == {"zero_grad", "forward", "backward", "optimizer step"}
        assert all(calls == 1 for calls, _, _ in ranges.values())
    for result in results.values():
        assert result["wall_ms"] > 0 and result["aten_ops"] > 0
    # the refresh step runs more operators than the step without it
    assert (
        results["AdaFisherW, refresh every step"]["aten_ops"]
        > results["AdaFisherW, no refresh"]["aten_ops"]
    )
    table = (tmp_path / "refresh_resnet18_cifar.md").read_text()
    assert "What a refresh adds" in table and "|   a: ConvRule |" in table
    assert (tmp_path / "refresh_resnet18_cifar.trace.json").stat().st_size > 0


@pytest.mark.parametrize("which", ["fast", "refresh", "long"])
@pytest.mark.parametrize("smoke", [False, True])
def test_suite_stages_are_valid_commands(tmp_path, which, smoke):
    """Every stage a suite plans, full size or smoke, is a command line its measurement
    accepts (the long suite's recipe runs are the recipe's own command)."""
    suite = importlib.import_module("benchmarks.suite")
    args = parser().parse_args(["suite", which, "--data", "embedded"] + ["--smoke"] * smoke)
    planned = suite.stages(args, tmp_path)
    assert len({name for name, _, _ in planned}) == len(planned)
    assert sum(limit for _, limit, _ in planned) <= 600  # one call of the GPU machine
    for name, _, command in planned:
        if command[1:3] == ["-m", "benchmarks"]:
            parsed = parser().parse_args(command[3:])
            assert parsed.smoke == smoke, name
        else:
            assert "recipes/train.py" in command and name.startswith("recipe")
    if which == "long":  # the loop clips as the recipe's Trainer does, at its default norm
        loop = next(command for name, _, command in planned if name == "loop")
        clip = float(loop[loop.index("--max_grad_norm") + 1])
        assert clip == TrainingArguments(output_dir=str(tmp_path)).max_grad_norm


def test_suite_runs_its_stages_in_turn_each_under_its_limit(tmp_path, monkeypatch):
    """Each stage in turn, its output in its log, its exit status (a stage past its limit:
    ``timeout``) and tables in the summary; the exit status counts the failed stages."""
    suite = importlib.import_module("benchmarks.suite")
    write = "import pathlib, sys; d = pathlib.Path(sys.argv[1]); d.mkdir(); "
    write += "(d / 't.md').write_text('| a |'); print('ran')"
    planned = [
        ("first", 60, [sys.executable, "-c", write, str(tmp_path / "first")]),
        ("stuck", 1, [sys.executable, "-c", "import time; time.sleep(30)"]),
        ("failing", 60, [sys.executable, "-c", "raise SystemExit(3)"]),
    ]
    monkeypatch.setattr(suite, "stages", lambda args, out: planned)
    assert main(["suite", "fast", "--data", "embedded", "--out", str(tmp_path)]) == 2
    text = (tmp_path / "suite_fast.md").read_text()
    assert "exit 0 after" in text and "exit timeout after" in text and "exit 3 after" in text
    assert text.index("## first") < text.index("| a |") < text.index("## stuck")
    assert (tmp_path / "first.log").read_text() == "ran\n"
    assert "2 stage(s) failed" in text
    with pytest.raises(SystemExit, match="--stages"):
        main(["suite", "fast", "--stages", "nothing", "--out", str(tmp_path)])


def test_suite_long_acceptance_checks_from_the_records(tmp_path):
    """The long suite's figures from its stages' records: the recipe against the loop,
    compiled against eager, the elastic batch against its fixed micro-batch."""
    suite = importlib.import_module("benchmarks.suite")
    (tmp_path / "loop").mkdir()
    loop = {"steps": 30, "batch_size": 512, "train_seconds": 20.0, "images_per_second": 900.0}
    loop.update(eval_seconds=1.0, test_accuracy=0.9)
    (tmp_path / "loop" / "cifar.json").write_text(json.dumps(loop))
    (tmp_path / "elastic").mkdir()
    elastic = {"trainers": [{"mode": "elastic_batch", "vs_fixed": 0.97}]}
    (tmp_path / "elastic" / "elastic.json").write_text(json.dumps(elastic))
    for name, steady, accuracy in (("recipe", 900.0, 0.9), ("recipe_compile", 1200.0, 0.897)):
        (tmp_path / name).mkdir()
        results = {"train_runtime_s": 12.0, "eval_runtime_s": 2.0, "optimizer_steps": 30}
        results.update(settings={"total_batch_size": 512}, eval_accuracy=accuracy)
        results["steady_samples_per_second"] = steady
        (tmp_path / name / "results.json").write_text(json.dumps(results))
    payload, text = suite.acceptance(tmp_path)
    checks = {c["check"]: c for c in payload["checks"]}
    # the recipe trained 30 x 512 samples in 12 - 2 s; the loop 30 x 512 in 20 s
    assert checks["recipe / loop, training samples/s"]["value"] == pytest.approx(2.0)
    assert checks["compiled / eager recipe, steady samples/s"]["value"] == pytest.approx(4 / 3)
    assert checks["compiled - eager accuracy, points"]["value"] == pytest.approx(0.3)
    assert checks["elastic / fixed micro-batch, samples/s"]["value"] == 0.97
    assert all(c["met"] for name, c in checks.items() if "points" not in name)
    assert "| check | measured | target | met |" in text and "no records" in text
    empty = tmp_path / "empty"
    empty.mkdir()
    payload, _ = suite.acceptance(empty)  # a stage that left nothing fails its checks
    assert not any(c["met"] for c in payload["checks"]) and payload["runs"]["loop"] is None
