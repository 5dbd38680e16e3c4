"""Chaos run: training jobs stopped at random moments and restarted with the same command,
their final state compared bit for bit with an uninterrupted run's.

Each scenario trains the tiny job of :mod:`hf_triaccel.testing.preemptible` (a two-layer
network on a fixed synthetic set, CPU) once without interruption, then again from scratch,
stopping it at random moments (a signal after a random delay, within the time that is left)
and restarting it with the same command until it ends; a campaign is repeated until the
scenario's number of stops is reached. A campaign ends ``exact`` (final model, with its
per-sample visit counts, and optimizer state bitwise equal to the uninterrupted run's),
``differed``, or ``failed`` (it never finished: a restart crashed twice in a row or hung).

Scenarios: SIGTERM to the process or to its whole process group (AdaFisherW, AdamW, with
gradient accumulation, with the elastic batch, with two DataLoader workers); SIGKILL while
saves take 0.4 s more; DDP over 2 gloo processes with SIGTERM to one rank; and the same
against the stock ``transformers.Trainer`` with ``enable_jit_checkpoint=True`` (resumed
with ``resume_from_checkpoint=True`` when a checkpoint folder exists). One JSON line per
campaign goes to ``benchmarks/results/chaos.jsonl``.

Run: ``python -m benchmarks chaos``, ``--smoke`` for a
few stops.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import socket
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hf_triaccel.integrations.checkpoints import checkpoint_folders
from hf_triaccel.integrations.preemption import EXIT_PREEMPTED
from hf_triaccel.testing import preemptible as job

NAME = "chaos"
HELP = "Stop training jobs by SIGTERM / SIGKILL at random moments; check resumes end bitwise equal"
RESULTS = Path(__file__).resolve().parent / "results" / "chaos.jsonl"
TEAR_DOWN_SECONDS = 5.0  # a launcher's wait before it kills the ranks left after one failed


@dataclass(frozen=True)
class Scenario:
    """One configuration stopped ``stops`` times in all."""

    name: str
    trainer: str  # "triaccel" or "stock"
    config: str
    signum: int
    stops: int
    world_size: int = 1
    slow_save: float = 0.0
    group_every: int = 0  # every n-th signal goes to the whole process group (0: never)
    epochs: float = 3  # DDP's ranks start slowly: longer runs put more signals in training
    earliest: float = 0.05  # the shortest delay, as a share of the uninterrupted run's time


TERM, KILL = signal.SIGTERM, signal.SIGKILL
SCENARIOS = [
    Scenario("term-adafisherw", "triaccel", "adafisherw", TERM, 4, group_every=2),
    Scenario("term-adamw", "triaccel", "adamw", TERM, 4, group_every=2),
    Scenario("term-accumulation", "triaccel", "accumulation", TERM, 4, group_every=2),
    Scenario("term-elastic", "triaccel", "elastic", TERM, 4, group_every=2),
    Scenario("term-workers", "triaccel", "workers", TERM, 4, group_every=1),
    Scenario("kill-adafisherw", "triaccel", "adafisherw", KILL, 10, slow_save=0.4),
    Scenario("kill-adamw", "triaccel", "adamw", KILL, 10, slow_save=0.4),
    Scenario("ddp-adamw", "triaccel", "adamw", TERM, 6, world_size=2, epochs=12),
    Scenario("ddp-adafisherw", "triaccel", "adafisherw", TERM, 6, world_size=2, epochs=12),
    # the same, signals after the ranks' start (whose signals above mostly precede training)
    Scenario(
        "ddp-late-adamw", "triaccel", "adamw", TERM, 6, world_size=2, epochs=12, earliest=0.35
    ),
    Scenario(
        "ddp-late-adafisherw",
        "triaccel",
        "adafisherw",
        TERM,
        6,
        world_size=2,
        epochs=12,
        earliest=0.35,
    ),
    Scenario("stock-term-adamw", "stock", "adamw", TERM, 7, group_every=2),
    Scenario("stock-term-accumulation", "stock", "adamw_accumulation", TERM, 7, group_every=2),
    Scenario("stock-term-workers", "stock", "workers", TERM, 6, group_every=1),
    Scenario("stock-kill-adamw", "stock", "adamw", KILL, 20, slow_save=0.4),
    Scenario("stock-ddp-adamw", "stock", "adamw", TERM, 10, world_size=2, epochs=40),
]


def free_port() -> int:
    """A TCP port free on this host now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def last_step(output_dir: str) -> int:
    """The highest ``checkpoint-N`` step in ``output_dir`` (0 when none)."""
    return max((step for step, _ in checkpoint_folders(output_dir)), default=0)


