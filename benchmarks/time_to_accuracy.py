"""Time to accuracy on CIFAR-10: per optimizer, the shortest epoch budget whose final test
accuracy reaches the target, and its training time.

Each run is one ``train_cifar.py`` training (timm ``resnet18_cifar``, batch 512, bf16,
channels_last, one-cycle schedule over the whole budget) with the data decoded once per
process. For each budget of ``--budgets`` and each learning rate of the sweep, AdamW
(fused) and AdaFisherW run one after the other, so that the two compared runs of a budget
share a call and a GPU. Every run appends its record, one JSON line, to ``--results`` as
soon as it ends: a grid can be split over several calls, and a call cut short keeps what
it finished (a run already in the file is not run again). ``--summarise`` reads result
files and prints the table and the ratio of the shortest passing budgets' training times.

Usage:
    python benchmarks/time_to_accuracy.py --data .data/cifar10 --budgets 10,15 \\
        --results "$OUT/time_to_accuracy.jsonl"
    python benchmarks/time_to_accuracy.py --summarise a.jsonl b.jsonl
    python benchmarks/time_to_accuracy.py --smoke --results /tmp/tta.jsonl   # CPU
"""

import argparse
import json
import os
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import harness
import train_cifar

OPTIMIZERS = ("adamw", "adafisherw")
BUDGETS = (10, 15, 20, 25, 30, 40)
# the sweep: each optimizer's measured 30-epoch default (harness.HYPERPARAMETERS), halved
# and doubled
LRS = {"adamw": (1.5e-3, 3e-3, 6e-3), "adafisherw": (5e-3, 1e-2, 2e-2)}
TARGET = 0.89
SMOKE_STEPS = 2  # a smoke run's steps, whatever its budget


def floats(text: str) -> list[float]:
    """A comma-separated list of numbers."""
    return [float(x) for x in text.split(",") if x.strip()]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The flags; ``--smoke`` defaults to two budgets and one learning rate each."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default=os.environ.get("DATA", ".data/cifar10"))
    parser.add_argument("--budgets", type=floats, help=f"epochs (default {BUDGETS})")
    for name, lrs in LRS.items():
        parser.add_argument(f"--{name}-lrs", type=floats, help=f"peak lrs (default {lrs})")
    parser.add_argument("--target", type=float, default=TARGET, help="test accuracy, 0-1")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--results", type=Path, help="JSON lines file, appended to")
    parser.add_argument("--summarise", type=Path, nargs="+", help="only summarise these files")
    parser.add_argument("--smoke", action="store_true", help="CPU, random images, 2 steps a run")
    args = parser.parse_args(argv)
    smoke_lrs = {name: harness.HYPERPARAMETERS[name][:1] for name in OPTIMIZERS}
    args.lrs = {
        name: getattr(args, f"{name}_lrs") or (smoke_lrs[name] if args.smoke else LRS[name])
        for name in OPTIMIZERS
    }
    args.budgets = [int(b) for b in args.budgets or ((1, 2) if args.smoke else BUDGETS)]
    if args.results is None:
        args.results = Path(os.environ.get("OUT") or ".") / "time_to_accuracy.jsonl"
    return args


def read_records(paths: Iterable[Path]) -> list[dict[str, Any]]:
    """Every record of the JSON lines files that exist."""
    lines = (line for p in paths if p.is_file() for line in p.read_text().splitlines())
    return [json.loads(line) for line in lines if line.strip()]


def key(record: dict[str, Any]) -> tuple:
    """What identifies a run of the grid."""
    return record["optimizer"], record["budget_epochs"], record["lr"], record["seed"]


def settled(records: list[dict], budget: int, target: float) -> bool:
    """Whether every optimizer already reached ``target`` at a budget up to ``budget``."""
    passed = {r["optimizer"] for r in records if passes(r, target) and r["budget_epochs"] <= budget}
    return passed >= set(OPTIMIZERS)


def passes(record: dict[str, Any], target: float) -> bool:
    """Whether a run's final test accuracy reaches ``target``."""
    return record["test_accuracy"] >= target


def run_args_of(name: str, lr: float, budget: int, args: argparse.Namespace) -> argparse.Namespace:
    """The ``train_cifar.py`` arguments of one run."""
    flags = ["--optimizer", name, "--lr", str(lr), "--epochs", str(budget)]
    flags += ["--data", args.data, "--seed", str(args.seed)]
    if args.smoke:
        flags += ["--smoke", "--batch_size", "8", "--max_steps", str(SMOKE_STEPS)]
    return train_cifar.parse_args(flags)


def train(name: str, lr: float, budget: int, args: argparse.Namespace, data) -> dict | None:
    """One ``train_cifar.py`` run on ``data`` (``train_cifar.load_data``'s); its record,
    or ``None`` when it failed."""
    run_args = run_args_of(name, lr, budget, args)
    try:
        record = train_cifar.run(run_args, data)
    except Exception as exc:  # the other runs of the call still run
        harness.report_error(exc)
        return None
    finally:
        harness.free_memory(run_args.device)
    record.update(budget_epochs=budget, target=args.target)
    accuracy, seconds = 100 * record["test_accuracy"], record["train_seconds"]
    print(f"{name} lr {lr:g}, {budget} epochs: {accuracy:.2f}%, {seconds:.1f} s", flush=True)
    return record


