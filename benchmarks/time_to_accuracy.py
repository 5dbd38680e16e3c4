"""Time to accuracy: per data set and batch size, each arm's shortest epoch budget whose
final test accuracy reaches the target, its training time, and that time over the better
of the two tuned baselines (AdamW(fused) and SGD).

The runs are ``accuracy.py`` runs (the same arms, model, data path, one-cycle
schedule over each budget, label smoothing), one per budget, appended to the same JSON
lines file: the 15-epoch, batch-512 comparison of ``accuracy.py`` is one budget of
this grid. An arm's accuracy at a budget is the mean over seeds of its chosen
configuration there (``accuracy.summarise``). The target of a data set and batch
size is the best accuracy AdamW reaches within :data:`TARGET_EPOCHS` epochs (with every
parameter decayed or with biases and normalisation weights exempt, :data:`ADAMW_ARMS`);
the baselines are both AdamW arms and both SGD arms (:data:`BASELINES`).

Time: runs that share a GPU (``--workers``) overlap, so their own ``train_seconds`` do
not time the optimizer. ``--timing`` trains each arm of the grid alone for
``--timing_epochs`` epochs, the arms in turn, ``--timing_rounds`` times, and appends each
run's steady epoch time (the median of the epochs after the first, which holds cuDNN's
autotuning) to ``--times``; a budget's training time is ``budget x`` the median over an
arm's rounds. The time is the arm's at that batch size, whatever the data set: the data
sets of a comparison differ only in the classifier's width. A run made alone
(``workers`` 1) without a timing record is timed by its own ``train_seconds``.

``--summarise`` prints, per data set and batch size, every arm's accuracy per budget and
time to target; ``--chosen FILE`` also writes the values the package ships (the
optimizer's defaults and the recipes' settings), chosen from the 15-epoch comparison by
:func:`chosen_values`.

Usage:
    python -m benchmarks time-to-accuracy --data .data/cifar10 --budgets 10,20,30,40 \\
        --grid adamw:lr=2.4e-2:wd=0.1 sgd:lr=0.8 adafisher:lr=1.2e-2 --workers 4
    python -m benchmarks time-to-accuracy --data .data/cifar10 --timing \\
        --grid adamw:lr=2.4e-2:wd=0.1 sgd:lr=0.8 adafisher:lr=1.2e-2
    python -m benchmarks time-to-accuracy --summarise benchmarks/results/accuracy.jsonl \\
        --chosen benchmarks/results/chosen.json --plot docs/time_to_accuracy.png
    python -m benchmarks time-to-accuracy --smoke --results /tmp/tta.jsonl   # CPU
"""

import argparse
import dataclasses
import itertools
import json
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

from benchmarks import accuracy, cifar, harness
from hf_triaccel.optim.config import AdaFisherConfig

NAME = "time-to-accuracy"
HELP = "time to accuracy over the accuracy arms, and the chosen values"