def run_launch(
    argv: list[str], scenario: Scenario, delay: float | None, rng: random.Random, timeout: float
) -> dict[str, Any]:
    """One launch of the job's ranks, signalled after ``delay`` seconds (``None``: not at
    all); returns the exit codes and whether the signal reached a running job."""
    processes = job.run_ranks(argv, scenario.world_size, free_port())
    began = time.monotonic()
    signalled = None
    if delay is not None:
        while time.monotonic() - began < delay and any(p.is_alive() for p in processes):
            time.sleep(0.01)
        if all(p.is_alive() for p in processes):
            target = rng.randrange(len(processes))
            group = bool(scenario.group_every) and rng.randrange(scenario.group_every) == 0
            if scenario.signum == signal.SIGKILL:
                for p in processes:
                    job.send(p, signal.SIGKILL, group=True)
                group = True
            else:
                job.send(processes[target], scenario.signum, group=group)
            signalled = {"rank": target, "group": group, "after_s": round(delay, 3)}
    hung = torn_down = False
    while any(p.is_alive() for p in processes):
        ended = [p for p in processes if not p.is_alive()]
        if any(p.exitcode not in (0, EXIT_PREEMPTED) for p in ended) and not torn_down:
            # as torchrun does when a rank fails: the others are stopped after a grace period
            failed_at, torn_down = time.monotonic(), True
        if torn_down and time.monotonic() - failed_at > TEAR_DOWN_SECONDS:
            break
        if time.monotonic() - began > timeout:
            hung = True
            break
        time.sleep(0.02)
    for p in processes:
        if p.is_alive():
            job.send(p, signal.SIGKILL, group=True)
        p.join()
    return {
        "codes": [p.exitcode for p in processes],
        "signalled": signalled,
        "hung": hung,
        "torn_down": torn_down and not hung,
        "seconds": round(time.monotonic() - began, 3),
    }


def crashed(launch: dict[str, Any], world_size: int) -> bool:
    """Whether a launch failed by itself: it hung, or a rank raised (status 1) where no
    signal explains it (a rank killed before its handler was installed takes its peers
    down with it, as a launcher would)."""
    if launch["hung"]:
        return True
    if launch["signalled"] is None:
        return any(code not in (0, EXIT_PREEMPTED) for code in launch["codes"])
    return crashed_alone(launch, world_size)


def job_argv(scenario: Scenario, output_dir: str) -> list[str]:
    """The job's command line (the same for every launch of a campaign)."""
    argv = ["--output_dir", output_dir, "--config", scenario.config, "--trainer", scenario.trainer]
    argv += ["--epochs", str(scenario.epochs)]
    if scenario.slow_save:
        argv += ["--slow_save", str(scenario.slow_save)]
    return argv


def campaign(
    scenario: Scenario,
    reference: dict[str, Any],
    ref_seconds: float,
    total_steps: int,
    output_dir: str,
    wanted: int,
    rng: random.Random,
    timeout: float,
) -> dict[str, Any]:
    """Runs the job from scratch to its end with up to ``wanted`` stops."""
    argv = job_argv(scenario, output_dir)
    launches, stops, crashes_in_a_row = [], 0, 0
    result = "failed"
    while len(launches) < 3 * wanted + 6:
        job.clear_stops(output_dir)
        left = 1 - last_step(output_dir) / max(total_steps, 1)
        window = 0.9 * ref_seconds * (0.3 + 0.7 * left)  # the time this launch likely has
        earliest = min(scenario.earliest * ref_seconds, window / 2)
        delay = rng.uniform(earliest, window) if stops < wanted else None
        launch = run_launch(argv, scenario, delay, rng, timeout)
        if os.path.isdir(output_dir):
            launch["stops"] = job.stops(output_dir)
        launches.append(launch)
        codes = launch["codes"]
        if launch["signalled"] is not None:
            stops += 1
        if all(code == 0 for code in codes):
            final = job.load_final(output_dir)
            result = (
                "exact" if final is not None and job.same_state(reference, final) else "differed"
            )
            break
        if crashed(launch, scenario.world_size):
            crashes_in_a_row += 1
            if crashes_in_a_row >= 2:
                break
        else:
            crashes_in_a_row = 0
    return {"result": result, "stops": stops, "launches": launches}