def run_grid(args: argparse.Namespace) -> int:
    """Runs the grid's missing runs; the runs of one budget and learning-rate index (one
    per optimizer) are appended together once all have ended, so that they always share
    a call. Returns the number of failed runs."""
    records = read_records([args.results])
    done, failed, data = {key(r) for r in records}, 0, None
    args.results.parent.mkdir(parents=True, exist_ok=True)
    for budget in args.budgets:
        if settled(records, budget, args.target):
            print(f"budget {budget}: every optimizer passed at a shorter one, skipped")
            continue
        for i in range(max(map(len, args.lrs.values()))):
            pair = [(n, args.lrs[n][i]) for n in OPTIMIZERS if i < len(args.lrs[n])]
            pair = [(n, lr) for n, lr in pair if (n, budget, lr, args.seed) not in done]
            if pair and data is None:  # decoded once, for every run of the call
                data = train_cifar.load_data(run_args_of(*pair[0], budget, args))
            runs = [train(name, lr, budget, args, data) for name, lr in pair]
            failed += sum(r is None for r in runs)
            with args.results.open("a") as f:
                f.writelines(json.dumps(r) + "\n" for r in runs if r is not None)
            records += [r for r in runs if r is not None]
    return failed


def best_runs(records: list[dict[str, Any]]) -> dict[str, dict[int, dict]]:
    """Per optimizer and budget, the run of the most accurate learning rate."""
    best: dict[str, dict[int, dict]] = {name: {} for name in OPTIMIZERS}
    for r in records:
        current = best.setdefault(r["optimizer"], {}).get(r["budget_epochs"])
        if current is None or r["test_accuracy"] > current["test_accuracy"]:
            best[r["optimizer"]][r["budget_epochs"]] = r
    return best


def shortest(runs: dict[int, dict], threshold: float) -> dict | None:
    """The run of the shortest budget whose accuracy reaches ``threshold``."""
    return next((runs[b] for b in sorted(runs) if runs[b]["test_accuracy"] >= threshold), None)


def summarise(records: list[dict[str, Any]], target: float = TARGET) -> dict[str, Any]:
    """The comparison: per optimizer its shortest budget reaching ``target`` and that
    run's training time, and their ratio AdaFisherW / AdamW. When AdamW never reaches
    ``target``, the threshold is AdamW's best accuracy instead."""
    best = best_runs(records)
    threshold = target
    if shortest(best["adamw"], target) is None and best["adamw"]:
        threshold = max(r["test_accuracy"] for r in best["adamw"].values())
    chosen = {name: shortest(best[name], threshold) for name in OPTIMIZERS}
    times = {name: run and run["train_seconds"] for name, run in chosen.items()}
    ratio = times["adafisherw"] / times["adamw"] if all(times.values()) else None
    out = {"target": target, "threshold": threshold, "best": best, "chosen": chosen}
    return {**out, "ratio": ratio}


def report(summary: dict[str, Any]) -> str:
    """The summary as markdown: the grid, then the comparison."""
    best, fmt = summary["best"], harness.fmt
    budgets = sorted({b for runs in best.values() for b in runs})

    def cell(name: str, budget: int) -> str:
        r = best[name].get(budget)
        if r is None:
            return "not run"
        mark = " *" if r["test_accuracy"] >= summary["threshold"] else ""
        return f"{100 * r['test_accuracy']:.2f}%{mark} (lr {r['lr']:g}, {r['train_seconds']:.1f} s)"

    columns = {"epochs": lambda b: b, **{n: lambda b, n=n: cell(n, b) for n in OPTIMIZERS}}
    lines = [harness.table(budgets, columns)]
    threshold, target = summary["threshold"], summary["target"]
    what = "the target" if threshold == target else "AdamW's best: it never reached the target"
    lines.append(
        f"\\* reaches {100 * threshold:.2f}% ({what} of {100 * target:.1f}%); per budget the "
        "accuracy of the best learning rate, and its training time only"
    )
    for name, run in summary["chosen"].items():
        where = run and f"{run['budget_epochs']} epochs, {run['train_seconds']:.1f} s"
        lines.append(f"- {name}: shortest budget reaching it: {where or 'none'}")
    lines.append(f"- training time AdaFisherW / AdamW: {fmt(summary['ratio'], '.3f', 'x')}")
    return "\n\n".join(lines[:2]) + "\n\n" + "\n".join(lines[2:])


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the grid then prints the summary of the results file, or only summarises;
    returns the number of failed runs."""
    args = parse_args(argv)
    failed = 0 if args.summarise else run_grid(args)
    records = read_records(args.summarise or [args.results])
    print(report(summarise(records, args.target)))
    return failed


if __name__ == "__main__":
    sys.exit(main())
