"""Accuracy at equal epochs: AdaFisher's fold rules against tuned AdamW and SGD and a
curvature-off control, each run a ``cifar`` training.

Every arm trains the same model (``--model``, default timm ``resnet18_cifar``) on the
same data path (decoded once, augmented on the GPU), batch, epochs, one-cycle schedule and
label smoothing; only the optimizer differs. The arms (:data:`ARMS`):

- ``adamw``: AdamW(fused); ``sgd``: SGD with Nesterov momentum 0.9 (fused); both decay
  every parameter; ``adamw_exempt`` / ``sgd_exempt``: the same with biases and
  normalisation weights undecayed, as every AdaFisher arm's groups (and timm's and the
  Trainer's) have them;
- ``adafisher``: AdaFisher (L2 decay), the published algorithm: the published fold rule
  (``ema="reference"``), a refresh every 100 steps, factors seeded with ones;
  ``adafisher_every20`` / ``adafisher_every5``: the same rule refreshed more often;
- ``curvature_off``: the control. Under the published rule the preconditioner settles
  near the damping everywhere (docs/design.md), so AdaFisher's update tends to
  ``m <- 0.9*m + 0.1*g; theta -= lr/damping * m``: that update exactly, as torch's SGD
  with ``dampening=0.9`` (its lr is AdaFisher's lr / damping);
- ``adafisher_paper``: the rule as the paper writes it (``ema="paper"``, normalised after
  the EMA, a refresh every step): the preconditioner varies;
- ``adafisher_paper_every10``: ours, not a published algorithm: the paper's fold refreshed
  every 10 steps, a varying preconditioner at a tenth of the refreshes;
- ``adafisher_paper_relative`` / ``adafisher_relative``: ours, not a published algorithm:
  the paper's and the published fold rules with the scale-free normalisation
  (``normalise="relative"``: each statistic spans [0, 1) however small its range, where
  the published 1e-6 leaves the gradient statistics of a mean loss near 0);
- ``adafisher_zeros``: ours, not a published algorithm (the package's default): the
  published rule with factors seeded with zeros (``factor_init="zeros"``): from ones, the
  first refresh leaves each factor about ten times its settled scale and the step grows
  about 7x at the second refresh (step ``update_every``); from zeros it starts near its
  settled size.
- ``adamw_clip`` / ``sgd_clip`` / ``adafisher_zeros_clip``: those arms with the
  gradients' global norm clipped to 1.0 before each step, as the Trainer's default
  ``max_grad_norm`` clips (the loop's only difference from the unclipped arms).

The arms measured before the package's default seed became zeros name
``factor_init="ones"`` so that they stay the runs they were.

A grid is a list of ``ARM:lr=A,B,...:wd=C,...`` specs, each run at every seed, data
set and epoch budget given (``--epochs 10,20``: each budget its own run with its own
schedule; ``time-to-accuracy`` reads those). Runs are appended, one JSON line each,
to ``--results`` as they end; a run already there is skipped, so a grid spans several
calls. ``--workers N`` runs N training processes at once on one GPU (accuracy only: their
``train_seconds`` overlap and are marked with ``workers``); ``--stop_after S`` starts no
run after S seconds.
``--summarise`` prints per data set and arm each configuration's mean and spread over its
seeds and the best configuration.

Usage:
    python -m benchmarks accuracy --data .data/cifar100 --epochs 15 --seeds 0 \\
        --grid adamw:lr=3e-3,6e-3:wd=0.05 sgd:lr=0.4,0.8:wd=5e-4 --workers 3 \\
        --results benchmarks/results/equal_epochs.jsonl
    python -m benchmarks accuracy --summarise benchmarks/results/equal_epochs.jsonl
    python -m benchmarks accuracy --smoke --results /tmp/ee.jsonl   # CPU
"""

import argparse
import fcntl
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks import cifar, harness
from hf_triaccel.data.images import ImageTensors

NAME = "accuracy"
HELP = "accuracy at equal epochs: AdaFisher's arms against tuned AdamW and SGD"

