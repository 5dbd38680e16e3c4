"""The Trainer's speed against the hand-written loop, in rounds that can span several calls.

Each part is one process; a round runs every part once, in turn (odd rounds in the order
given, even rounds reversed, so that a drift of the host's speed hits the parts alike),
and each run is appended to ``--results`` (JSON lines) as it ends. Runs already there
for this commit are kept: a later call starts where the last one stopped.
``--time-limit`` stops before a part that would not end in time (its last recorded
duration is the guess), so that a call of bounded length ends cleanly.

Parts, the commands of BENCHMARKS.md:

- ``recipe``: ``accelerate launch recipes/cifar10_resnet18.py --dataset DATA --seed R``
  (R: the round), its training samples/s as ``acceptance.py`` computes them;
- ``loop``: ``benchmarks/train_cifar.py --optimizer adamw --epochs 30 --batch_size 512
  --max_grad_norm 1.0`` (AdamW(fused), channels_last, bf16, the recipe's clipping);
- ``compiled``: the recipe with ``--torch_compile true --torch_compile_mode
  reduce-overhead`` and the same seed;
- ``trainer``: ``bench_trainer.py --variants loop_adamw_fused,trainer_adamw_fused``, the
  Trainer with AdamW(fused) against the loop in one process.

``--summary`` prints each round's figures and the medians over rounds of what the
acceptance compares: recipe / loop training samples/s (the two runs of a round),
trainer / loop, compiled / eager recipe steady samples/s (same seed), and the mean
accuracy gap of compiled against eager.

Usage:
    python benchmarks/trainer_rounds.py --data .data/cifar10 --rounds 3 --time-limit 540
    python benchmarks/trainer_rounds.py --summary
    python benchmarks/trainer_rounds.py --smoke --parts loop,trainer --results /tmp/r.jsonl
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import acceptance
import harness

BENCHMARKS = Path(__file__).resolve().parent
REPO = BENCHMARKS.parent
PARTS = ("recipe", "loop", "compiled", "trainer")
RESULTS = BENCHMARKS / "results" / "trainer_rounds.jsonl"
LAUNCH = ["-m", "accelerate.commands.launch", "--num_processes", "1", "--num_machines", "1"]
LAUNCH += ["--mixed_precision", "no", "--dynamo_backend", "no"]
# the smoke forms: tiny models on the CPU, a few steps (those of fast_defaults.sh --smoke)
SMOKE_RECIPE = ["--model", "test_resnet", "--use_cpu", "--max_steps", "4", "--plot", "false"]
SMOKE_RECIPE += ["--per_device_train_batch_size", "8", "--per_device_eval_batch_size", "100"]


def command(part: str, round_: int, data: str, folder: Path, smoke: bool) -> list[str]:
    """The command line of ``part`` in round ``round_``, writing its records into
    ``folder``."""
    if part in ("recipe", "compiled"):
        cmd = [*LAUNCH, "recipes/cifar10_resnet18.py", "--dataset", data, "--seed", str(round_)]
        cmd += ["--disable_tqdm", "true", "--output_dir", str(folder)]
        if part == "compiled":
            cmd += ["--torch_compile", "true", "--torch_compile_mode", "reduce-overhead"]
        return cmd + (SMOKE_RECIPE if smoke else [])
    if part == "loop":
        cmd = ["benchmarks/train_cifar.py", "--data", data, "--optimizer", "adamw"]
        cmd += ["--max_grad_norm", "1.0", "--out", str(folder / "train_cifar.json")]
        sizes = ["--smoke", "--batch_size", "8", "--max_steps", "3"]
        return cmd + (sizes if smoke else ["--epochs", "30", "--batch_size", "512"])
    variants = "loop_adamw_fused,trainer_adamw_fused"
    cmd = ["benchmarks/bench_trainer.py", "--data", data, "--variants", variants]
    return cmd + ["--out", str(folder)] + (["--smoke"] if smoke else [])


def figures(part: str, folder: Path) -> dict[str, Any] | None:
    """The figures of a finished run, or ``None`` when it left no record."""
    if part in ("recipe", "compiled"):
        return acceptance.recipe_figures(folder)
    if part == "loop":
        return acceptance.loop_figures(folder / "train_cifar.json")
    record = acceptance.load(folder / "bench_trainer.json")
    if record is None:
        return None
    rows = {row["variant"]: row for row in record["results"]}
    loop, trainer = rows["loop_adamw_fused"], rows["trainer_adamw_fused"]
    return {
        "loop_samples_per_second": loop["samples_per_second"],
        "samples_per_second": trainer["samples_per_second"],
        "vs_loop": trainer["vs_loop"],
    }


def commit() -> str:
    """The checkout's commit (``unknown`` outside git)."""
    git = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
        text=True,
        capture_output=True,
        check=False,
    )
    return git.stdout.strip() or "unknown"