TARGET_EPOCHS = 40  # the target: AdamW's best accuracy within this many epochs
BUDGETS = (10, 15, 20, 30, 40)
ADAMW_ARMS = ("adamw", "adamw_exempt")  # the target: the best of these
BASELINES = (*ADAMW_ARMS, "sgd", "sgd_exempt")
TIMES = harness.REPO_ROOT / "benchmarks" / "results" / "epoch_seconds.jsonl"
SMOKE_GRID = ("adamw:lr=3e-3:wd=0.05", "adafisher:lr=3e-3")
# the comparison the shipped values are chosen from: accuracy.py's
CHOICE_MODEL, CHOICE_EPOCHS, CHOICE_BATCH = accuracy.MODEL, 15, 512
# data set -> the recipe trained on it, whose optimizer settings the choice sets
RECIPES = {"cifar10": "cifar10_resnet18", "cifar100": "cifar100_resnet18"}
DEFAULT_FROM = "cifar10"  # the optimizer's default lr: the choice on this data set
PUBLISHED = "adafisher"  # the published algorithm, the default unless an arm clearly beats it
PLOT_SEEDS = 3  # the plot's points: budgets run at this many seeds


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The grid, budgets, timing, summary and chosen-values flags."""
    parser.add_argument("--data", nargs="+", default=[".data/cifar10"], help="parquet folders")
    parser.add_argument("--grid", nargs="+", help="accuracy.py's ARM:lr=A[:wd=C] specs")
    parser.add_argument("--budgets", default=",".join(map(str, BUDGETS)), help="epochs")
    parser.add_argument("--batch_size", type=int, default=512)
    parser.add_argument("--model", default=accuracy.MODEL, help="timm model")
    parser.add_argument("--seeds", default="0", help="comma-separated")
    parser.add_argument("--workers", type=int, default=1, help="training processes at once")
    parser.add_argument("--stop_after", type=float, help="seconds: start no run after them")
    parser.add_argument("--results", type=Path, default=accuracy.RESULTS, help="JSON lines")
    parser.add_argument("--timing", action="store_true", help="time each arm alone instead")
    parser.add_argument("--timing_epochs", type=int, default=3)
    parser.add_argument("--timing_rounds", type=int, default=3)
    parser.add_argument("--times", type=Path, default=TIMES, help="epoch times, JSON lines")
    parser.add_argument("--summarise", type=Path, nargs="+", help="only summarise these files")
    parser.add_argument("--chosen", type=Path, help="write the chosen values (JSON) here")
    parser.add_argument("--plot", type=Path, help="write accuracy against time (PNG) here")
    parser.add_argument("--smoke", action="store_true", help="CPU, random images, 2 steps a run")


def check(args: argparse.Namespace) -> argparse.Namespace:
    """The smoke grid; every spec parsed before any run; a clear error without a grid."""
    if args.grid is None:
        args.grid = list(SMOKE_GRID) if args.smoke else []
    for spec in args.grid:
        accuracy.parse_spec(spec)  # a bad spec fails here, before any run
    if not args.grid and not args.summarise:
        raise SystemExit("error: --grid is required (or --summarise)")
    return args


def run_grid(args: argparse.Namespace) -> int:
    """The budgets' runs, through ``accuracy.py``; returns the failures."""
    argv = ["--data", *args.data, "--epochs", args.budgets, "--grid", *args.grid]
    argv += ["--batch_size", str(args.batch_size), "--seeds", args.seeds, "--model", args.model]
    argv += ["--workers", str(args.workers), "--results", str(args.results)]
    argv += ["--stop_after", str(args.stop_after)] if args.stop_after is not None else []
    return accuracy.run(accuracy.parse_args(argv + ["--smoke"] * args.smoke))


def time_key(record: dict[str, Any]) -> tuple[str, str, int]:
    return record["arm"], record["model"], record["batch_size"]


def run_timing(args: argparse.Namespace) -> int:
    """Each arm of the grid trained alone for ``--timing_epochs`` (at its first
    configuration: the time does not depend on it), the arms in turn, until each has
    ``--timing_rounds`` records in ``--times``. Returns the failures."""
    done = Counter(time_key(r) for r in accuracy.read_records([args.times]))
    args.times.parent.mkdir(parents=True, exist_ok=True)
    batch_size = 8 if args.smoke else args.batch_size
    grid = argparse.Namespace(data=args.data, epochs=[args.timing_epochs], seeds=[0])
    grid.batch_size, grid.smoke, grid.model = batch_size, args.smoke, args.model
    grid.grid = [(arm, lrs[:1], wds[:1]) for arm, lrs, wds in map(accuracy.parse_spec, args.grid)]
    failed, data = 0, {}
    rounds = itertools.product(range(args.timing_rounds), accuracy.jobs(grid))
    for i, job in rounds:
        dataset = Path(job["data"]).name
        if done[time_key(job)] > i:
            continue
        done[time_key(job)] += 1
        run_args = accuracy.train_args(job, grid)
        if job["data"] not in data:
            data[job["data"]] = cifar.load_data(run_args)
        try:
            record = cifar.train(run_args, data[job["data"]])
        except Exception as exc:  # the other arms are still timed
            harness.report_error(exc)
            failed += 1
            continue
        finally:
            harness.free_memory(run_args.device)
        seconds = record["epoch_seconds"]
        timing = {"dataset": dataset, "arm": job["arm"], "model": args.model}
        timing["batch_size"] = batch_size
        timing.update(epoch_seconds=statistics.median(seconds[1:] or seconds))
        timing.update(steps=record["steps"], epochs=len(seconds), env=record["env"])
        accuracy.append(args.times, timing)
        print(f"{dataset} {job['arm']}: {timing['epoch_seconds']:.3f} s an epoch", flush=True)
    return failed


