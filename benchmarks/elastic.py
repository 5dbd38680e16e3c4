"""Memory-elastic micro-batch under a memory budget, and against ``auto_find_batch_size``.

The CIFAR ResNet-18 under a per-process budget that ``--effective-batch`` exceeds: the
controller sizing the micro-batch, then shrinking and growing around a competing
allocation; then ``transformers.Trainer(auto_find_batch_size=True)`` against
``TriAccelTrainer(elastic_batch=True)``, and the latter against ``TriAccelTrainer`` with
the micro-batch and accumulation it ended with, without elasticity (``--parts`` picks).
README.md: what each part records. The acceptance checks of the controller are tests
(tests/memory/test_elastic_acceptance.py).

Usage:
    python -m benchmarks elastic --out "$OUT"    # --budget-gib 3 --effective-batch 4096
    python -m benchmarks elastic --parts elastic_batch,fixed_micro_batch --steps 60
    python -m benchmarks elastic --smoke --out /tmp/be   # CPU, a fake device
"""

import statistics
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Trainer, TrainingArguments

from benchmarks import harness
from hf_triaccel.data.images import ImageTensors
from hf_triaccel.integrations.layout import to_channels_last
from hf_triaccel.integrations.trainer import TriAccelArguments, TriAccelTrainer
from hf_triaccel.integrations.trainer_data import DeviceImageDataLoader
from hf_triaccel.memory import CudaMemoryProbe, ElasticBatchController
from hf_triaccel.testing import FakeMemoryDevice, SampleLedger

NAME = "elastic"
HELP = "the memory-elastic micro-batch under a budget, against auto_find_batch_size"

SIZING_STEPS = 10  # steps before the competing allocation; the probe decides in step 0
TRAINER_MODES = ("auto_find_batch_size", "elastic_batch", "fixed_micro_batch")
PARTS = ("controller", *TRAINER_MODES)
STEPS_AFTER_GROW = 3  # steps run at the grown size, to show that it fits


