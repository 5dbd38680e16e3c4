"""What a Trainer step costs beyond a hand-written loop's: torch.profiler over the timed
steps of ``bench_trainer.py``'s variants (the hand-written AdamW(fused) loop,
``TriAccelTrainer`` with AdamW(fused), with AdaFisherW), the same model, data, batch,
clipping, schedule and layout.

Three tables, per training step (means over ``--steps`` profiled steps, after
``--warmup`` steps):

- **ranges**: calls, host milliseconds (the time in the range, its children included)
  and the device milliseconds of the kernels it launched, for what both runners do
  (``backward``, ``clip_grad_norm``, the optimizer's ``step`` and ``zero_grad``, the
  learning-rate ``scheduler``) and what only the Trainer does (``training_step`` and the
  ``compute_loss`` inside it, ``get_batch_samples``, which fetches the batch,
  ``callbacks``, ``log, save, evaluate``);
- **totals**: the step's wall time (the timed window of the run, profiler on), the
  device's busy time, kernel launches, host synchronisations, ``cudaMalloc`` calls and
  ``aten`` operators;
- **what the Trainer adds**: the operators whose host time per step grows most from the
  loop to the Trainer with AdamW(fused), with their calls.

Usage:
    python benchmarks/profile_trainer.py --data /path/to/cifar10 --out "$OUT"
    python benchmarks/profile_trainer.py --smoke --out /tmp/profile    # CPU, seconds
"""

from __future__ import annotations

import contextlib
import functools
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import bench_trainer as bench
import harness
import profile_refresh
import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function
from transformers.trainer_callback import CallbackHandler

from hf_triaccel.integrations.trainer import TriAccelTrainer

OPTIONS = {
    "batch_size": bench.OPTIONS["batch_size"],
    "warmup": (int, 2, 20, "untimed steps, >= 1"),
    "steps": (int, 3, 10, "profiled steps"),
    "top": (int, 8, 15, "rows of the 'what the Trainer adds' table"),
}
LOOP, TRAINER = "loop_adamw_fused", "trainer_adamw_fused"
VARIANTS = (LOOP, TRAINER, "trainer_adafisherw")
SHARED = ("backward", "clip_grad_norm", "optimizer step", "zero_grad", "scheduler")
TRAINER_ONLY = ("training_step", "compute_loss", "get_batch_samples", "callbacks")
LOGGING = "log, save, evaluate"
RANGES = SHARED + TRAINER_ONLY + (LOGGING,)
# methods put in a profiler range while profiling: (owner, attribute, range)
LABELLED = (
    (torch.Tensor, "backward", "backward"),
    (torch.nn.utils, "clip_grad_norm_", "clip_grad_norm"),
    # the Trainer's: Accelerate 1.16 clips without torch's clip_grad_norm_
    (Accelerator, "clip_grad_norm_", "clip_grad_norm"),
    (torch.optim.lr_scheduler.LRScheduler, "step", "scheduler"),
    (AcceleratedOptimizer, "step", "optimizer step"),
    (AcceleratedOptimizer, "zero_grad", "zero_grad"),
    (torch.nn.Module, "zero_grad", "zero_grad"),
    # on the subclass: whichever class defines them, TriAccelTrainer's calls are labelled
    (TriAccelTrainer, "training_step", "training_step"),
    (TriAccelTrainer, "compute_loss", "compute_loss"),
    (TriAccelTrainer, "get_batch_samples", "get_batch_samples"),
    (TriAccelTrainer, "_maybe_log_save_evaluate", LOGGING),
    (CallbackHandler, "call_event", "callbacks"),
)


@contextlib.contextmanager
def labelled() -> Iterator[None]:
    """Puts the methods of :data:`LABELLED` in profiler ranges (the loop's optimizer,
    a torch optimizer, is labelled by torch itself: ``Optimizer.step#AdamW.step``)."""
    saved = [(owner, attr, owner.__dict__.get(attr)) for owner, attr, _ in LABELLED]
    running: set[str] = set()  # a labelled call inside one of the same label counts once

    def wrap(method: Callable, label: str) -> Callable:
        @functools.wraps(method)
        def call(*args: Any, **kwargs: Any) -> Any:
            if label in running:
                return method(*args, **kwargs)
            running.add(label)
            try:
                with record_function(label):
                    return method(*args, **kwargs)
            finally:
                running.discard(label)

        return call

    for owner, attr, label in LABELLED:
        setattr(owner, attr, wrap(getattr(owner, attr), label))
    try:
        yield
    finally:
        for owner, attr, method in saved:
            if method is None:  # inherited: drop the wrapper, the base's shows again
                delattr(owner, attr)
            else:
                setattr(owner, attr, method)


def range_of(name: str) -> str | None:
    """The range an event counts in: a labelled one, or torch's own optimizer ranges."""
    if name in RANGES:
        return name
    if name.startswith("Optimizer.step#"):
        return "optimizer step"
    if name.startswith("Optimizer.zero_grad#"):
        return "zero_grad"
    return None