def epoch_times(times: list[dict[str, Any]]) -> dict[tuple, float]:
    """(arm, model, batch) -> steady epoch seconds, the median over the records."""
    rounds: dict[tuple, list[float]] = {}
    for t in times:
        rounds.setdefault(time_key(t), []).append(t["epoch_seconds"])
    return {key: statistics.median(seconds) for key, seconds in rounds.items()}


def shortest(runs: dict[int, dict], target: float | None) -> int | None:
    """The shortest budget of ``runs`` whose accuracy reaches ``target`` (none without a
    target)."""
    passing = [b for b, run in runs.items() if target is not None and run["accuracy"] >= target]
    return min(passing, default=None)


def summarise(records: list[dict[str, Any]], times: list[dict[str, Any]]) -> dict[tuple, dict]:
    """Per (data set, model, batch size): each arm's accuracy (percent) and training
    seconds per budget, the target, each arm's time to target (the shortest budget
    reaching it) and its ratio to the better baseline's."""
    per_epoch = epoch_times(times)
    solo = {}  # a run made alone times itself
    for r in records:
        if r["workers"] == 1:
            solo[(r["dataset"], *time_key(r), r["budget_epochs"])] = r["train_seconds"]
    out: dict[tuple, dict] = {}
    for (dataset, model, epochs, batch), arms in accuracy.summarise(records).items():
        entry = out.setdefault((dataset, model, batch), {"arms": {}})
        for arm, found in arms.items():
            if found["best"] is None:
                continue
            config = found["configs"][found["best"]]
            seconds = per_epoch.get((arm, model, batch))
            seconds = (
                epochs * seconds if seconds else solo.get((dataset, arm, model, batch, epochs))
            )
            runs = entry["arms"].setdefault(arm, {})
            runs[epochs] = {"accuracy": config["mean"], "seeds": config["n"], "seconds": seconds}
            runs[epochs]["lr"], runs[epochs]["weight_decay"] = found["best"]
    for entry in out.values():
        within = [
            run["accuracy"]
            for arm in ADAMW_ARMS
            for b, run in entry["arms"].get(arm, {}).items()
            if b <= TARGET_EPOCHS
        ]
        entry["target"] = max(within, default=None)
        entry["reached"] = {
            arm: shortest(runs, entry["target"]) for arm, runs in entry["arms"].items()
        }
        seconds = {
            arm: entry["arms"][arm][b]["seconds"] for arm, b in entry["reached"].items() if b
        }
        baseline = min((seconds[a] for a in BASELINES if seconds.get(a)), default=None)
        entry["ratio"] = {
            arm: s / baseline if s and baseline else None for arm, s in seconds.items()
        }
    return out


def report(summary: dict[tuple, dict]) -> str:
    """The summary as markdown: per data set and batch size, each arm's accuracy and
    training time per budget (``*`` at or above the target), then its time to target."""
    parts = []
    for (dataset, model, batch), entry in sorted(summary.items()):
        budgets = sorted({b for runs in entry["arms"].values() for b in runs})
        arms = [a for a in accuracy.ARMS if a in entry["arms"]]
        target = entry["target"]
        lines = [f"### {dataset}, {model}, batch {batch}", ""]
        lines.append(
            "target: "
            + ("none (no AdamW run)" if target is None else f"{target:.2f}%")
            + f", AdamW's best within {TARGET_EPOCHS} epochs; time: training only"
        )
        lines += ["", "| arm | " + " | ".join(f"{b} epochs" for b in budgets) + " |"]
        lines.append("|---" * (len(budgets) + 1) + "|")
        for arm in arms:
            cells = []
            for b in budgets:
                run = entry["arms"][arm].get(b)
                if run is None:
                    cells.append("")
                    continue
                mark = "*" if target is not None and run["accuracy"] >= target else ""
                time = harness.fmt(run["seconds"], ".1f", " s")
                cells.append(f"{run['accuracy']:.2f}%{mark} ({time}, lr {run['lr']:g})")
            lines.append(f"| {arm} | " + " | ".join(cells) + " |")
        lines += [
            "",
            "| arm | time to target | budget | x the better baseline |",
            "|---|---|---|---|",
        ]
        for arm in arms:
            budget = entry["reached"].get(arm)
            if budget is None:
                lines.append(f"| {arm} | not reached | | |")
                continue
            seconds = entry["arms"][arm][budget]["seconds"]
            ratio = harness.fmt(entry["ratio"].get(arm), ".2f", "x")
            lines.append(
                f"| {arm} | {harness.fmt(seconds, '.1f', ' s')} | {budget} epochs | {ratio} |"
            )
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


