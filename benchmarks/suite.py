"""Several measurements in one call, each a stage under its own time limit.

``fast`` (default; about 4 minutes on one H200): the ResNet-18 and ViT-B/16 training
steps, the Trainer against the loop, compiled against eager. ``long`` (under 10 minutes):
the CIFAR-10 recipe at full length against the hand-written loop, compiled against eager,
the elastic batch and a time-to-accuracy budget, then the acceptance checks. ``refresh``
(under 10 minutes): the step and the refresh profile of the ResNet-18, ViT-B/16,
EfficientNet-B0 and GPT-2 small. Each stage writes into ``$OUT/<stage>/`` and its output
into ``$OUT/<stage>.log``; ``$OUT/suite_<name>.md`` collects every stage's command, exit
status, time and tables. ``--smoke``: the stages' smoke forms on the CPU (timm's
``test_resnet`` for the recipe). The exit status is the number of stages that failed.

Usage:
    python -m benchmarks suite [fast|long|refresh] --out "$OUT"
    python -m benchmarks suite long --smoke --out /tmp/suite   # CPU, tiny models
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import accuracy, harness, time_to_accuracy

NAME = "suite"
HELP = "several measurements in one call: fast (steps, Trainer), long (acceptance), refresh"

RECIPE_VS_LOOP, RECIPE_ACCURACY = 0.9, 0.89  # samples/s ratio; test accuracy
COMPILE_VS_EAGER, COMPILE_ACCURACY_POINTS = 1.0, 0.3  # steady samples/s ratio; |difference|
ELASTIC_VS_FIXED = 0.95  # samples/s ratio
VIT = "vit_base_patch16_224"
REFRESH_MODELS = ("resnet18_cifar", "vit_base_patch16_224", "efficientnet_b0_cifar", "gpt2")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Which suite, the data, the compile backend."""
    parser.add_argument("which", nargs="?", choices=("fast", "long", "refresh"), default="fast")
    parser.add_argument("--out", help="results directory (default: $OUT, else the current one)")
    parser.add_argument("--smoke", action="store_true", help="the stages' smoke forms, CPU")
    parser.add_argument(
        "--data", help="CIFAR-10 parquet folder (default .data/cifar10, else the slice)"
    )
    parser.add_argument("--backend", default="inductor", help="torch.compile's, compiled stages")
    parser.add_argument("--stages", help="comma-separated: only these stages (default: all)")


def stages(args: argparse.Namespace, out: Path) -> list[tuple[str, int, list[str]]]:
    """``(name, seconds allowed, command)`` of each stage of ``args.which``, run from the
    repository root, each writing into ``out/<name>``."""
    bench = [sys.executable, "-m", "benchmarks"]
    smoke = ["--smoke"] if args.smoke else []
    impls = ["--impls", "foreach" if args.smoke else "triton"]
    data = ["--data", args.data]
    if args.which == "fast":
        vit = [] if args.smoke else ["--warmup", "10", "--steps", "50"]
        steps = ["--steps", "3", "--warmup", "3"] if args.smoke else ["--steps", "300"]
        trainer = [*bench, "trainer", *smoke, *data, *steps, "--variants"]
        compiled = "trainer_adafisherw_compiled,loop_adamw_fused_compiled,trainer_adafisherw"
        found = [
            ("step_resnet18", 100, [*bench, "step", *smoke, *impls]),
            ("step_vit_b16", 120, [*bench, "step", *smoke, *impls, "--model", VIT, *vit]),
            ("trainer", 110, [*trainer, "loop_adamw_fused,trainer_adamw_fused,trainer_adafisherw"]),
            ("trainer_compile", 230, [*trainer, compiled, "--compile-backend", args.backend]),
        ]
        return [(name, limit, [*cmd, "--out", str(out / name)]) for name, limit, cmd in found]
    if args.which == "refresh":
        found = []
        for model in REFRESH_MODELS:
            vit = ["--warmup", "10", "--steps", "50"] if model == VIT and not args.smoke else []
            flags = [*smoke, "--model", model, *impls, *vit]
            step = [*bench, "step", "--layouts", "channels_last", *flags]
            found.append((f"step_{model}", 90 if vit else 70, step))
            # a CPU without native bf16 runs EfficientNet's bf16 convolutions as loops of
            # some 430,000 profiler events a step: the smoke run profiles the others
            if not (args.smoke and model == "efficientnet_b0_cifar"):
                found.append((f"refresh_{model}", 60, [*bench, "refresh", *flags, "--trace"]))
        return [(name, limit, [*cmd, "--out", str(out / name)]) for name, limit, cmd in found]
    # the acceptance runs: the recipe as a user runs it (accelerate launch, one process),
    # the loop on the same data, epochs and batch, the compiled recipe, the elastic batch
    # and a time-to-accuracy budget at the chosen values
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1"]
    launch += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    recipe = [*launch, "recipes/train.py", "--recipe", "cifar10_resnet18", "--dataset"]
    recipe += [args.data, "--disable_tqdm", "true"]
    loop = ["--epochs", "30", "--batch_size", "512"]
    elastic, budget = ["--steps", "60"], "10"
    if args.smoke:
        recipe += ["--model", "test_resnet", "--use_cpu", "--max_steps", "4", "--plot", "false"]
        recipe += ["--per_device_train_batch_size", "8", "--per_device_eval_batch_size", "100"]
        recipe += ["--logging_steps", "1"]
        loop, elastic, budget = ["--batch_size", "8", "--max_steps", "3"], [], "1"
    compiled = ["--torch_compile", "true", "--torch_compile_backend", args.backend]
    tta = out / "time_to_accuracy"
    grid = ["--grid", "adamw:lr=2.4e-2:wd=0.1", "adafisher:lr=1.2e-2", "--budgets", budget]
    grid += ["--results", str(tta / "time_to_accuracy.jsonl")]
    grid += ["--times", str(tta / "epoch_seconds.jsonl")]
    cifar = [*bench, "cifar", *smoke, *data, "--optimizer", "adamw", *loop]
    cifar += ["--max_grad_norm", "1.0", "--out", str(out / "loop" / "cifar.json")]
    elastic += ["--parts", "elastic_batch,fixed_micro_batch", "--out", str(out / "elastic")]
    return [
        ("recipe", 130, [*recipe, "--output_dir", str(out / "recipe_scratch")]),
        ("loop", 100, cifar),
        (
            "recipe_compile",
            205,
            [*recipe, *compiled, "--output_dir", str(out / "recipe_compile_scratch")],
        ),
        ("elastic", 60, [*bench, "elastic", *smoke, *elastic]),
        ("time_to_accuracy", 80, [*bench, "time-to-accuracy", *smoke, *data, *grid]),
    ]


