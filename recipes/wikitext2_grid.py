"""A learning-rate and seed grid of the WikiText-2 recipe that survives interruptions, and
its summary: perplexity against training time for each optimizer.

Usage::

    python recipes/wikitext2_grid.py run --runs_file RUNS.jsonl --max_wall 540 \\
        --arm "adamw=--optim adamw_torch_fused" --lrs adamw=1e-4,3e-4,1e-3 \\
        --arm "paper=--optim adafisherw --adafisher_ema paper" --lrs paper=1e-3,3e-3,1e-2 \\
        --out_dir /tmp/wikitext2_grid -- --dataset DIR
    python recipes/wikitext2_grid.py summary RUNS.jsonl --target adamw --timing SOLO.jsonl

``run`` trains, arm after arm, every learning rate of the arm's list at the first seed.
While the best of them (lowest best validation perplexity) is at an end of the list, the
list grows past that end by a factor of 3 (``--extend`` times at most), so that the best
has a measured worse neighbour on each side. An arm whose list is ``best:OTHER`` trains
once, at the best learning rate of the earlier arm ``OTHER`` (a damping at the best
learning rate, say). Arms named ``GROUP/VARIANT`` are one group (``muon/a1e-3`` and
``muon/a3e-3``: Muon's learning rate swept at two AdamW-part rates, a 2-D grid; ``paper``
and ``paper/d1e-4``: a setting varied at the best rate): when every sweep is done, each
group's best arm and learning rate train at every other seed. Each run is one
``wikitext2_gpt2.py`` run in this process, with the arm's flags, ``--lr``, ``--seed``,
``--run_name ARM``, ``--runs_file`` and what follows ``--`` (its output folder
``--out_dir/ARM/lrLR_seedSEED``).
A run already in the runs file is skipped, so the same command, run again after a time
limit or ``--max_wall`` stopped it, continues where it stopped.

``summary`` prints, per arm, the learning rates tried (best validation perplexity at the
first seed), the best one, the mean and standard deviation over its seeds of the final
and best validation and the test perplexity, and the tokens and training time to the
target: the first evaluation of the arm's mean curve over its seeds at or below the
lowest point of the target arm's mean curve. Runs that share the device (``run`` under
CUDA MPS, several at once) have unequal step times, so ``--timing`` takes a runs file
of runs that had it to themselves (``wikitext2_gpt2.py --max_steps 300 --eval_strategy
no``) and times the target as tokens over their steady throughput.
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


def sweep(
    runs: Sequence[dict[str, Any]], arm: str, lrs: Sequence[float], first: int, extend: int
) -> tuple[float | None, float]:
    """The arm's learning-rate sweep at seed ``first``: ``(next, best)``, the next learning
    rate to train (``None`` when the sweep is done) and the best so far. The list grows
    past an end that holds the best, ``extend`` learning rates at most.

    Example:
        >>> runs = [{"name": "a", "key": {"seed": 0, "learning_rate": lr},
        ...          "best_eval_perplexity": ppl} for lr, ppl in ((1e-3, 90.0), (3e-3, 80.0))]
        >>> sweep(runs, "a", [1e-3, 3e-3], 0, extend=2)  # the best is at the top: grow
        (0.009, 0.003)
    """
    tried = sorted(lrs)
    best = 0
    for _ in range(extend + 1):
        missing = [lr for lr in tried if find(runs, arm, lr, first) is None]
        if missing:
            return missing[0], tried[best]
        scores = [score(find(runs, arm, lr, first)) for lr in tried]
        best = min(range(len(tried)), key=scores.__getitem__)
        if 0 < best < len(tried) - 1 or len(tried) - len(lrs) >= extend:
            break
        # three significant digits: learning rates that read as typed
        grown = float(f"{tried[0] / GROWTH if best == 0 else tried[-1] * GROWTH:.3g}")
        tried = [grown, *tried] if best == 0 else [*tried, grown]
        best = best + 1 if best == 0 else best
    return None, tried[best]


def group_of(arm: str) -> str:
    """The group of an arm: its name before a ``/``.

    Example:
        >>> group_of("muon/a1e-3"), group_of("adamw")
        ('muon', 'adamw')
    """
    return arm.split("/", 1)[0]


def next_run(
    runs: Sequence[dict[str, Any]],
    arms: Sequence[str],
    lrs: dict[str, Sequence[float] | str],
    seeds: Sequence[int],
    extend: int,
) -> tuple[str, float, int] | None:
    """The grid's next ``(arm, lr, seed)`` to train, or ``None`` when it is done: each
    arm's sweep at the first seed in order (``best:OTHER``: one run at ``OTHER``'s best),
    then each group's best arm and learning rate at every other seed.

    Example:
        >>> runs = [{"name": "a", "key": {"seed": 0, "learning_rate": lr},
        ...          "best_eval_perplexity": ppl} for lr, ppl in ((1e-3, 90.0), (3e-3, 80.0))]
        >>> next_run(runs, ["a"], {"a": [1e-3, 3e-3]}, [0, 1], extend=2)  # grow past the top
        ('a', 0.009, 0)
        >>> runs.append({"name": "a", "key": {"seed": 0, "learning_rate": 9e-3},
        ...              "best_eval_perplexity": 85.0})
        >>> next_run(runs, ["a", "a/x"], {"a": [1e-3, 3e-3], "a/x": "best:a"}, [0, 1], 2)
        ('a/x', 0.003, 0)
        >>> runs.append({"name": "a/x", "key": {"seed": 0, "learning_rate": 3e-3},
        ...              "best_eval_perplexity": 79.0})
        >>> next_run(runs, ["a", "a/x"], {"a": [1e-3, 3e-3], "a/x": "best:a"}, [0, 1], 2)
        ('a/x', 0.003, 1)
    """
    first = seeds[0]
    best: dict[str, float] = {}
    for arm in arms:
        spec = lrs[arm]
        if isinstance(spec, str):
            other = spec.removeprefix("best:")
            if other not in best:
                raise ValueError(f"arm {arm}: best:{other} needs the arm {other} before it")
            if find(runs, arm, best[other], first) is None:
                return arm, best[other], first
            best[arm] = best[other]
            continue
        planned, best[arm] = sweep(runs, arm, spec, first, extend)
        if planned is not None:
            return arm, planned, first
    groups: dict[str, list[str]] = {}
    for arm in arms:
        groups.setdefault(group_of(arm), []).append(arm)
    for members in groups.values():
        winner = min(members, key=lambda a: score(find(runs, a, best[a], first)))
        for seed in seeds[1:]:
            if find(runs, winner, best[winner], seed) is None:
                return winner, best[winner], seed
    return None


def run_grid(
    arms: dict[str, list[str]],
    lrs: dict[str, list[float] | str],
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
    while (planned := next_run(records(runs_file), list(arms), lrs, seeds, extend)) is not None:
        if time.perf_counter() - start + longest > max_wall:
            return False
        arm, lr, seed = planned
        argv = [
            *common,
            *arms[arm],
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


def mean_curve(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The seeds' mean curve: at each evaluation (the runs share their schedule), the
    tokens, the mean validation perplexity and the mean training time (``None`` where a
    run lacks it).

    Example:
        >>> runs = [{"curve": [{"tokens": 10, "train_time_s": 1.0, "eval_perplexity": 90.0}]},
        ...         {"curve": [{"tokens": 10, "train_time_s": 3.0, "eval_perplexity": 80.0}]}]
        >>> mean_curve(runs)
        [{'tokens': 10, 'train_time_s': 2.0, 'eval_perplexity': 85.0}]
    """
    points = []
    for at in zip(*(r["curve"] for r in runs), strict=True):
        times = [p["train_time_s"] for p in at]
        points.append(
            {
                "tokens": at[0]["tokens"],
                "train_time_s": None if None in times else statistics.mean(times),
                "eval_perplexity": statistics.mean(p["eval_perplexity"] for p in at),
            }
        )
    return points