def chosen_values(records: list[dict[str, Any]]) -> dict[str, Any]:
    """What the package ships.

    The default fold configuration is the published algorithm's (:data:`PUBLISHED`) unless
    another AdaFisher arm is, in every comparison both ran (data set, model, budget and
    batch size, each at its chosen configuration), no worse than it by more than the noise,
    and better by more than the noise in at least one: a new default needs a margin
    larger than the noise somewhere and a loss nowhere. The noise of a comparison is the
    larger seed spread of the two where either ran 3 seeds, else the largest spread of any
    configuration run at 3 seeds (one seed's error is not known). The default learning
    rate: the chosen arm's choice in the 15-epoch, batch-512 comparison on
    :data:`DEFAULT_FROM`. Each recipe takes its data set's chosen AdaFisher settings in
    that comparison and, for ``--baseline``, the chosen AdamW settings.
    """
    summary = accuracy.summarise(records)

    def chosen(arms: dict[str, Any], arm: str) -> dict[str, Any] | None:
        found = arms.get(arm)
        if found is None or found["best"] is None:
            return None
        config = found["configs"][found["best"]]
        lr, wd = found["best"]
        return {
            "lr": lr,
            "weight_decay": wd,
            "mean": config["mean"],
            "spread": config["spread"],
            "seeds": config["n"],
        }

    stage = {
        key[0]: arms
        for key, arms in summary.items()
        if key[1:] == (CHOICE_MODEL, CHOICE_EPOCHS, CHOICE_BATCH)
    }
    spreads = [
        c["spread"]
        for arms in summary.values()
        for a in arms.values()
        for c in a["configs"].values()
        if c["n"] >= 3
    ]
    single_seed = max(spreads, default=0.0)

    def margins(arm: str) -> dict[str, dict[str, float]]:
        """Per comparison of both ("data set/model/budget/batch"): the arm's mean minus the
        published one's, and the noise (percentage points)."""
        out = {}
        for key, arms in sorted(summary.items()):
            a, b = chosen(arms, arm), chosen(arms, PUBLISHED)
            if a and b:
                three = [c["spread"] for c in (a, b) if c["seeds"] >= 3]
                out["/".join(map(str, key))] = {
                    "difference": round(a["mean"] - b["mean"], 2),
                    "noise": round(max(three, default=single_seed), 2),
                }
        return out

    def beats(arm: str) -> bool:
        found = margins(arm).values()
        return (
            all(m["difference"] >= -m["noise"] for m in found)
            and any(m["difference"] > m["noise"] for m in found)
            and all(chosen(stage.get(d, {}), arm) for d in RECIPES)
        )

    # candidates: AdaFisher arms that differ in the optimizer's settings only (not, say, in
    # the loop's clipping)
    settings = {f.name for f in dataclasses.fields(AdaFisherConfig)}
    adafisher_arms = [
        a
        for a, (opt, flags) in accuracy.ARMS.items()
        if opt == "adafisher" and settings >= set(flags)
    ]
    winners = [a for a in adafisher_arms if a != PUBLISHED and beats(a)]
    rule = max(winners, key=lambda a: chosen(stage[DEFAULT_FROM], a)["mean"], default=PUBLISHED)
    config = AdaFisherConfig(**accuracy.ARMS[rule][1])
    default = chosen(stage.get(DEFAULT_FROM, {}), rule)
    recipes = {}
    for dataset, recipe in RECIPES.items():
        arms = stage.get(dataset, {})
        ours, adamw = chosen(arms, rule), chosen(arms, "adamw")
        if ours and adamw:
            recipes[recipe] = {
                "optim": "adafisher",
                "learning_rate": ours["lr"],
                "weight_decay": ours["weight_decay"],
                "baseline_learning_rate": adamw["lr"],
                "baseline_weight_decay": adamw["weight_decay"],
            }
    return {
        "comparison": {"model": CHOICE_MODEL, "epochs": CHOICE_EPOCHS, "batch_size": CHOICE_BATCH},
        "rule": rule,
        "margins": {a: margins(a) for a in winners},
        "adafisher": {
            "ema": config.ema,
            "normalise": config.normalise,
            "factor_init": config.factor_init,
            "update_every": config.resolved_update_every,
            "damping": config.damping,
            "lr": default and default["lr"],
        },
        "recipes": recipes,
        "arms": {d: {a: chosen(arms, a) for a in arms} for d, arms in sorted(stage.items())},
    }