# arm -> (train_cifar optimizer, its flags)
ARMS: dict[str, tuple[str, dict[str, Any]]] = {
    "adamw": ("adamw", {}),
    "sgd": ("sgd", {}),
    "adamw_exempt": ("adamw", {"decay": "exempt"}),
    "sgd_exempt": ("sgd", {"decay": "exempt"}),
    "adafisher": ("adafisher", {"factor_init": "ones"}),
    "adafisher_every20": ("adafisher", {"update_every": 20, "factor_init": "ones"}),
    "adafisher_every5": ("adafisher", {"update_every": 5, "factor_init": "ones"}),
    "curvature_off": ("sgd_ema", {}),
    "adafisher_paper": ("adafisher", {"ema": "paper"}),
    "adafisher_paper_every10": ("adafisher", {"ema": "paper", "update_every": 10}),
    "adafisher_paper_relative": ("adafisher", {"ema": "paper", "normalise": "relative"}),
    "adafisher_relative": ("adafisher", {"normalise": "relative", "factor_init": "ones"}),
    "adafisher_zeros": ("adafisher", {"factor_init": "zeros"}),
    "adamw_clip": ("adamw", {"max_grad_norm": 1.0}),
    "sgd_clip": ("sgd", {"max_grad_norm": 1.0}),
    "adafisher_zeros_clip": ("adafisher", {"factor_init": "zeros", "max_grad_norm": 1.0}),
}
RESULTS = harness.REPO_ROOT / "benchmarks" / "results" / "equal_epochs.jsonl"
SMOKE_GRID = ("adamw:lr=3e-3:wd=0.05", "curvature_off:lr=3:wd=5e-4", "adafisher_paper:lr=1e-2")
SMOKE_STEPS = 2
MODEL = "resnet18_cifar"
SWEEP_SEED = 0  # the seed of every learning-rate sweep; the chosen ones run more seeds