def run_stage(name: str, limit: int, command: list[str], out: Path) -> tuple[int | str, float]:
    """Runs one stage under its time limit, its output into ``out/<name>.log``; returns
    its exit status (``"timeout"`` past the limit) and seconds."""
    start = time.perf_counter()
    with (out / f"{name}.log").open("w") as log:
        try:
            done = subprocess.run(
                command, stdout=log, stderr=subprocess.STDOUT, timeout=limit, cwd=harness.REPO_ROOT
            )
            status: int | str = done.returncode
        except subprocess.TimeoutExpired:
            status = "timeout"
    return status, time.perf_counter() - start


def load(path: Path) -> dict[str, Any] | None:
    """A JSON file, or ``None`` when the stage left none."""
    return json.loads(path.read_text()) if path.is_file() else None


def recipe_figures(folder: Path) -> dict[str, Any] | None:
    """A recipe run's figures: training samples/s (evaluations left out), steady samples/s,
    wall time (``Trainer.train()``, its evaluations included), evaluation time, test
    accuracy, compilation seconds."""
    results, report = load(folder / "results.json"), load(folder / "efficiency_report.json")
    if results is None:
        return None
    training_s = results["train_runtime_s"] - results["eval_runtime_s"]
    # the samples trained: whole batches only, an epoch's remainder is not trained on
    samples = results["optimizer_steps"] * results["settings"]["total_batch_size"]
    return {
        "samples_per_second": samples / training_s,
        "steady_samples_per_second": results["steady_samples_per_second"],
        "wall_s": results["train_runtime_s"],
        "eval_s": results["eval_runtime_s"],
        "accuracy": results["eval_accuracy"],
        "compile_seconds": (report or {}).get("compile_seconds"),
    }


def loop_figures(path: Path) -> dict[str, Any] | None:
    """The hand-written loop's figures, as :func:`recipe_figures` names them."""
    record = load(path)
    if record is None:
        return None
    return {
        "samples_per_second": record["steps"] * record["batch_size"] / record["train_seconds"],
        "steady_samples_per_second": record["images_per_second"],  # epochs after the first
        "wall_s": record["train_seconds"] + record["eval_seconds"],  # one evaluation, at the end
        "eval_s": record["eval_seconds"],
        "accuracy": record["test_accuracy"],
        "compile_seconds": None,
    }


def check(name: str, value: float | None, op: str, target: float, spec: str) -> dict:
    """One acceptance check: the measured value, its target (``op``: ``>=`` or ``<=``
    ``target``), and whether it is met (not when unmeasured)."""
    met = value is not None and (value >= target if op == ">=" else value <= target)
    shown, target_text = harness.fmt(value, spec), f"{op} {target}"
    return {"check": name, "value": value, "shown": shown, "target": target_text, "met": met}