def pending(done: set[tuple[int, str]], parts: Sequence[str], rounds: int) -> list:
    """``(round, part)`` still to run, in running order; ``done`` holds those recorded.

    Example:
        >>> pending({(1, "recipe")}, ["recipe", "loop"], 2)
        [(1, 'loop'), (2, 'loop'), (2, 'recipe')]
    """
    order = []
    for r in range(1, rounds + 1):
        turn = list(parts) if r % 2 else list(reversed(parts))
        order += [(r, part) for part in turn if (r, part) not in done]
    return order


def read(path: Path) -> list[dict[str, Any]]:
    """The runs recorded in ``path`` (none when it does not exist)."""
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_rounds(args: argparse.Namespace) -> int:
    """Runs what is pending within the time limit; returns the number of failed runs."""
    here, start, failed = commit(), time.monotonic(), 0
    records = [r for r in read(args.results) if r["commit"] == here and r["smoke"] == args.smoke]
    done = {(r["round"], r["part"]) for r in records if r["figures"] is not None}
    last = {r["part"]: r["seconds"] for r in records}
    for round_, part in pending(done, args.parts, args.rounds):
        left = args.time_limit - (time.monotonic() - start)
        if args.time_limit and last.get(part, 0.0) > left:
            print(f"stopping before round {round_} {part}: {left:.0f} s left", flush=True)
            break
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            cmd = [sys.executable, *command(part, round_, args.data, folder, args.smoke)]
            print(f"round {round_} {part}: {' '.join(cmd[1:])}", flush=True)
            began = time.monotonic()
            code = subprocess.run(cmd, cwd=REPO, check=False).returncode
            seconds = time.monotonic() - began
            found = figures(part, folder) if code == 0 else None
        failed += found is None
        record = {"part": part, "round": round_, "commit": here, "smoke": args.smoke}
        record.update(host=socket.gethostname(), seconds=seconds, exit=code, figures=found)
        record["date_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        args.results.parent.mkdir(parents=True, exist_ok=True)
        with args.results.open("a") as out:
            out.write(json.dumps(record) + "\n")
        last[part] = seconds
    return failed


def ratios(records: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Per round (of one commit), the ratios the acceptance takes the median of."""
    by_round: dict[int, dict[str, dict]] = {}
    for r in records:
        if r["figures"] is not None:
            by_round.setdefault(r["round"], {})[r["part"]] = r["figures"]
    out: dict[str, list[float]] = {"recipe / loop": [], "trainer / loop": []}
    out.update({"compiled / recipe, steady": [], "compiled - recipe, accuracy points": []})
    for runs in by_round.values():
        recipe, loop, compiled = runs.get("recipe"), runs.get("loop"), runs.get("compiled")
        pairs = [
            ("recipe / loop", acceptance.ratio(recipe, loop, "samples_per_second")),
            (
                "compiled / recipe, steady",
                acceptance.ratio(compiled, recipe, "steady_samples_per_second"),
            ),
        ]
        if "trainer" in runs:
            pairs.append(("trainer / loop", runs["trainer"]["vs_loop"]))
        if recipe and compiled:
            points = 100 * (compiled["accuracy"] - recipe["accuracy"])
            pairs.append(("compiled - recipe, accuracy points", points))
        for name, value in pairs:
            if value is not None:
                out[name].append(value)
    return out


def summary(records: list[dict[str, Any]]) -> str:
    """Each commit's runs and the medians (the accuracy gap: the mean) over its rounds."""
    parts = []
    for here in dict.fromkeys(r["commit"] for r in records):
        mine = [r for r in records if r["commit"] == here]
        rows = [
            {
                "name": k,
                "values": v,
                "figure": (statistics.fmean if "accuracy" in k else statistics.median)(v),
            }
            for k, v in ratios(mine).items()
            if v
        ]
        columns = {
            "commit " + here: lambda r: r["name"],
            "rounds": lambda r: " / ".join(f"{v:.3f}" for v in r["values"]),
            "median (accuracy: mean)": lambda r: f"{r['figure']:.3f}",
        }
        parts.append(harness.table(rows, columns))
    return "\n\n".join(parts) or "no runs recorded"


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the pending rounds (or prints the summary); returns the number of failures."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default="embedded", help="'embedded' or a parquet folder")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"of {PARTS}, in order")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--time-limit", type=float, default=0.0, help="seconds; 0: none")
    parser.add_argument("--results", type=Path, default=RESULTS, help="JSON lines")
    parser.add_argument("--smoke", action="store_true", help="tiny models on the CPU")
    parser.add_argument("--summary", action="store_true", help="print the medians, run nothing")
    args = parser.parse_args(argv)
    args.parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    if not args.parts or set(args.parts) - set(PARTS) or args.rounds < 1:
        parser.error(f"--parts: choose from {PARTS}; --rounds >= 1")
    if args.summary:
        print(summary(read(args.results)))
        return 0
    failed = run_rounds(args)
    print(summary([r for r in read(args.results) if r["smoke"] == args.smoke]))
    return failed


if __name__ == "__main__":
    sys.exit(main())