def parse_spec(spec: str) -> tuple[str, list[float], list[float | None]]:
    """``ARM:lr=A,B:wd=C`` -> (arm, lrs, weight decays); without ``wd`` the optimizer's
    default (``None``).

    Example:
        >>> parse_spec("sgd:lr=0.2,0.4:wd=5e-4")
        ('sgd', [0.2, 0.4], [0.0005])
    """
    arm, *fields = spec.split(":")
    if arm not in ARMS:
        raise argparse.ArgumentTypeError(f"arm {arm!r} in {spec!r}: choose from {tuple(ARMS)}")
    values: dict[str, list] = {"lr": [], "wd": [None]}
    for item in fields:
        name, _, text = item.partition("=")
        if name not in values or not text:
            raise argparse.ArgumentTypeError(f"{item!r} in {spec!r}: write lr=A,B or wd=C,D")
        values[name] = [float(x) for x in text.split(",")]
    if not values["lr"]:
        raise argparse.ArgumentTypeError(f"{spec!r} names no learning rate (lr=A,B)")
    return arm, values["lr"], values["wd"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The grid, its data, budgets, seeds and results file."""
    parser.add_argument("--data", nargs="+", default=[".data/cifar100"], help="parquet folders")
    parser.add_argument("--grid", nargs="+", type=parse_spec, help="ARM:lr=A,B[:wd=C,D] specs")
    parser.add_argument("--epochs", default="15", help="budgets, comma-separated")
    parser.add_argument("--batch_size", type=int, default=512)
    parser.add_argument("--model", default=MODEL, help="timm model (cifar.py's)")
    parser.add_argument("--seeds", default="0", help="comma-separated")
    parser.add_argument("--workers", type=int, default=1, help="training processes at once")
    parser.add_argument("--stop_after", type=float, help="seconds: start no run after them")
    parser.add_argument("--results", type=Path, default=RESULTS, help="JSON lines, appended to")
    parser.add_argument("--summarise", type=Path, nargs="+", help="only summarise these files")
    parser.add_argument("--smoke", action="store_true", help="CPU, random images, 2 steps a run")
    parser.add_argument("--worker_of", type=Path, help=argparse.SUPPRESS)  # internal


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """The flags of ``argv``, checked (:func:`check`)."""
    parser = argparse.ArgumentParser(prog=f"python -m benchmarks {NAME}")
    add_arguments(parser)
    args = parser.parse_args(argv)
    args.argv = [NAME, *argv]
    return check(args)


def check(args: argparse.Namespace) -> argparse.Namespace:
    """Seeds and budgets as lists, the smoke grid, a clear error without a grid."""
    args.seeds = [int(s) for s in args.seeds.split(",")]
    args.epochs = [int(e) for e in args.epochs.split(",")]
    if args.smoke:
        args.batch_size = 8
    if args.grid is None:
        args.grid = [parse_spec(s) for s in SMOKE_GRID] if args.smoke else []
    if not args.grid and not args.summarise:
        raise SystemExit("error: --grid is required (or --summarise)")
    args.start = time.time()
    return args


def jobs(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every run of the grid, in the order given: data set, budget, spec, lr, wd, seed."""
    out = []
    grid = itertools.product(args.data, args.epochs, args.grid, args.seeds)
    for data, epochs, (arm, lrs, wds), seed in grid:
        optimizer = ARMS[arm][0]
        for lr, wd in itertools.product(lrs, wds):
            wd = harness.HYPERPARAMETERS[optimizer][1] if wd is None else wd
            job = {"data": data, "arm": arm, "lr": lr, "weight_decay": wd, "seed": seed}
            job.update(budget_epochs=epochs, batch_size=args.batch_size, model=args.model)
            out.append(job)
    return out


def key(record: dict[str, Any]) -> tuple:
    """What identifies a run (a record or a job)."""
    dataset = Path(record["data"]).name
    config = record["arm"], record["lr"], record["weight_decay"], record["seed"]
    return dataset, record["model"], *config, record["budget_epochs"], record["batch_size"]


def read_records(paths: Sequence[Path]) -> list[dict[str, Any]]:
    lines = (line for p in paths if p.is_file() for line in p.read_text().splitlines())
    return [json.loads(line) for line in lines if line.strip()]


def train_args(job: dict[str, Any], args: argparse.Namespace) -> argparse.Namespace:
    optimizer, fisher = ARMS[job["arm"]]
    flags = ["--optimizer", optimizer, "--lr", str(job["lr"]), "--seed", str(job["seed"])]
    flags += ["--weight_decay", str(job["weight_decay"]), "--epochs", str(job["budget_epochs"])]
    flags += ["--data", job["data"], "--batch_size", str(job["batch_size"])]
    flags += ["--model", job["model"]]
    flags += [f for name, value in fisher.items() for f in (f"--{name}", str(value))]
    if args.smoke:
        flags += ["--smoke", "--max_steps", str(SMOKE_STEPS)]
    return cifar.parse_args(flags)


def append(path: Path, record: dict[str, Any]) -> None:
    """Appends one JSON line, locked against the other workers."""
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.write(json.dumps(record) + "\n")


def claim(claims: Path, job: dict[str, Any]) -> bool:
    """Whether this worker takes ``job`` (the first to create its claim file does)."""
    name = "_".join(map(str, key(job))).replace("/", "-")
    try:
        os.close(os.open(claims / name, os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return False
    return True


def work(args: argparse.Namespace, claims: Path | None, data: dict[str, tuple]) -> int:
    """Runs the grid's missing runs (those this worker claims); returns the failures."""
    done = {key(r) for r in read_records([args.results])}
    failed = 0
    for job in jobs(args):
        if key(job) in done or (claims is not None and not claim(claims, job)):
            continue
        if args.stop_after is not None and time.time() - args.start > args.stop_after:
            print(f"--stop_after reached: {job['arm']} lr {job['lr']:g} not started", flush=True)
            continue
        run_args = train_args(job, args)
        if job["data"] not in data:
            data[job["data"]] = cifar.load_data(run_args)
        try:
            record = cifar.train(run_args, data[job["data"]])
        except Exception as exc:  # the grid's other runs still run
            harness.report_error(exc)
            failed += 1
            continue
        finally:
            harness.free_memory(run_args.device)
        record.update(arm=job["arm"], budget_epochs=job["budget_epochs"], workers=args.workers)
        record["dataset"] = Path(job["data"]).name
        append(args.results, record)
        print(
            f"{record['dataset']} {job['arm']} lr {job['lr']:g} wd {job['weight_decay']:g} "
            f"seed {job['seed']}, {job['budget_epochs']} epochs: "
            f"{100 * record['test_accuracy']:.2f}% "
            f"({record['train_seconds']:.1f} s)",
            flush=True,
        )
    return failed


def save_data(data: tuple[ImageTensors, ImageTensors, float], path: Path) -> None:
    train, test, seconds = data
    torch.save({"train": vars(train), "test": vars(test), "seconds": seconds}, path)


def load_data(path: Path) -> tuple[ImageTensors, ImageTensors, float]:
    saved = torch.load(path)
    return ImageTensors(**saved["train"]), ImageTensors(**saved["test"]), saved["seconds"]


def run_workers(args: argparse.Namespace) -> int:
    """Decodes each data set once, then runs ``args.workers`` processes that share the
    grid through claim files; returns the failures."""
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        (scratch / "claims").mkdir()
        done = {key(r) for r in read_records([args.results])}
        for i, path in enumerate(args.data):
            pending = [j for j in jobs(args) if j["data"] == path and key(j) not in done]
            if pending:
                save_data(cifar.load_data(train_args(pending[0], args)), scratch / f"{i}.pt")
        cmd = [sys.executable, "-m", "benchmarks", *args.argv, "--worker_of", str(scratch)]
        env = {**os.environ, "EQUAL_EPOCHS_START": str(args.start)}
        root = harness.REPO_ROOT
        procs = [subprocess.Popen(cmd, env=env, cwd=root) for _ in range(args.workers)]
        return sum(p.wait() != 0 for p in procs)


def group(record: dict[str, Any]) -> tuple[str, str, int, int]:
    """The comparison a run belongs to: (data set, model, epoch budget, batch size)."""
    return record["dataset"], record["model"], record["budget_epochs"], record["batch_size"]


def summarise(records: list[dict[str, Any]]) -> dict[tuple, dict[str, Any]]:
    """Per comparison (:func:`group`) and arm: each configuration's accuracies by seed,
    their mean and spread (max - min), and the chosen configuration: the best at the
    sweep's seed (:data:`SWEEP_SEED`), whose other seeds then give its mean, with its
    learning-rate neighbours at the same weight decay."""
    out: dict[tuple, dict[str, Any]] = {}
    for r in records:
        arm = out.setdefault(group(r), {}).setdefault(r["arm"], {"configs": {}})
        config = arm["configs"].setdefault((r["lr"], r["weight_decay"]), {"acc": {}})
        config["acc"][r["seed"]] = 100 * r["test_accuracy"]
    for arms in out.values():
        for arm in arms.values():
            configs = arm["configs"]
            for config in configs.values():
                acc = list(config["acc"].values())
                config.update(mean=statistics.fmean(acc), spread=max(acc) - min(acc), n=len(acc))
            swept = [c for c in configs if SWEEP_SEED in configs[c]["acc"]]
            best = max(swept, key=lambda c: configs[c]["acc"][SWEEP_SEED], default=None)
            arm["best"] = best
            if best is not None:
                lrs = sorted(lr for lr, wd in configs if wd == best[1])
                i = lrs.index(best[0])
                arm["neighbours"] = [
                    configs[(lrs[j], best[1])] if 0 <= j < len(lrs) else None
                    for j in (i - 1, i + 1)
                ]
    return out


def report(summary: dict[tuple, dict[str, Any]]) -> str:
    """The summary as markdown, per comparison: the chosen configuration of each arm, then
    every run configuration (the chosen one in bold)."""
    parts = []
    for (dataset, model, epochs, batch), arms in sorted(summary.items()):
        names = [a for a in ARMS if a in arms and arms[a]["best"] is not None]
        lines = [
            f"### {dataset}, {model}, {epochs} epochs, batch {batch}",
            "",
            "Chosen: the best at seed 0, its mean over seeds; its neighbours at seed 0:",
            "",
        ]
        lines += [
            "| arm | lr | weight decay | seeds | mean | spread | next lower lr | next higher lr |"
        ]
        lines.append("|---|---|---|---|---|---|---|---|")
        for name in names:
            arm = arms[name]
            (lr, wd), c = arm["best"], arm["configs"][arm["best"]]
            side = [
                "not run" if n is None else f"{n['acc'].get(SWEEP_SEED, n['mean']):.2f}%"
                for n in arm["neighbours"]
            ]
            lines.append(
                f"| {name} | {lr:g} | {wd:g} | {c['n']} | {c['mean']:.2f}% | "
                f"{c['spread']:.2f} | {side[0]} | {side[1]} |"
            )
        lines += ["", "Every configuration:", "", "| arm | lr | weight decay | seeds | mean |"]
        lines.append("|---|---|---|---|---|")
        for name in [a for a in ARMS if a in arms]:
            arm = arms[name]
            for (lr, wd), c in sorted(arm["configs"].items()):
                mean = f"{c['mean']:.2f}%"
                mean = f"**{mean}**" if (lr, wd) == arm["best"] else mean
                lines.append(f"| {name} | {lr:g} | {wd:g} | {c['n']} | {mean} |")
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


def run(args: argparse.Namespace) -> int:
    """Runs the grid (or only summarises) and prints the summary; returns the failures."""
    if not hasattr(args, "start"):
        check(args)
    if args.summarise:
        print(report(summarise(read_records(args.summarise))))
        return 0
    args.results.parent.mkdir(parents=True, exist_ok=True)
    if args.worker_of is not None:  # one of run_workers' processes
        args.start = float(os.environ.get("EQUAL_EPOCHS_START", args.start))
        cached = {p: args.worker_of / f"{i}.pt" for i, p in enumerate(args.data)}
        data = {p: load_data(c) for p, c in cached.items() if c.is_file()}
        return work(args, args.worker_of / "claims", data)
    failed = run_workers(args) if args.workers > 1 else work(args, None, {})
    print(report(summarise(read_records([args.results]))))
    return failed