def plot(summary: dict[tuple, dict], records: list[dict[str, Any]], path: Path) -> None:
    """Accuracy against training time: both baselines, the published algorithm and the
    shipped rule, a point per budget run at :data:`PLOT_SEEDS` seeds or more (their mean,
    a bar from the lowest to the highest seed), the target dashed; one panel per data set
    and batch size in which the shipped rule has two such budgets."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shipped = chosen_values(records)["rule"]
    arms = tuple(dict.fromkeys((*BASELINES, PUBLISHED, shipped)))

    def budgets(runs: dict[int, dict]) -> list[int]:
        return [b for b in sorted(runs) if runs[b]["seconds"] and runs[b]["seeds"] >= PLOT_SEEDS]

    keys = sorted(k for k in summary if len(budgets(summary[k]["arms"].get(shipped, {}))) > 1)
    if not keys:
        raise ValueError(
            f"nothing to plot: no comparison has two budgets of {shipped} run at "
            f"{PLOT_SEEDS} seeds or more"
        )
    fig, axes = plt.subplots(1, len(keys), figsize=(5.5 * len(keys), 4.2), squeeze=False)
    for ax, key in zip(axes[0], keys, strict=True):
        entry = summary[key]
        for colour, arm in enumerate(arms):  # an arm keeps its colour in every panel
            runs = entry["arms"].get(arm, {})
            shown = budgets(runs)
            if not shown:  # an arm not run (timed, seeded) enough in this comparison
                continue
            seeds = [
                [100 * r["test_accuracy"] for r in records if run_of(r, key, arm, b, runs[b])]
                for b in shown
            ]
            mean = [runs[b]["accuracy"] for b in shown]
            low = [m - min(s) for m, s in zip(mean, seeds, strict=True)]
            high = [max(s) - m for m, s in zip(mean, seeds, strict=True)]
            x = [runs[b]["seconds"] for b in shown]
            label = f"{arm} (shipped)" if arm == shipped else arm
            ax.errorbar(
                x, mean, yerr=[low, high], marker="o", capsize=3, label=label, color=f"C{colour}"
            )
        if entry["target"] is not None:
            ax.axhline(entry["target"], color="grey", linestyle="--", linewidth=1)
        ax.set(title=f"{key[0]}, {key[1]}, batch {key[2]}", xlabel="training time (s)")
        ax.set(ylabel="test accuracy (%)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_of(record: dict[str, Any], key: tuple, arm: str, budget: int, run: dict) -> bool:
    """Whether ``record`` is one of the seeds behind ``run`` (an arm's chosen configuration
    at a budget of the comparison ``key``)."""
    return (
        (record["dataset"], record["model"], record["batch_size"]) == key
        and (record["arm"], record["budget_epochs"]) == (arm, budget)
        and (record["lr"], record["weight_decay"]) == (run["lr"], run["weight_decay"])
    )


def run(args: argparse.Namespace) -> int:
    """Runs the grid (or the timing) and prints the summary, or only summarises;
    returns the failures."""
    check(args)
    failed = 0
    if not args.summarise:
        failed = run_timing(args) if args.timing else run_grid(args)
    records = accuracy.read_records(args.summarise or [args.results])
    times = accuracy.read_records([args.times])
    summary = summarise(records, times)
    print(report(summary))
    if args.plot is not None:
        plot(summary, records, args.plot)
    if args.chosen is not None:
        args.chosen.write_text(json.dumps(chosen_values(records), indent=2) + "\n")
    return failed
