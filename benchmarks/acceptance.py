"""The acceptance figures of ``fast_defaults.sh --long``, from the records of its stages.

Reads, under the records folder: ``recipe/`` and ``recipe_compile/`` (the recipe's
``results.json`` and ``efficiency_report.json``), ``loop/train_cifar.json`` (the
hand-written AdamW(fused) loop), ``elastic/bench_elastic.json`` and
``time_to_accuracy/time_to_accuracy.jsonl``. Prints each figure against its target and
writes ``acceptance/acceptance.md`` and ``acceptance.json`` there. A record that is missing
fails its checks (``n/a``).

Usage:
    python benchmarks/acceptance.py "$OUT"
"""

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import equal_epochs
import harness
import time_to_accuracy

RECIPE_VS_LOOP, RECIPE_ACCURACY = 0.9, 0.89  # samples/s ratio; test accuracy
COMPILE_VS_EAGER, COMPILE_ACCURACY_POINTS = 1.0, 0.3  # steady samples/s ratio; |difference|
ELASTIC_VS_FIXED = 0.95  # samples/s ratio


def load(path: Path) -> dict[str, Any] | None:
    """A JSON record, or ``None`` when the stage left none."""
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


def ratio(a: dict | None, b: dict | None, key: str) -> float | None:
    """``a[key] / b[key]``, or ``None`` when either is missing."""
    return a[key] / b[key] if a and b and a.get(key) and b.get(key) else None


def check(name: str, value: float | None, op: str, target: float, spec: str) -> dict:
    """One acceptance check: the measured value, its target (``op``: ``>=`` or ``<=``
    ``target``), and whether it is met (not when unmeasured)."""
    met = value is not None and (value >= target if op == ">=" else value <= target)
    shown, target_text = harness.fmt(value, spec), f"{op} {target}"
    return {"check": name, "value": value, "shown": shown, "target": target_text, "met": met}


def checks(runs: dict[str, dict | None], elastic: float | None) -> list[dict[str, Any]]:
    """The acceptance checks of the recipe, its compiled run and the elastic batch."""
    recipe, compiled = runs["recipe"], runs["recipe_compile"]
    vs_loop = ratio(recipe, runs["loop"], "samples_per_second")
    vs_eager = ratio(compiled, recipe, "steady_samples_per_second")
    points = compiled and recipe and 100 * abs(compiled["accuracy"] - recipe["accuracy"])
    return [
        check("recipe / loop, training samples/s", vs_loop, ">=", RECIPE_VS_LOOP, ".3f"),
        check("recipe test accuracy", recipe and recipe["accuracy"], ">=", RECIPE_ACCURACY, ".4f"),
        check("compiled / eager recipe, steady samples/s", vs_eager, ">=", COMPILE_VS_EAGER, ".3f"),
        check("compiled - eager accuracy, points", points, "<=", COMPILE_ACCURACY_POINTS, ".2f"),
        check("elastic / fixed micro-batch, samples/s", elastic, ">=", ELASTIC_VS_FIXED, ".3f"),
    ]


def elastic_ratio(path: Path) -> float | None:
    """The elastic Trainer's samples/s over the fixed micro-batch's."""
    record = load(path)
    rows = {r["mode"]: r for r in (record or {}).get("trainers", [])}
    return rows.get("elastic_batch", {}).get("vs_fixed")


def report(runs: dict[str, dict | None], rows: list[dict], tta: str) -> str:
    """The runs, the checks and the time-to-accuracy summary, as markdown."""
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
    parts = [harness.table(list(runs.items()), columns), harness.table(rows, verdicts)]
    return "\n\n".join([*parts, "time to accuracy (sanity budget):", tta])


def main(argv: Sequence[str] | None = None) -> int:
    """Prints and writes the acceptance figures; returns 1 when a record is missing."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 1:
        print(__doc__.split("Usage:")[-1].strip(), file=sys.stderr)
        return 2
    root = Path(argv[0])
    runs = {
        "recipe": recipe_figures(root / "recipe"),
        "loop": loop_figures(root / "loop" / "train_cifar.json"),
        "recipe_compile": recipe_figures(root / "recipe_compile"),
    }
    elastic = elastic_ratio(root / "elastic" / "bench_elastic.json")
    records = equal_epochs.read_records([root / "time_to_accuracy" / "time_to_accuracy.jsonl"])
    summary = time_to_accuracy.summarise(records, [])  # its runs were made alone
    ratios = [entry["ratio"].get("adafisher") for entry in summary.values()]
    rows = checks(runs, elastic)
    text = report(runs, rows, time_to_accuracy.report(summary) if records else "no records")
    print(text)
    out = root / "acceptance"
    out.mkdir(parents=True, exist_ok=True)
    (out / "acceptance.md").write_text(text + "\n")
    payload = {"runs": runs, "checks": rows, "elastic_vs_fixed": elastic}
    payload["time_to_accuracy_ratio"] = ratios[0] if ratios else None
    (out / "acceptance.json").write_text(json.dumps(payload, indent=2) + "\n")
    missing = [name for name, run in runs.items() if run is None]
    missing += ["elastic"] * (elastic is None) + ["time_to_accuracy"] * (not records)
    if missing:
        print(f"missing records: {', '.join(missing)}", file=sys.stderr)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