def run_scenario(
    scenario: Scenario, work: str, rng: random.Random, timeout: float, scale: float
) -> list[dict[str, Any]]:
    """The reference run, then campaigns until the scenario's stops are reached."""
    ref_dir = os.path.join(work, scenario.name, "reference")
    began = time.monotonic()
    ref_launch = run_launch(job_argv(scenario, ref_dir), scenario, None, rng, timeout)
    ref_seconds = time.monotonic() - began
    reference = job.load_final(ref_dir)
    if reference is None:
        raise RuntimeError(f"{scenario.name}: the uninterrupted run failed: {ref_launch}")
    total = last_step(ref_dir)
    wanted, done, records, index = max(1, round(scenario.stops * scale)), 0, [], 0
    while done < wanted:
        out = os.path.join(work, scenario.name, f"campaign-{index}")
        outcome = campaign(
            scenario, reference, ref_seconds, total, out, wanted - done, rng, timeout
        )
        done += outcome["stops"]
        index += 1
        record = {
            "scenario": scenario.name,
            **{k: v for k, v in asdict(scenario).items() if k not in ("name", "stops")},
            "signal": signal.Signals(scenario.signum).name,
            "reference_seconds": round(ref_seconds, 3),
            "total_steps": total,
            **outcome,
        }
        record.pop("signum")
        records.append(record)
        print(
            f"{scenario.name}: campaign {index}: {outcome['result']} after "
            f"{outcome['stops']} stops, {len(outcome['launches'])} launches",
            flush=True,
        )
        if index >= 2 * wanted + 2:
            break  # runs that end before their signals: reported with the stops they had
    return records