def speed_key(key: dict[str, Any]) -> dict[str, Any]:
    """What sets a run's step time: its key less the learning rate, the seed, the
    budget and what the schedule does with them."""
    timing_free = ("learning_rate", "seed", "max_steps", "eval_steps", "warmup_steps")
    return {k: v for k, v in key.items() if k not in timing_free}


def solo_tokens_per_second(timing: Sequence[dict[str, Any]], key: dict[str, Any]) -> float | None:
    """The median steady throughput of the timing runs with the settings of ``key``
    (learning rate, seed and budget aside); ``None`` when none matches.

    Example:
        >>> timing = [{"key": {"optim": "a", "seed": 1, "max_steps": 300},
        ...            "tokens_per_second": 1000}]
        >>> solo_tokens_per_second(timing, {"optim": "a", "seed": 42, "max_steps": 2442})
        1000
    """
    wanted = speed_key(key)
    speeds = [
        r["tokens_per_second"]
        for r in timing
        if speed_key(r["key"]) == wanted and r.get("tokens_per_second")
    ]
    return statistics.median(speeds) if speeds else None


def summary(
    runs: Sequence[dict[str, Any]],
    target_arm: str,
    first_seed: int,
    timing: Sequence[dict[str, Any]] = (),
    versus: Sequence[str] = (),
) -> str:
    """The grid's table (see the module doc), as Markdown.

    ``target_arm`` and the names of ``versus`` are arms or groups (a group stands for its
    best arm). With ``versus``, a last column gives each arm's time to the target over
    the shortest of theirs ("x the better of AdamW and Muon"). Under the table, each
    group's best arm and its tuning runs (the runs at ``first_seed``).

    Each arm's row is its best learning rate (lowest best validation perplexity at
    ``first_seed``) over its seeds. The target is the lowest point of the target arm's
    mean curve; an arm reaches it at the first evaluation of its own mean curve at or
    below it. The time to the target is the tokens trained by then divided by the arm's
    steady throughput in ``timing`` (runs that had the device to themselves) when it has
    one, else the runs' own mean training time at that evaluation.

    Example:
        >>> runs = [{"name": "adamw", "key": {"seed": 0, "learning_rate": 1e-3},
        ...          "best_eval_perplexity": 100.0, "eval_perplexity": 101.0,
        ...          "test_perplexity": 98.0, "curve": [
        ...              {"tokens": 2e6, "train_time_s": 10.0, "eval_perplexity": 100.0},
        ...              {"tokens": 4e6, "train_time_s": 20.0, "eval_perplexity": 101.0}]}]
        >>> print(summary(runs, "adamw", 0))  # doctest: +NORMALIZE_WHITESPACE
        target: the lowest point of adamw's mean validation perplexity, 100.00
        | arm | learning rates (best validation perplexity, seed 0) | best lr | seeds |
        final validation | best validation | test | tokens to target (M) |
        time to target (s) | time / adamw's |
        |---|---|---|---|---|---|---|---|---|---|
        | adamw | 0.001: 100.00 | 0.001 | 1 | 101.00 | 100.00 | 98.00 | 2.0 | 10.0 (runs) |
        1.000 |
        <BLANKLINE>
        tuning runs at seed 0: adamw 1
    """
    arms: dict[str, dict[float, list[dict]]] = {}
    for run in runs:
        arms.setdefault(run["name"], {}).setdefault(run["key"]["learning_rate"], []).append(run)

    best_lr = best_learning_rates(runs, first_seed)
    winners = group_winners(runs, first_seed)

    def resolve(name: str) -> str:
        if name in arms:
            return name
        if name in winners:
            return winners[name]
        raise ValueError(f"no arm or group {name!r} in the runs; arms: {sorted(arms)}")

    target_arm = resolve(target_arm)
    versus = [resolve(name) for name in versus]

    def spread(values: list[float]) -> str:
        if len(values) < 2:
            return f"{values[0]:.2f}"
        return f"{statistics.mean(values):.2f} ± {statistics.stdev(values):.2f}"

    def reach(best: list[dict], target: float) -> tuple[float, float | None, str] | None:
        """Tokens and seconds at the target, and where the seconds come from."""
        point = next((p for p in mean_curve(best) if p["eval_perplexity"] <= target), None)
        if point is None:
            return None
        speed = solo_tokens_per_second(timing, best[0]["key"])
        if speed is not None:
            return point["tokens"], point["tokens"] / speed, "solo"
        return point["tokens"], point["train_time_s"], "runs"

    target = min(p["eval_perplexity"] for p in mean_curve(arms[target_arm][best_lr[target_arm]]))
    reached = {arm: reach(by_lr[best_lr[arm]], target) for arm, by_lr in arms.items()}
    target_seconds = reached[target_arm][1]

    rivals = [reached[arm][1] for arm in versus if reached[arm] and reached[arm][1]]
    best_rival = min(rivals, default=None)

    def time_cells(found: tuple[float, float | None, str] | None) -> str:
        extra = " |" if versus else ""
        if found is None:
            return "not reached | | |" + extra
        tokens, seconds, source = found
        if seconds is None:
            return f"{tokens / 1e6:.1f} | n/a | |" + extra
        ratio = f"{seconds / target_seconds:.3f}" if target_seconds else ""
        if versus:
            extra = f" {seconds / best_rival:.3f} |" if best_rival else " |"
        return f"{tokens / 1e6:.1f} | {seconds:.1f} ({source}) | {ratio} |" + extra

    versus_header = f" time / the better of {', '.join(versus)} |" if versus else ""
    lines = [
        f"target: the lowest point of {target_arm}'s mean validation perplexity, {target:.2f}",
        f"| arm | learning rates (best validation perplexity, seed {first_seed}) | best lr | "
        "seeds | final validation | best validation | test | tokens to target (M) | "
        f"time to target (s) | time / {target_arm}'s |{versus_header}",
        "|---|---|---|---|---|---|---|---|---|---|" + ("---|" if versus else ""),
    ]
    for arm, by_lr in arms.items():
        lr = best_lr[arm]
        tried = ", ".join(
            f"{x:g}: {score(r):.2f}"
            for x in sorted(by_lr)
            for r in by_lr[x]
            if r["key"]["seed"] == first_seed
        )
        best = by_lr[lr]
        lines.append(
            f"| {arm} | {tried} | {lr:g} | {len(best)} | "
            f"{spread([r['eval_perplexity'] for r in best])} | "
            f"{spread([score(r) for r in best])} | "
            f"{spread([r['test_perplexity'] for r in best])} | {time_cells(reached[arm])}"
        )
    tuning: dict[str, list[str]] = {}
    for arm in arms:
        tuning.setdefault(group_of(arm), []).append(arm)
    counts = []
    for group, members in tuning.items():
        swept = sum(r["name"] in members and r["key"]["seed"] == first_seed for r in runs)
        several = f" ({len(members)} arms, best {winners[group]})" if len(members) > 1 else ""
        counts.append(f"{group} {swept}{several}")
    lines.append(f"\ntuning runs at seed {first_seed}: {', '.join(counts)}")
    return "\n".join(lines)