def per_step(events: Sequence[Any], steps: int, cuda: bool) -> dict[str, Any]:
    """The profile of ``steps`` steps, per step: each range's calls, host ms and device
    ms (an optimizer labelled both by torch and by its wrapper counts once: the outer),
    the totals and the host time per operator."""
    ranges: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    cpu = sorted(
        (e for e in events if e.device_type == DeviceType.CPU),
        key=lambda e: e.time_range.start,
    )
    open_until: dict[str, float] = {}
    for e in cpu:
        label = range_of(e.name)
        if label is None or e.time_range.start < open_until.get(label, -1.0):
            continue  # nested in a range of the same label
        open_until[label] = e.time_range.end
        entry = ranges[label]
        entry[0] += 1
        entry[1] += e.cpu_time_total / 1e3
        entry[2] += e.device_time_total / 1e3 if cuda else 0.0
    by_op: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in cpu:
        if e.name.startswith("aten::") or e.name.startswith("cuda"):
            entry = by_op[e.name]
            entry[0] += 1
            entry[1] += e.self_cpu_time_total / 1e3
    return {
        "ranges": {k: [v[0] / steps, v[1] / steps, v[2] / steps] for k, v in ranges.items()},
        **profile_refresh.totals(events, steps, cuda),
        "by_op": {k: [v[0] / steps, v[1] / steps] for k, v in by_op.items()},
    }


def profile_variant(name: str, data: Any, args: Any) -> dict[str, Any]:
    """One variant, profiled over its timed steps (the clock starts the profiler at the
    end of the warm-up and stops it at the end of the window)."""
    cuda = args.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda
    prof = profile(activities=activities)
    edges = iter((args.warmup, args.warmup + args.steps))
    count = [0]
    edge = [next(edges)]

    def record() -> None:  # at each step end, the device synchronised at the edges
        count[0] += 1
        if count[0] != edge[0]:
            return
        if count[0] == args.warmup:
            prof.start()
            edge[0] = next(edges)
        else:
            prof.stop()

    run = bench.run_loop if bench.VARIANTS[name][1] is None else bench.run_trainer
    with labelled():
        result = run(name, data, args.device, args, record=record)
    clock = result["clock"]
    if clock.window is None:
        raise RuntimeError(f"{name}: training stopped after {clock.count} steps")
    out = per_step(prof.events(), args.steps, cuda)
    out["wall_ms"] = 1e3 * clock.window["timed_runtime"] / args.steps
    harness.free_memory(args.device)
    return out


def tables(results: dict[str, dict[str, Any]], top: int, cuda: bool) -> str:
    """The three tables (see the module doc), as Markdown."""
    unit = "calls / host ms / device ms" if cuda else "calls / host ms"
    cell = profile_refresh.range_cell
    ranges = harness.table(
        [{"range": label} for label in RANGES],
        {"range (per step)": lambda r: r["range"]}
        | {f"{name}: {unit}": (lambda r, n=name: cell(results[n]["ranges"].get(r["range"]), cuda))
           for name in results},
    )  # fmt: skip
    added = harness.table(
        profile_refresh.growth(results[TRAINER]["by_op"], results[LOOP]["by_op"], top),
        {
            "operator (self host time)": lambda r: profile_refresh.short(r["name"]),
            "calls added per step": lambda r: f"{r['calls']:g}",
            "host ms added per step": lambda r: harness.fmt(r["ms"]),
        },
    )
    totals = profile_refresh.totals_table(results, cuda)
    return (
        f"Ranges\n\n{ranges}\n\nTotals per step\n\n{totals}\n\n"
        f"What the Trainer adds ({TRAINER} less {LOOP})\n\n{added}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Profiles the variants and writes the tables (``profile_trainer.json/.md``)."""
    parser = bench.parser_for(__doc__.split("\n\n")[0], OPTIONS, VARIANTS)
    args, data, world = bench.parse_and_load(parser, argv)
    if world > 1:
        parser.error("profile_trainer.py runs on one process")
    if {LOOP, TRAINER} - set(args.variants) or any(map(bench.compiled, args.variants)):
        parser.error(f"--variants: eager ones, {LOOP} and {TRAINER} among them")
    cuda = args.device.type == "cuda"
    results = {name: profile_variant(name, data, args) for name in args.variants}
    header = (
        f"{bench.MODEL} ({args.size}), per-device batch {args.batch_size}, "
        f"{'bf16 autocast' if args.bf16 else 'fp32'}, layout {args.layout}, clipping at "
        f"{args.max_grad_norm}, a log every {args.logging_steps} steps; {args.steps} profiled "
        f"steps after {args.warmup} warm-up steps\n\n"
    )
    payload = {"results": results}
    harness.finish(
        "profile_trainer", __file__, args, payload, header + tables(results, args.top, cuda)
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