class Budget:
    """This process's memory capped at ``nbytes`` (``set_per_process_memory_fraction``), and
    a competing allocation in it; ``fake``: a :class:`FakeMemoryDevice`, a quarter of the
    budget fixed and half the effective batch peaking at 88% of it."""

    def __init__(self, device: torch.device, nbytes: int, effective_batch: int, fake: bool):
        self.device, self.fake, self.taken, self.total = device, fake, 0, None
        self._tensor: torch.Tensor | None = None
        self.budget = nbytes
        if fake:
            slope = (0.88 * nbytes - nbytes // 4) / max(1, effective_batch // 2)
            self.probe: Any = FakeMemoryDevice(nbytes, nbytes // 4, slope)
            return
        self.total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(nbytes / self.total, device)
        # the budget as the controller's probe reads it back
        self.budget = int(torch.cuda.get_per_process_memory_fraction(device) * self.total)
        self.probe = CudaMemoryProbe(device)

    def attach(self, model: nn.Module) -> None:
        """Charges the model's forwards to the fake device (CUDA's allocator needs nothing)."""
        if self.fake:
            self.probe.attach(model)

    def take_half_free(self) -> int:
        """Allocates half of the budget that live tensors leave (cached blocks count as
        free: the allocator hands them back before failing). Returns the bytes taken."""
        if self.fake:
            self.taken = int(self.budget - self.probe.base) // 2
            self.probe.base += self.taken
        else:
            self.taken = (self.budget - torch.cuda.memory_allocated(self.device)) // 2
            self._tensor = torch.empty(self.taken, dtype=torch.uint8, device=self.device)
        return self.taken

    def give_back(self) -> None:
        """Frees the competing allocation."""
        if self.fake:
            self.probe.base -= self.taken
        self._tensor, self.taken = None, 0


def controller_run(budget: Budget, data: ImageTensors, args: Any) -> dict[str, Any]:
    """Sizing, then a competing allocation held and freed, in one training run: the
    controller's settings, the schedule, one record per step, the events, the summary."""
    E, device = args.effective_batch, args.device
    model = harness.build_model(size=args.size).to(device)
    to_channels_last(model)  # the layout TriAccelTrainer trains it in
    budget.attach(model)
    opt = harness.make_optimizer("adamw", model)
    controller = ElasticBatchController(E, probe=budget.probe, grow_after=args.grow_after)
    take_at, release_at = SIZING_STEPS, SIZING_STEPS + 2 * controller.check_every
    # the last shrink comes by release_at; grow_after stable steps later, a check grows
    last = release_at + controller.grow_after + 2 * controller.check_every
    ledger, ids = SampleLedger(), torch.arange(E)  # ids on the CPU: read back with no sync
    batches = harness.endless(harness.image_batches(data, E, channels_last=True))

    def loss_fn(piece: dict[str, torch.Tensor]) -> torch.Tensor:
        ledger.add(piece["index"])
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = model(piece["pixel_values"])
        return F.cross_entropy(logits.float(), piece["labels"])

    def step(batch: dict[str, torch.Tensor]) -> None:
        budget.probe.reset_peak()
        controller.run_step(batch, loss_fn, model=model, rollbacks=[ledger])
        opt.step()
        opt.zero_grad(set_to_none=True)

    steps, error, stop, fit, competitor = [], None, last, {}, 0
    try:
        for k in range(last):
            if k >= stop:
                break
            if k == take_at:
                competitor = budget.take_half_free()
            elif k == release_at:
                budget.give_back()
            images, labels = next(batches)
            batch = {"pixel_values": images, "labels": labels, "index": ids}
            n_events = len(controller.events)
            ms = harness.wall_ms(lambda batch=batch: step(batch), device)
            pieces, kept, m = ledger.pieces[-1], ledger.steps[-1], max(ledger.pieces[-1])
            phase = "sizing" if k < take_at else "competing" if k < release_at else "freed"
            record = dict(step=k, phase=phase, micro_batch=m, accumulation=len(pieces), step_ms=ms)
            record.update(pieces=list(pieces), samples=len(kept), reruns=ledger.reruns[-1])
            # each sample id once implies samples == the effective batch
            record["each_sample_once"] = sorted(kept) == ids.tolist()
            record["peak_fraction"] = budget.probe.peak() / budget.budget
            predicted = controller.predicted_peak(m)
            record["predicted_fraction"] = predicted and predicted / budget.budget
            record["events"] = [asdict(e) for e in controller.events[n_events:]]
            steps.append(record)
            if k == take_at - 1:  # the memory model the sizing settled with
                fit = {"slope": controller.sizing.slope, "base": controller.sizing.base}
            if k >= release_at and any(e["reason"] == "grow" for e in steps[-1]["events"]):
                stop = k + 1 + STEPS_AFTER_GROW
    except Exception as exc:  # the records so far still go to the report
        error = harness.report_error(exc)
    finally:
        budget.give_back()
    events = [asdict(e) for e in controller.events]
    names = ("min_micro_batch", "max_micro_batch", "target_fraction", "check_every", "grow_after")
    return {
        "controller": {name: getattr(controller, name) for name in names},
        "schedule": {"competitor_at": take_at, "release_at": release_at, "max_steps": last},
        "competitor_bytes": competitor,
        "steps": steps,
        "events": events,
        "error": error,
        "summary": summarize(steps, events, fit),
    }


def summarize(steps: list, events: list, fit: dict) -> dict:
    """The figures BENCHMARKS.md reports from the controller run: steps to settle, the
    settled size and its peak; the shrink and grow steps and sizes; exactness."""
    settle = max((e["step"] for e in events if e["step"] < SIZING_STEPS), default=-1) + 1
    settled = [s for s in steps if settle <= s["step"] < SIZING_STEPS]
    phases = {s["step"]: s["phase"] for s in steps}
    shrinks = [e for e in events if phases.get(e["step"]) == "competing" and e["new"] < e["old"]]
    grows = [e for e in events if phases.get(e["step"]) == "freed" and e["reason"] == "grow"]
    first = settled[0] if settled else {}
    out = {"steps_to_settle": settle, "micro_batch": first.get("micro_batch")}
    out["accumulation"] = first.get("accumulation")
    out["peak_fraction"] = statistics.median([s["peak_fraction"] for s in settled] or [None])
    out.update(
        shrink_steps=[e["step"] for e in shrinks], shrink_reasons=[e["reason"] for e in shrinks]
    )
    held = [s["micro_batch"] for s in steps if s["phase"] == "competing"]
    out.update(micro_batch_held=min(held, default=None), grow_steps=[e["step"] for e in grows])
    out["micro_batch_grown"] = grows[-1]["new"] if grows else None
    out["reruns"] = sum(s["reruns"] for s in steps)
    out["every_step_exact"] = all(s["each_sample_once"] for s in steps)
    # the memory model the sizing settled with: base + slope * micro-batch bytes
    out.update(slope_bytes_per_sample=fit.get("slope"), base_bytes=fit.get("base"))
    return out


# -- auto_find_batch_size against the elastic trainer -----------------------------------------


class DeviceDataTrainer(Trainer):
    """``transformers.Trainer`` fed as ``TriAccelTrainer`` feeds an ``ImageTensors`` (batches
    built on the device, of the current attempt's size, channels-last as the model), with
    the cross-entropy that ``TriAccelTrainer`` computes for a plain module."""

    def get_train_dataloader(self) -> DeviceImageDataLoader:
        kwargs = dict(device=self.args.device, seed=self.args.seed, augment=True, drop_last=True)
        kwargs["channels_last"] = True
        return DeviceImageDataLoader(self.train_dataset, self._train_batch_size, **kwargs)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        logits = model(inputs["pixel_values"])
        loss = F.cross_entropy(logits.float(), inputs["labels"])
        return (loss, {"logits": logits}) if return_outputs else loss


def trainer_run(
    mode: str, budget: Budget, data: ImageTensors, args: Any, fixed: tuple[int, int] = (0, 1)
) -> dict[str, Any]:
    """Trains ``--steps`` optimizer steps with one Trainer (``mode``: one of
    :data:`TRAINER_MODES`; ``fixed_micro_batch`` runs ``fixed``: micro-batch and
    accumulation, without elasticity); returns its row."""
    auto, device = mode == "auto_find_batch_size", args.device
    batch, accumulation = fixed if mode == "fixed_micro_batch" else (args.effective_batch, 1)
    row = {"trainer": "transformers.Trainer" if auto else "TriAccelTrainer", "mode": mode}
    row.update(per_device_batch=batch, status="ok", note=None)
    # what the controller run left allocated would shrink this run's room
    row["allocated_at_start_bytes"] = torch.cuda.memory_allocated(device) if budget.total else None
    model = trainer = controller = None
    with harness.variant(row):
        model = harness.build_model(size=args.size)
        to_channels_last(model)  # TriAccelTrainer would; the stock Trainer gets it so too
        budget.attach(model)
        common = dict(per_device_train_batch_size=batch, max_steps=args.steps)
        common["gradient_accumulation_steps"] = accumulation
        common.update(learning_rate=harness.LR, weight_decay=harness.WEIGHT_DECAY, seed=0)
        common.update(optim="adamw_torch_fused", bf16=True, logging_strategy="no")
        # on in transformers, off in TriAccelArguments: the same for both here
        common.update(logging_nan_inf_filter=False, dataloader_drop_last=True)
        # the steady pace is taken after the first step, without start-up and search
        clock = harness.StepClock(device, warmup=1, steps=args.steps - 1, every_step=True)
        cls = (TriAccelTrainer, TriAccelArguments)
        if auto:
            cls, common["auto_find_batch_size"] = (DeviceDataTrainer, TrainingArguments), True
        elif mode == "elastic_batch":
            common["elastic_batch"] = True

        def read_budget(trainer: Trainer) -> None:  # the fake device on a CPU
            if getattr(trainer, "elastic", None) is not None:
                trainer.elastic.controller.probe = budget.probe
                clock.record = trainer.elastic.controller.metrics

        trainer = harness.train(*cls, model, data, clock, read_budget, **common)
        elastic = getattr(trainer, "elastic", None)  # the stock Trainer has none
        controller = elastic.controller if elastic is not None else None
        batch, ends = clock.attempts[-1], clock.ends  # the samples of an optimizer step
        last = (clock.records or [{"micro_batch": batch, "accumulation": accumulation}])[-1]
        row.update(attempt_batches=clock.attempts, oom_restarts=len(clock.attempts) - 1)
        row.update(samples_per_step=batch * accumulation, steps=len(ends), step_end_s=ends)
        row.update(last)
        row.update(first_step_s=ends[0] if ends else None, total_s=ends[-1] if ends else None)
        row["samples_per_s"] = (clock.window or {}).get("timed_samples_per_second")
        row["step_sizes"] = clock.records
        row["events"] = [asdict(e) for e in controller.events] if controller else []
        if len(ends) != args.steps:
            row["status"], row["note"] = "fail", f"{len(ends)} steps of {args.steps}"
    model = trainer = controller = elastic = None
    harness.free_memory(device)
    return row


def report(run: dict[str, Any] | None, rows: list[dict[str, Any]], steps: int) -> str:
    """The controller run's summary (when it ran) and the trainers, as markdown (every
    step is in the JSON record)."""
    fmt, lines = harness.fmt, []
    if run is not None:
        lines = controller_lines(run)
    trainers = {
        "trainer": lambda r: f"{r['trainer']} ({r['mode']})",
        "samples / optimizer step": lambda r: r.get("samples_per_step", "n/a"),
        "micro-batch x accumulation": lambda r: f"{r.get('micro_batch')} x {r.get('accumulation')}",
        "OOM restarts": lambda r: r.get("oom_restarts", "n/a"),
        "first step s": lambda r: fmt(r.get("first_step_s"), ".2f"),
        f"{steps} steps s": lambda r: fmt(r.get("total_s"), ".2f"),
        "samples/s after step 1": lambda r: fmt(r.get("samples_per_s"), ".0f"),
        "x fixed micro-batch": lambda r: fmt(r.get("vs_fixed"), ".3f", "x"),
        "note": harness.note,
    }
    return "\n\n".join([*lines, harness.table(rows, trainers)])


def controller_lines(run: dict[str, Any]) -> list[str]:
    """The controller run's summary, in a line (after its error, if it stopped)."""
    sz, fmt = run["summary"], harness.fmt
    lines = [f"controller run stopped: {run['error']}"] if run["error"] else []
    lines.append(
        f"sizing: {sz.get('micro_batch')} x {sz.get('accumulation')} after "
        f"{sz.get('steps_to_settle')} step(s), peak {fmt(sz.get('peak_fraction'), '.1%')} of "
        f"the budget; shrink at steps "
        f"{sz.get('shrink_steps')} {sz.get('shrink_reasons')} to {sz.get('micro_batch_held')}; "
        f"grow at steps {sz.get('grow_steps')} to {sz.get('micro_batch_grown')}; "
        f"{sz.get('reruns')} re-run(s); each sample once in every step: "
        f"{'yes' if sz.get('every_step_exact') else 'NO'}"
    )
    return lines


def trainer_rows(parts: Sequence[str], budget: Budget, data: ImageTensors, args: Any) -> list:
    """The rows of the Trainer ``parts``, in :data:`TRAINER_MODES` order: the fixed
    micro-batch runs the micro-batch and accumulation the elastic run ended with."""
    rows: list[dict[str, Any]] = []
    for mode in (m for m in TRAINER_MODES if m in parts):
        if mode == "fixed_micro_batch":
            elastic = next(r for r in rows if r["mode"] == "elastic_batch")
            if elastic["status"] != "ok":
                row = {"trainer": "TriAccelTrainer", "mode": mode, "status": "skipped"}
                rows.append({**row, "note": "the elastic run failed: no micro-batch to fix"})
                continue
            fixed = (elastic["micro_batch"], elastic["accumulation"])
            rows.append(trainer_run(mode, budget, data, args, fixed=fixed))
        else:
            rows.append(trainer_run(mode, budget, data, args))
    # elasticity's cost: samples/s against the same micro-batch without the controller
    harness.add_ratio(rows, "samples_per_s", "vs_fixed", lambda r: r["mode"] == TRAINER_MODES[2])
    return rows


def add_arguments(parser: Any) -> None:
    """The measurement's options."""
    options = {
        "budget_gib": (float, 1.0, 3.0, "memory cap of this process"),
        "effective_batch": (int, 32, 4096, "samples per step"),
        "steps": (int, 3, 20, "optimizer steps of each Trainer"),
        "grow_after": (int, 10, 100, "the controller's stable steps before it grows"),
    }
    harness.add_common(parser, options, impls=False)
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {PARTS}")


def run(args: Any) -> int:
    """Runs the ``--parts``; returns 1 when one raised."""
    harness.resolve(args)
    args.parts = harness.split(args.parts, PARTS, "--parts")
    if "fixed_micro_batch" in args.parts and "elastic_batch" not in args.parts:
        raise SystemExit("error: --parts: fixed_micro_batch runs the size elastic_batch ends with")
    if args.device.type == "cuda" and args.device.index is None:  # memory fractions need one
        args.device = torch.device("cuda", torch.cuda.current_device())
    E, fake = args.effective_batch, args.device.type != "cuda"
    budget = Budget(args.device, int(args.budget_gib * harness.GIB), E, fake)
    data = harness.load_images("embedded", "train", smoke=args.smoke, n=2 * E).to(args.device)
    controlled = None
    if "controller" in args.parts:
        try:
            controlled = controller_run(budget, data, args)
        except Exception as exc:  # set-up failed: no step ran
            error = harness.report_error(exc)
            controlled = {"steps": [], "events": [], "error": error, "summary": {}}
            controlled["schedule"] = {"competitor_at": SIZING_STEPS}
        harness.free_memory(args.device)
    rows = trainer_rows(args.parts, budget, data, args)
    kind = "fake device" if fake else "CUDA budget"
    print(f"resnet18_cifar ({args.size}), effective batch {E}, {kind} of {budget.budget} bytes")
    config = {"memory": kind, "budget_bytes": budget.budget, "device_total_bytes": budget.total}
    config.update(autocast="bfloat16", optimizer="AdamW(fused)", lr=harness.LR)
    config["layout"] = "channels_last"  # model and batches, in every part
    config.update(weight_decay=harness.WEIGHT_DECAY, cudnn_benchmark=torch.backends.cudnn.benchmark)
    payload = {"config": config, "controller_run": controlled, "trainers": rows}
    harness.finish("elastic", args, payload, report(controlled, rows, args.steps))
    failed = (controlled and controlled["error"]) or any(r["status"] != "ok" for r in rows)
    return 1 if failed else 0