def group_winners(runs: Sequence[dict[str, Any]], first_seed: int) -> dict[str, str]:
    """Each group's best arm: the lowest best validation perplexity at ``first_seed``.

    Example:
        >>> runs = [{"name": name, "key": {"seed": 0, "learning_rate": 1e-3},
        ...          "best_eval_perplexity": ppl} for name, ppl in (("m/a", 90.0), ("m/b", 80.0))]
        >>> group_winners(runs, 0)
        {'m': 'm/b'}
    """
    best: dict[str, tuple[float, str]] = {}
    for run in runs:
        if run["key"]["seed"] != first_seed:
            continue
        group, entry = group_of(run["name"]), (score(run), run["name"])
        best[group] = min(best.get(group, entry), entry)
    return {group: arm for group, (_, arm) in best.items()}


def best_learning_rates(runs: Sequence[dict[str, Any]], first_seed: int) -> dict[str, float]:
    """Each arm's best learning rate: the lowest best validation perplexity at
    ``first_seed``.

    Example:
        >>> runs = [{"name": "a", "key": {"seed": 0, "learning_rate": lr},
        ...          "best_eval_perplexity": ppl} for lr, ppl in ((1e-3, 90.0), (3e-3, 80.0))]
        >>> best_learning_rates(runs, 0)
        {'a': 0.003}
    """
    best: dict[str, tuple[float, float]] = {}
    for run in runs:
        if run["key"]["seed"] != first_seed:
            continue
        entry = (score(run), run["key"]["learning_rate"])
        best[run["name"]] = min(best.get(run["name"], entry), entry)
    return {arm: lr for arm, (_, lr) in best.items()}


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
    parser = argparse.ArgumentParser(
        prog="wikitext2_grid.py", description=__doc__.split("\n")[0], allow_abbrev=False
    )
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="Train the grid's missing runs.", allow_abbrev=False)
    run.add_argument("--runs_file", required=True, help="The JSON-lines file of finished runs.")
    run.add_argument("--arm", action="append", required=True, help="NAME=FLAGS of one optimizer.")
    run.add_argument(
        "--lrs",
        action="append",
        required=True,
        help="NAME=LR,LR,... of an arm, or NAME=best:OTHER (one run at the best of the "
        "earlier arm OTHER).",
    )
    run.add_argument("--seeds", default="42,43,44", help="Seeds; the first one sweeps the lrs.")
    run.add_argument(
        "--out_dir", default="outputs/wikitext2_grid", help="Folder of the runs' output folders."
    )
    run.add_argument("--extend", type=int, default=2, help="Learning rates added at most.")
    run.add_argument(
        "--max_wall", type=float, default=math.inf, help="Start no run past this many seconds."
    )
    show = commands.add_parser("summary", help="Print the grid's table.", allow_abbrev=False)
    show.add_argument("runs_file", help="The JSON-lines file of finished runs.")
    show.add_argument(
        "--target", required=True, help="The arm whose best perplexity is the target."
    )
    show.add_argument("--seed", type=int, default=42, help="The seed that swept the lrs.")
    show.add_argument(
        "--versus",
        help="Arms or groups, comma-separated (e.g. adamw,muon): a last column gives each "
        "arm's time to the target over the shortest of theirs.",
    )
    show.add_argument(
        "--timing",
        help="A runs file of runs that had the device to themselves (e.g. short runs with "
        "--eval_strategy no): the time to the target is the tokens to it over their steady "
        "throughput.",
    )
    options = parser.parse_args(own)
    if options.command == "summary":
        timing = records(options.timing) if options.timing else []
        versus = [name for name in (options.versus or "").split(",") if name]
        print(summary(records(options.runs_file), options.target, options.seed, timing, versus))
        return 0
    arms = {k: shlex.split(v) for k, v in parse_pairs(options.arm, "--arm").items()}
    lrs: dict[str, list[float] | str] = {
        k: v if v.startswith("best:") else [float(x) for x in v.split(",")]
        for k, v in parse_pairs(options.lrs, "--lrs").items()
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