def acceptance(out: Path) -> tuple[dict[str, Any], str]:
    """The long suite's figures and checks from its stages' records, and their tables."""
    runs = {
        "recipe": recipe_figures(out / "recipe"),
        "loop": loop_figures(out / "loop" / "cifar.json"),
        "recipe_compile": recipe_figures(out / "recipe_compile"),
    }
    rows = {
        r["mode"]: r for r in (load(out / "elastic" / "elastic.json") or {}).get("trainers", [])
    }
    elastic = rows.get("elastic_batch", {}).get("vs_fixed")
    recipe, compiled = runs["recipe"], runs["recipe_compile"]

    def ratio(a: dict | None, b: dict | None, key: str) -> float | None:
        return a[key] / b[key] if a and b and a.get(key) and b.get(key) else None

    points = compiled and recipe and 100 * abs(compiled["accuracy"] - recipe["accuracy"])
    checks = [
        check(
            "recipe / loop, training samples/s",
            ratio(recipe, runs["loop"], "samples_per_second"),
            ">=",
            RECIPE_VS_LOOP,
            ".3f",
        ),
        check("recipe test accuracy", recipe and recipe["accuracy"], ">=", RECIPE_ACCURACY, ".4f"),
        check(
            "compiled / eager recipe, steady samples/s",
            ratio(compiled, recipe, "steady_samples_per_second"),
            ">=",
            COMPILE_VS_EAGER,
            ".3f",
        ),
        check("compiled - eager accuracy, points", points, "<=", COMPILE_ACCURACY_POINTS, ".2f"),
        check("elastic / fixed micro-batch, samples/s", elastic, ">=", ELASTIC_VS_FIXED, ".3f"),
    ]
    tta = out / "time_to_accuracy" / "time_to_accuracy.jsonl"
    budget = accuracy.read_records([tta]) if tta.is_file() else []
    summary = time_to_accuracy.summarise(budget, [])  # its runs were made alone
    fmt = harness.fmt
    columns = {
        "run": lambda r: r[0],
        "training samples/s": lambda r: fmt(r[1] and r[1]["samples_per_second"], ".1f"),
        "steady samples/s": lambda r: fmt(r[1] and r[1]["steady_samples_per_second"], ".1f"),
        "wall s": lambda r: fmt(r[1] and r[1]["wall_s"], ".1f"),
        "evaluation s (in wall s)": lambda r: fmt(r[1] and r[1]["eval_s"], ".1f"),
        "test accuracy": lambda r: fmt(r[1] and r[1]["accuracy"], ".4f"),
        "compile s": lambda r: fmt(r[1] and r[1]["compile_seconds"], ".1f"),
    }
    verdicts = {
        "check": lambda r: r["check"],
        "measured": lambda r: r["shown"],
        "target": lambda r: r["target"],
        "met": lambda r: "yes" if r["met"] else "NO",
    }
    text = f"{harness.table(list(runs.items()), columns)}\n\n{harness.table(checks, verdicts)}"
    text += "\n\ntime to accuracy (sanity budget):\n" + (
        time_to_accuracy.report(summary) if budget else "no records"
    )
    return {"runs": runs, "checks": checks, "elastic_vs_fixed": elastic}, text


def run(args: argparse.Namespace) -> int:
    """Runs the stages in turn, then (``long``) the acceptance checks; returns the number
    of stages that failed."""
    out = harness.out_dir(args)
    if args.data is None:
        cifar = harness.REPO_ROOT / ".data" / "cifar10"
        args.data = str(cifar) if (cifar / "train.parquet").is_file() else "embedded"
    env = harness.environment(args.argv, torch.device("cpu"))
    lines = [
        f"# suite {args.which}\n\n`{env['command']}`, commit {env['git_commit']}, "
        f"{env['date_utc']}, {env['device']}, torch {env['versions']['torch']}"
    ]
    failed, planned = 0, stages(args, out)
    if args.stages:
        chosen = harness.split(args.stages, [name for name, _, _ in planned], "--stages")
        planned = [stage for stage in planned if stage[0] in chosen]
    for name, limit, command in planned:
        limit = max(limit, 600) if args.smoke else limit  # the limits are the GPU runs'
        status, seconds = run_stage(name, limit, command, out)
        scratch = out / f"{name}_scratch"
        if scratch.is_dir():  # a recipe's run: its records kept, not its model
            (out / name).mkdir(exist_ok=True)
            for kept in ("results.json", "efficiency_report.json", "history.json"):
                if (scratch / kept).is_file():
                    shutil.copy(scratch / kept, out / name / kept)
            shutil.rmtree(scratch)
        failed += status != 0
        lines.append(
            f"## {name}\n\n`{' '.join(command[1:])}` (limit {limit} s)\n\n"
            f"exit {status} after {seconds:.0f} s"
        )
        lines += [table.read_text() for table in sorted((out / name).glob("*.md"))]
        print(lines[-1], flush=True)
    if args.which == "long":
        payload, text = acceptance(out)
        (out / "acceptance.json").write_text(json.dumps(payload, indent=2) + "\n")
        lines.append(f"## acceptance\n\n{text}")
        failed += any(run is None for run in payload["runs"].values())
    lines.append(f"{failed} stage(s) failed; records in {out}")
    text = "\n\n".join(lines)
    (out / f"suite_{args.which}.md").write_text(text + "\n")
    print(text)
    return failed