def table(records: list[dict[str, Any]]) -> str:
    """The results as a Markdown table, one row per scenario (and epoch count): how each
    signal ended its launch, how the campaigns ended, and whether DDP ranks agreed."""
    rows: dict[tuple[str, float], dict[str, Any]] = {}
    for record in records:
        key = (record["scenario"], record.get("epochs", 3))
        row = rows.setdefault(key, {"record": record, "campaigns": [], "launches": []})
        row["campaigns"].append(record["result"])
        row["launches"] += [x for x in record["launches"] if x["signalled"] is not None]
    lines = [
        "| scenario | trainer | signal | ranks | signals | stopped, exit 3 | died of it "
        "(before train) | run ended first | killed | crashed or hung | campaigns: exact / "
        "differed / failed | DDP: same step |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (name, epochs), row in rows.items():
        record, launches = row["record"], row["launches"]

        def count(test, launches=launches) -> int:
            return sum(1 for x in launches if test(x))

        world = record["world_size"]
        crashed = count(lambda x, w=world: x["hung"] or crashed_alone(x, w))
        both = [x for x in launches if len(x.get("stops", [])) == record["world_size"] > 1]
        same = sum(1 for x in both if len({s["stopped_at"] for s in x["stops"]}) == 1)
        results = row["campaigns"]
        lines.append(
            f"| {name}{'' if epochs == 3 else f' ({epochs:g} epochs)'} | {record['trainer']} | "
            f"{record['signal']} | {record['world_size']} | {len(launches)} | "
            f"{count(lambda x: EXIT_PREEMPTED in x['codes'])} | "
            f"{count(lambda x: -signal.SIGTERM in x['codes'])} | "
            f"{count(lambda x: set(x['codes']) == {0})} | "
            f"{count(lambda x: -signal.SIGKILL in x['codes'] and not x['hung'])} | {crashed} | "
            f"{results.count('exact')} / {results.count('differed')} / "
            f"{results.count('failed')} | "
            f"{f'{same} of {len(both)}' if record['world_size'] > 1 else ''} |"
        )
    moments: dict[str, int] = {}
    for row in rows.values():
        for launch in row["launches"]:
            caught = [stop["moment"] for stop in launch.get("stops", []) if stop["moment"]]
            for what in caught[:1]:  # the rank the signal reached
                moments[what] = moments.get(what, 0) + 1
    caught = ", ".join(f"{what} {n}" for what, n in sorted(moments.items(), key=lambda m: -m[1]))
    lines.append(f"\nWhat the jobs were doing when a caught signal came: {caught}.")
    return "\n".join(lines)


def crashed_alone(launch: dict[str, Any], world_size: int) -> bool:
    """A rank ended with status 1 where no signal explains it."""
    killed = any(code in (-signal.SIGTERM, -signal.SIGKILL) for code in launch["codes"])
    return 1 in launch["codes"] and not (world_size > 1 and killed)


def agreement_cost(rounds: int, work: str) -> dict[str, list[float]]:
    """``train_runtime`` of the 2-rank DDP job (AdamW, 12 epochs, no saves or evaluation)
    with the preemption handler on and off, alternated ``rounds`` times: what combining
    the ranks' flag at each step costs."""
    runtimes: dict[str, list[float]] = {"on": [], "off": []}
    for index in range(rounds):
        for mode in runtimes:
            out = os.path.join(work, f"cost-{mode}-{index}")
            argv = ["--output_dir", out, "--config", "adamw", "--epochs", "12"]
            argv += ["--save_steps", "100000", "--eval_steps", "100000"]
            argv += ["--signals", "SIGTERM" if mode == "on" else ""]
            for process in job.run_ranks(argv, 2, free_port()):
                process.join()
            with open(os.path.join(out, "job-0.log")) as f:
                found = re.search(r"'train_runtime': '([0-9.]+)'", f.read())
            runtimes[mode].append(float(found.group(1)))
    return runtimes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The chaos run's flags."""
    parser.add_argument(
        "--scenarios", default="all", help="comma-separated scenario names, or 'all'"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="a quarter of the stops")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per launch")
    parser.add_argument("--results", default=str(RESULTS))
    parser.add_argument("--workdir", default=None, help="kept when given (default: a temp dir)")
    parser.add_argument(
        "--table", action="store_true", help="print the results file as a table, run nothing"
    )
    parser.add_argument(
        "--agreement_cost",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="only time the 2-rank DDP job with the handler on and off, ROUNDS times each",
    )


def run(args: argparse.Namespace) -> None:
    """Runs the scenarios and appends one JSON line per campaign to ``args.results``
    (with ``--table``, prints the results file's table instead)."""
    if args.table:
        with open(args.results) as f:
            print(table([json.loads(line) for line in f if line.strip()]))
        return
    chosen = (
        SCENARIOS
        if args.scenarios == "all"
        else [s for s in SCENARIOS if s.name in args.scenarios.split(",")]
    )
    if not chosen:
        names = ", ".join(s.name for s in SCENARIOS)
        raise SystemExit(f"chaos: --scenarios {args.scenarios!r}: choose from {names}")
    rng = random.Random(args.seed)
    work = args.workdir or tempfile.mkdtemp(prefix="chaos-")
    if args.agreement_cost:
        runtimes = agreement_cost(args.agreement_cost, work)
        for mode, values in runtimes.items():
            print(f"handler {mode}: median {statistics.median(values):.3f} s of {values}")
        return
    os.makedirs(os.path.dirname(args.results), exist_ok=True)
    try:
        for scenario in chosen:
            for record in run_scenario(
                scenario, work, rng, args.timeout, 0.25 if args.smoke else 1.0
            ):
                record["smoke"] = args.smoke
                with open(args.results, "a") as f:
                    f.write(json.dumps(record) + "\n")
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
