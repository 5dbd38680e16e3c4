"""The quickstart's CPU plan: a learning-rate grid per compared optimizer on the
embedded CIFAR-10 slice, the plan's model, batches, steps and weight decay.

Each run is ``hf_triaccel.quickstart``'s own training of one optimizer at one peak
learning rate; its figures are appended, one JSON line each, to ``--results`` (a run
already there is skipped). The summary names each optimizer's best learning rate and its
neighbours, the values the CPU plan ships.

Usage:
    python benchmarks/quickstart_grid.py                     # the whole grid, on the CPU
    python benchmarks/quickstart_grid.py --lrs 3e-3 --optimizers adamw --max_steps 2
"""

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import harness

from hf_triaccel import quickstart
from hf_triaccel.data import load_image_dataset
from hf_triaccel.optim.config import AdaFisherConfig

LRS = (1e-3, 3e-3, 1e-2, 3e-2)
RESULTS = harness.REPO_ROOT / "benchmarks" / "results" / "quickstart_cpu.jsonl"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--optimizers", default=",".join(quickstart.COMPARED))
    parser.add_argument("--lrs", default=",".join(map(str, LRS)), help="peak learning rates")
    parser.add_argument("--max_steps", type=int, help="cap (default: the CPU plan's)")
    parser.add_argument("--results", type=Path, default=RESULTS, help="JSON lines, appended to")
    args = parser.parse_args(argv)
    args.optimizers = args.optimizers.split(",")
    args.lrs = [float(x) for x in args.lrs.split(",")]
    return args


def factor_init(record: dict) -> str | None:
    """An AdaFisher run's factor seed (runs recorded without one started from ones, the
    default then); ``None`` for the other optimizers."""
    if not record["optimizer"].startswith("adafisher"):
        return None
    return record.get("factor_init", "ones")


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the missing runs of the grid and prints each optimizer's runs."""
    args = parse_args(argv)
    text = args.results.read_text() if args.results.is_file() else ""
    records = [json.loads(line) for line in text.splitlines() if line.strip()]
    done = {(r["optimizer"], r["learning_rate"], r["steps"], factor_init(r)) for r in records}
    train = load_image_dataset("embedded", "train")
    test = load_image_dataset("embedded", "test")
    for name in args.optimizers:
        flags = ["--device", "cpu", "--optimizers", name]
        flags += [] if args.max_steps is None else ["--max_steps", str(args.max_steps)]
        base = quickstart.parse_args(flags)
        weight_decay = base.plan.hyperparameters[name][1]
        seed = AdaFisherConfig().factor_init if name.startswith("adafisher") else None
        for lr in args.lrs:
            plan = dataclasses.replace(base.plan, hyperparameters={name: (lr, weight_decay)})
            run_args = argparse.Namespace(**{**vars(base), "plan": plan})
            steps = plan.max_steps  # the plan's cap: the embedded slice is longer
            if (name, lr, steps, seed) in done:
                continue
            run = quickstart.train_one(name, run_args, train, test)
            run.update({} if seed is None else {"factor_init": seed})
            run["env"] = harness.environment(__file__, argv or sys.argv[1:], base.device)
            records.append(run)
            with args.results.open("a") as f:
                f.write(json.dumps(run) + "\n")
    for r in sorted(
        records, key=lambda r: (r["optimizer"], str(factor_init(r)), r["learning_rate"])
    ):
        seed = factor_init(r)
        print(
            f"{r['optimizer']:<11}{'' if seed is None else ' ' + seed:<6} "
            f"lr {r['learning_rate']:<7g} {r['steps']} steps: "
            f"{100 * r['test_accuracy']:.2f}% ({r['train_seconds']:.1f} s)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
