"""A learning-rate and seed grid of the WikiText-2 recipe that survives interruptions, and
its summary: perplexity against training time for each optimizer.

Usage::

    python recipes/wikitext2_grid.py run --runs_file RUNS.jsonl --max_wall 540 \\
        --arm "adamw=--optim adamw_torch_fused" --lrs adamw=3e-4,1e-3,3e-3 \\
        --arm "adafisher=--optim adafisherw" --lrs adafisher=1e-3,3e-3,1e-2 \\
        --out_dir /tmp/wikitext2_grid -- --dataset DIR
    python recipes/wikitext2_grid.py summary RUNS.jsonl --target adamw

``run`` trains, arm after arm, every learning rate of the arm's list at the first seed.
While the best of them (lowest best validation perplexity) is at an end of the list, the
list grows past that end by a factor of 3 (``--extend`` times at most), so that the best
has a measured worse neighbour on each side; then the best learning rate trains at every
other seed. Each run is one ``wikitext2_gpt2.py`` run in this process, with the arm's
flags, ``--lr``, ``--seed``, ``--run_name ARM``, ``--runs_file`` and what follows ``--``
(its output folder ``--out_dir/ARM/lrLR_seedSEED``).
A run already in the runs file is skipped, so the same command, run again after a time
limit or ``--max_wall`` stopped it, continues where it stopped.

``summary`` prints, per arm, the learning rates tried (best validation perplexity at the
first seed), the best one, the mean and standard deviation over its seeds of the final
and best validation and the test perplexity, and the training time to the target: the
first evaluation (evaluations excluded from the time) at or below the target arm's best
validation perplexity, its best runs' mean.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

import wikitext2_gpt2 as recipe

GROWTH = 3.0


def records(runs_file: str | Path) -> list[dict[str, Any]]:
    """The runs of a runs file, in order; none when it does not exist."""
    path = Path(runs_file)
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def score(run: dict[str, Any]) -> float:
    """A run's best validation perplexity; ``inf`` for a run that diverged.

    Example:
        >>> score({"best_eval_perplexity": 95.5}), score({"best_eval_perplexity": None})
        (95.5, inf)
    """
    value = run.get("best_eval_perplexity")
    return value if value is not None and math.isfinite(value) else math.inf


def find(runs: Sequence[dict[str, Any]], arm: str, lr: float, seed: int) -> dict | None:
    """The run of an arm at a learning rate and seed, if it is there."""
    return next(
        (
            r
            for r in runs
            if r["name"] == arm
            and r["key"]["seed"] == seed
            and math.isclose(r["key"]["learning_rate"], lr, rel_tol=1e-9)
        ),
        None,
    )


def next_run(
    runs: Sequence[dict[str, Any]],
    arm: str,
    lrs: Sequence[float],
    seeds: Sequence[int],
    extend: int,
) -> tuple[float, int] | None:
    """The arm's next ``(lr, seed)`` to train, or ``None`` when its grid is done: every
    learning rate at the first seed, the list grown past an end that holds the best (at
    most ``extend`` learning rates added), then the best at every seed.

    Example:
        >>> runs = [{"name": "a", "key": {"seed": 0, "learning_rate": lr},
        ...          "best_eval_perplexity": ppl} for lr, ppl in ((1e-3, 90.0), (3e-3, 80.0))]
        >>> next_run(runs, "a", [1e-3, 3e-3], [0, 1], extend=2)  # the best is at the top
        (0.009, 0)
        >>> runs.append({"name": "a", "key": {"seed": 0, "learning_rate": 9e-3},
        ...              "best_eval_perplexity": 85.0})
        >>> next_run(runs, "a", [1e-3, 3e-3], [0, 1], extend=2)  # then its other seeds
        (0.003, 1)
    """
    first, tried = seeds[0], sorted(lrs)
    for _ in range(extend + 1):
        missing = [lr for lr in tried if find(runs, arm, lr, first) is None]
        if missing:
            return missing[0], first
        scores = [score(find(runs, arm, lr, first)) for lr in tried]
        best = min(range(len(tried)), key=scores.__getitem__)
        if 0 < best < len(tried) - 1 or len(tried) - len(lrs) >= extend:
            break
        # three significant digits: learning rates that read as typed
        grown = float(f"{tried[0] / GROWTH if best == 0 else tried[-1] * GROWTH:.3g}")
        tried = [grown, *tried] if best == 0 else [*tried, grown]
    best_lr = tried[best]
    return next(((best_lr, s) for s in seeds[1:] if find(runs, arm, best_lr, s) is None), None)


def run_grid(
    arms: dict[str, list[str]],
    lrs: dict[str, list[float]],
    seeds: Sequence[int],
    runs_file: str,
    common: list[str],
    *,
    out_dir: str = "outputs/wikitext2_grid",
    extend: int = 2,
    max_wall: float = math.inf,
    train: Callable[[list[str]], Any] = recipe.run_recipe,
) -> bool:
    """Trains the grid's missing runs (see the module doc) until it is done or
    ``max_wall`` seconds have passed (no run starts that the last run's duration would
    take past it).

    Returns:
        Whether the grid is complete.
    """
    start, longest = time.perf_counter(), 0.0
    for arm, flags in arms.items():
        while (planned := next_run(records(runs_file), arm, lrs[arm], seeds, extend)) is not None:
            if time.perf_counter() - start + longest > max_wall:
                return False
            lr, seed = planned
            argv = [
                *common,
                *flags,
                *("--lr", repr(lr), "--seed", str(seed), "--run_name", arm),
                *(
                    "--runs_file",
                    runs_file,
                    "--output_dir",
                    str(Path(out_dir, arm, f"lr{lr:g}_seed{seed}")),
                ),
            ]
            print("grid:", shlex.join(argv), flush=True)
            began = time.perf_counter()
            train(argv)
            longest = max(longest, time.perf_counter() - began)
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return True


def summary(runs: Sequence[dict[str, Any]], target_arm: str, first_seed: int) -> str:
    """The grid's table (see the module doc), as Markdown.

    Example:
        >>> runs = [{"name": "adamw", "key": {"seed": 0, "learning_rate": 1e-3},
        ...          "best_eval_perplexity": 100.0, "eval_perplexity": 101.0,
        ...          "test_perplexity": 98.0, "curve": [
        ...              {"train_time_s": 10.0, "eval_perplexity": 100.0}]}]
        >>> print(summary(runs, "adamw", 0))  # doctest: +NORMALIZE_WHITESPACE
        target: adamw's best validation perplexity, 100.00
        | arm | learning rates (best validation perplexity, seed 0) | best lr | seeds |
        final validation | best validation | test | time to target (s) | reached |
        time / target arm's |
        |---|---|---|---|---|---|---|---|---|---|
        | adamw | 0.001: 100.00 | 0.001 | 1 | 101.00 | 100.00 | 98.00 | 10.0 | 1/1 | 1.000 |
    """
    arms: dict[str, dict[float, list[dict]]] = {}
    for run in runs:
        arms.setdefault(run["name"], {}).setdefault(run["key"]["learning_rate"], []).append(run)

    def best_lr(by_lr: dict[float, list[dict]]) -> float:
        firsts = {lr: [r for r in rs if r["key"]["seed"] == first_seed] for lr, rs in by_lr.items()}
        return min((lr for lr in firsts if firsts[lr]), key=lambda lr: score(firsts[lr][0]))

    def spread(values: list[float]) -> str:
        if len(values) < 2:
            return f"{values[0]:.2f}"
        return f"{statistics.mean(values):.2f} ± {statistics.stdev(values):.2f}"

    target_runs = arms[target_arm][best_lr(arms[target_arm])]
    target = statistics.mean(score(r) for r in target_runs)
    target_times = [recipe.time_to(r["curve"], target) for r in target_runs]
    target_time = statistics.mean(t for t in target_times if t is not None)
    lines = [
        f"target: {target_arm}'s best validation perplexity, {target:.2f}",
        f"| arm | learning rates (best validation perplexity, seed {first_seed}) | best lr | "
        "seeds | final validation | best validation | test | time to target (s) | reached | "
        "time / target arm's |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for arm, by_lr in arms.items():
        lr = best_lr(by_lr)
        tried = ", ".join(
            f"{x:g}: {score(r):.2f}"
            for x in sorted(by_lr)
            for r in by_lr[x]
            if r["key"]["seed"] == first_seed
        )
        best = by_lr[lr]
        times = [t for t in (recipe.time_to(r["curve"], target) for r in best) if t is not None]
        mean_time = statistics.mean(times) if times else None
        lines.append(
            f"| {arm} | {tried} | {lr:g} | {len(best)} | "
            f"{spread([r['eval_perplexity'] for r in best])} | "
            f"{spread([score(r) for r in best])} | "
            f"{spread([r['test_perplexity'] for r in best])} | "
            f"{'not reached' if mean_time is None else f'{mean_time:.1f}'} | "
            f"{len(times)}/{len(best)} | "
            f"{'' if mean_time is None else f'{mean_time / target_time:.3f}'} |"
        )
    return "\n".join(lines)


def parse_pairs(values: Sequence[str], flag: str) -> dict[str, str]:
    """``NAME=VALUE`` flags as a dict, refusing anything else.

    Example:
        >>> parse_pairs(["a=--optim sgd"], "--arm")
        {'a': '--optim sgd'}
    """
    pairs = {}
    for value in values:
        name, sep, rest = value.partition("=")
        if not sep or not name:
            raise SystemExit(f"wikitext2_grid.py: error: {flag} {value!r}: expected NAME=VALUE")
        pairs[name] = rest
    return pairs


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module doc); returns 0 when the grid is complete, 3 when
    ``--max_wall`` stopped it."""
    argv = list(sys.argv[1:] if argv is None else argv)
    common = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(prog="wikitext2_grid.py", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="Train the grid's missing runs.")
    run.add_argument("--runs_file", required=True, help="The JSON-lines file of finished runs.")
    run.add_argument("--arm", action="append", required=True, help="NAME=FLAGS of one optimizer.")
    run.add_argument("--lrs", action="append", required=True, help="NAME=LR,LR,... of an arm.")
    run.add_argument("--seeds", default="42,43,44", help="Seeds; the first one sweeps the lrs.")
    run.add_argument(
        "--out_dir", default="outputs/wikitext2_grid", help="Folder of the runs' output folders."
    )
    run.add_argument("--extend", type=int, default=2, help="Learning rates added at most.")
    run.add_argument(
        "--max_wall", type=float, default=math.inf, help="Start no run past this many seconds."
    )
    show = commands.add_parser("summary", help="Print the grid's table.")
    show.add_argument("runs_file", help="The JSON-lines file of finished runs.")
    show.add_argument(
        "--target", required=True, help="The arm whose best perplexity is the target."
    )
    show.add_argument("--seed", type=int, default=42, help="The seed that swept the lrs.")
    options = parser.parse_args(own)
    if options.command == "summary":
        print(summary(records(options.runs_file), options.target, options.seed))
        return 0
    arms = {k: shlex.split(v) for k, v in parse_pairs(options.arm, "--arm").items()}
    lrs = {
        k: [float(x) for x in v.split(",")] for k, v in parse_pairs(options.lrs, "--lrs").items()
    }
    if set(arms) != set(lrs):
        parser.error(f"--arm names {sorted(arms)} and --lrs names {sorted(lrs)} differ")
    seeds = [int(s) for s in options.seeds.split(",")]
    done = run_grid(
        arms,
        lrs,
        seeds,
        options.runs_file,
        common,
        out_dir=options.out_dir,
        extend=options.extend,
        max_wall=options.max_wall,
    )
    return 0 if done else 3


if __name__ == "__main__":
    sys.exit(main())
