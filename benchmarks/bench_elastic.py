"""Memory-elastic micro-batch under a memory budget, and against ``auto_find_batch_size``.

The CIFAR-stem ResNet-18 (``resnet18_cifar``) trains under bf16 autocast with
AdamW(fused) while ``torch.cuda.set_per_process_memory_fraction`` caps this process
at ``--budget-gib``, so that the effective batch (``--effective-batch``) does not fit
at once and must be split. Three parts:

- sizing: an :class:`~hf_triaccel.memory.elastic.ElasticBatchController` with its
  default settings sizes the micro-batch from its probe pieces. Per step: micro-batch,
  accumulation, samples run, peak memory (``torch.cuda.max_memory_allocated``, reset at
  the start of each step) as a share of the budget, and the controller's events.
  Passes when the size stops changing within 3 steps and the settled steps' peak is
  85-95% of the budget.
- shrink and grow: in the same run, a tensor allocated in the same process takes half
  the budget not allocated (cached blocks count as free) for 2 x ``check_every``
  steps, then is freed. Passes when no step fails, every step runs exactly its
  effective batch (each sample once: sample ids are checked), the controller shrinks
  while the tensor is held and grows back after its ``grow_after`` stable steps.
- ``auto_find_batch_size``: ``transformers.Trainer(auto_find_batch_size=True)`` and
  ``TriAccelTrainer(elastic_batch=True)``, both asked for a per-device batch of the
  effective batch, same data, model, optimizer and budget: wall time from ``train()``
  to the first optimizer step and to the ``--steps``-th (the device synchronised in a
  callback at each step end). ``auto_find_batch_size`` multiplies the batch by 0.9 on
  each out-of-memory error and restarts training, and then trains with that smaller
  batch: its optimizer steps see fewer samples. The elastic trainer keeps the
  effective batch and accumulates over micro-batches.

``--smoke`` runs all three on the CPU with a tiny model and a simulated device (a
linear memory model that raises out-of-memory errors past the budget), in seconds:
it checks the script end to end, not the controller's GPU behaviour.

Usage:
    python benchmarks/bench_elastic.py --out "$OUT"    # --budget-gib 3 --effective-batch 4096
    python benchmarks/bench_elastic.py --smoke --out /tmp/be
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import torch
import torch.nn.functional as F
from common import (
    LR,
    WEIGHT_DECAY,
    base_parser,
    environment,
    fmt,
    free_memory,
    markdown_table,
    out_dir,
    report_error,
    resolve_device,
    synchronize,
    write_results,
)
from torch import nn
from torch.utils.data import Dataset
from transformers import Trainer, TrainerCallback, TrainingArguments

from hf_triaccel.data.images import ImageTensors, load_image_dataset
from hf_triaccel.integrations.timm_models import create_cifar_model
from hf_triaccel.integrations.trainer import TriAccelArguments, TriAccelTrainer
from hf_triaccel.memory import CudaMemoryProbe, ElasticBatchController, MemorySnapshot

GIB = 2**30
SIZING_STEPS = 10  # steps before the competing allocation; the probe decides in step 0
STEPS_AFTER_GROW = 3  # steps run at the grown size, to show that it fits
PEAK_RANGE = (0.85, 0.95)  # settled peak as a share of the budget
SETTLE_STEPS = 3  # steps within which the size must stop changing
TINY = {"layers": (1, 1, 1, 1), "channels": (8, 16, 32, 64)}  # smoke model


# -- memory: a real budget on CUDA, a simulated device on the CPU --------------------------


class CudaBudget:
    """This process's CUDA memory capped at a budget, and a competing allocation.

    Args:
        device: the CUDA device.
        budget_bytes: the cap (``set_per_process_memory_fraction`` of the capacity).
    """

    def __init__(self, device: torch.device, budget_bytes: int) -> None:
        self.device = device
        self.total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(budget_bytes / self.total, device)
        # the budget as the controller's probe reads it back
        self.budget = int(torch.cuda.get_per_process_memory_fraction(device) * self.total)
        self.probe = CudaMemoryProbe(device)
        self._competitor: torch.Tensor | None = None

    def attach(self, model: nn.Module) -> None:
        """Nothing to do: the allocator itself raises out-of-memory errors."""

    def take_half_free(self) -> int:
        """Allocates half of the budget that live tensors leave (cached blocks count as
        free: the allocator hands them back before failing). Returns the bytes taken."""
        nbytes = (self.budget - torch.cuda.memory_allocated(self.device)) // 2
        self._competitor = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return nbytes

    def give_back(self) -> None:
        """Frees the competing allocation."""
        self._competitor = None


class SimulatedMemory:
    """A device with a linear memory model, for CPU smoke runs; also its memory probe.

    A forward of ``n`` samples needs ``base + competitor + slope * n`` bytes and raises
    ``torch.OutOfMemoryError`` past the budget, as the CUDA allocator does under
    ``set_per_process_memory_fraction``. As on CUDA, the competing allocation lives in
    this process: it shows in the allocated bytes and the peaks, not in what the
    device can give (the budget).

    Args:
        budget: the cap, in bytes.
        effective_batch: samples per step; the slope is chosen so that half of them
            peak at 88% of the budget, with a quarter of the budget fixed.
    """

    measures = True

    def __init__(self, budget: int, effective_batch: int) -> None:
        self.budget = budget
        self.base = budget // 4
        self.slope = (0.88 * budget - self.base) / max(1, effective_batch // 2)
        self.competitor = 0
        self._peak = self.base
        self._hooks: list[Any] = []

    @property
    def probe(self) -> SimulatedMemory:
        """The probe the controller reads: this object."""
        return self

    def attach(self, model: nn.Module) -> None:
        """Charges every forward of ``model`` to the device (replacing earlier models)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = [model.register_forward_pre_hook(self._forward)]

    def _forward(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        need = self.base + self.competitor + self.slope * args[0].shape[0]
        if need > self.budget:
            raise torch.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate {need - self.budget:.0f} bytes (simulated)"
            )
        self._peak = max(self._peak, int(need))

    def take_half_free(self) -> int:
        """Takes half of the budget that the fixed allocations leave."""
        self.competitor = (self.budget - self.base) // 2
        return self.competitor

    def give_back(self) -> None:
        """Frees the competing allocation."""
        self.competitor = 0

    def snapshot(self) -> MemorySnapshot:
        used = self.base + self.competitor
        return MemorySnapshot(
            free=self.budget - used,
            total=2 * self.budget,
            reserved=used,
            allocated=used,
            budget=self.budget,
        )

    def reset_peak(self) -> None:
        self._peak = self.base + self.competitor

    def peak(self) -> int:
        return self._peak

    def release(self) -> None:
        """Nothing cached to hand back."""


Memory = CudaBudget | SimulatedMemory


# -- data and models -----------------------------------------------------------------------


class DeviceBatches(Dataset):
    """Whole batches of normalised images, gathered on the device.

    ``__getitems__`` returns one ``{"pixel_values", "labels"}`` batch for a list of
    indices, so that the DataLoader of either Trainer (with an identity collator) does
    no per-sample work and both trainers read their data the same way. Indices wrap
    around the images: ``length`` can exceed them, so that ``max_steps`` full batches
    fit in one epoch.

    Args:
        data: decoded images and labels.
        length: the dataset's length.
        device: where batches are built.
    """

    def __init__(self, data: ImageTensors, length: int, device: torch.device) -> None:
        mean, std = data.channel_stats()
        self.images = data.images.to(device)
        self.labels = data.labels.to(device)
        self.mean = torch.tensor(mean, device=device).view(1, 3, 1, 1) * 255
        self.std = torch.tensor(std, device=device).view(1, 3, 1, 1) * 255
        self.length = length

    def __len__(self) -> int:
        return self.length

    def batch(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        """The batch of samples ``indices``, on the device."""
        index = torch.as_tensor(indices, device=self.images.device) % len(self.images)
        images = (self.images[index].float() - self.mean) / self.std
        return {"pixel_values": images, "labels": self.labels[index]}

    def __getitems__(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        return self.batch(indices)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.batch([i])


def whole_batch(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The collator for :class:`DeviceBatches`: the batch is already built."""
    return batch


def load_data(smoke: bool, effective_batch: int) -> ImageTensors:
    """The embedded CIFAR-10 slice; random 16x16 images in smoke runs (no decoding)."""
    if not smoke:
        return load_image_dataset("embedded", "train", progress=False)
    gen = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (2 * effective_batch, 3, 16, 16), generator=gen)
    labels = torch.randint(0, 10, (2 * effective_batch,), generator=gen)
    return ImageTensors(images.to(torch.uint8), labels, [str(c) for c in range(10)])


def make_model(smoke: bool) -> nn.Module:
    """``resnet18_cifar`` (tiny widths, one block per stage, in smoke runs)."""
    torch.manual_seed(0)
    return create_cifar_model("resnet18_cifar", **(TINY if smoke else {}))


class WithLoss(nn.Module):
    """A classifier whose forward returns the loss, as ``transformers.Trainer`` expects of
    a model (TriAccelTrainer computes the same cross-entropy for a plain module)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.model(pixel_values)
        return {"loss": F.cross_entropy(logits.float(), labels), "logits": logits}


# -- parts 1 and 2: the controller in a hand-written loop ------------------------------------


class SampleLedger:
    """Step rollback that records the sample ids and piece sizes of a step's final
    attempt: what a failed attempt ran is forgotten when the controller re-runs it."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.pieces: list[int] = []
        self.reruns = 0

    def save(self) -> None:
        self.ids, self.pieces, self.reruns = [], [], 0

    def restore(self) -> None:
        self.ids, self.pieces = [], []
        self.reruns += 1

    def add(self, ids: torch.Tensor) -> None:
        self.ids += ids.tolist()
        self.pieces.append(len(ids))


def _fraction(nbytes: float | None, budget: int) -> float | None:
    return None if nbytes is None else nbytes / budget


def controller_run(
    memory: Memory, dataset: DeviceBatches, device: torch.device, args: Any
) -> dict[str, Any]:
    """Sizing, then a competing allocation held and freed, in one training run.

    Args:
        memory: the budget, its probe and the competing allocation.
        dataset: the training data.
        device: the training device.
        args: the command-line options.

    Returns:
        ``steps`` (one record per step), ``events``, ``controller`` (its settings),
        ``schedule``, ``sizing`` and ``shrink_grow`` (summaries with ``status`` and
        ``note``), and ``error`` when the run stopped on an exception.
    """
    E = args.effective_batch
    model = make_model(args.smoke).to(device).train()
    memory.attach(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    kwargs = {} if args.grow_after is None else {"grow_after": args.grow_after}
    controller = ElasticBatchController(E, probe=memory.probe, **kwargs)
    take_at = SIZING_STEPS
    release_at = take_at + 2 * controller.check_every
    # the last shrink comes by release_at; grow_after stable steps later, the next check grows
    last = release_at + controller.grow_after + 2 * controller.check_every
    ledger = SampleLedger()
    gen = torch.Generator().manual_seed(0)
    sample_ids = torch.arange(E)  # on the CPU: reading them back costs no device sync

    def loss_fn(piece: dict[str, torch.Tensor]) -> torch.Tensor:
        ledger.add(piece["index"])
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = model(piece["pixel_values"])
        return F.cross_entropy(logits.float(), piece["labels"])

    steps: list[dict[str, Any]] = []
    competitor = 0
    error = None
    stop = last
    fit: tuple[float | None, float | None] = (None, None)  # predicted peaks at 0 and 1 sample
    try:
        for step in range(last):
            if step >= stop:
                break
            if step == take_at:
                competitor = memory.take_half_free()
            elif step == release_at:
                memory.give_back()
            indices = torch.randint(0, len(dataset), (E,), generator=gen).tolist()
            batch = {**dataset.batch(indices), "index": sample_ids}
            n_events = len(controller.events)
            synchronize(device)
            memory.probe.reset_peak()
            t0 = time.perf_counter()
            controller.run_step(batch, loss_fn, model=model, rollbacks=[ledger])
            opt.step()
            opt.zero_grad(set_to_none=True)
            synchronize(device)
            elapsed = time.perf_counter() - t0
            events = [asdict(e) for e in controller.events[n_events:]]
            m = max(ledger.pieces)
            phase = "sizing" if step < take_at else "competing" if step < release_at else "freed"
            steps.append(
                {
                    "step": step,
                    "phase": phase,
                    "micro_batch": m,
                    "accumulation": len(ledger.pieces),
                    "pieces": ledger.pieces,
                    "samples": len(ledger.ids),
                    "each_sample_once": sorted(ledger.ids) == sample_ids.tolist(),
                    "reruns": ledger.reruns,
                    "peak_bytes": memory.probe.peak(),
                    "peak_fraction": _fraction(memory.probe.peak(), memory.budget),
                    "predicted_fraction": _fraction(controller.predicted_peak(m), memory.budget),
                    "step_ms": elapsed * 1e3,
                    "next_micro_batch": controller.micro_batch,
                    "events": events,
                }
            )
            if step == take_at - 1:  # the memory model the sizing settled with
                fit = (controller.predicted_peak(0), controller.predicted_peak(1))
            if step >= release_at and any(e["reason"] == "grow" for e in events):
                stop = step + 1 + STEPS_AFTER_GROW
    except Exception as exc:  # the records so far still go to the report
        error = report_error(exc)
    finally:
        memory.give_back()
    events = [asdict(e) for e in controller.events]
    settings = {
        "min_micro_batch": controller.min_micro_batch,
        "max_micro_batch": controller.max_micro_batch,
        "target_fraction": controller.target_fraction,
        "check_every": controller.check_every,
        "grow_after": controller.grow_after,
    }
    result = {
        "controller": settings,
        "schedule": {"competitor_at": take_at, "release_at": release_at, "max_steps": last},
        "competitor_bytes": competitor,
        "steps": steps,
        "events": events,
        "error": error,
        "sizing": sizing_summary(
            steps, events, fit, controller.target_fraction, memory.budget, take_at, error
        ),
        "shrink_grow": shrink_grow_summary(steps, events, take_at, release_at, error),
    }
    return result


def sizing_summary(
    steps: list[dict[str, Any]],
    events: list[dict[str, Any]],
    fit: tuple[float | None, float | None],
    target_fraction: float,
    budget: int,
    take_at: int,
    error: str | None,
) -> dict[str, Any]:
    """Steps to settle, the settled size and its peak, against the acceptance range.

    Args:
        fit: the controller's predicted peaks at 0 and 1 sample at the end of sizing.
    """
    sizing = [e for e in events if e["step"] < take_at]
    settle = max((e["step"] for e in sizing), default=-1) + 1
    settled = [s for s in steps if settle <= s["step"] < take_at]
    fractions = [s["peak_fraction"] for s in settled if s["peak_fraction"] is not None]
    out: dict[str, Any] = {
        "steps_to_settle": settle,
        "micro_batch": settled[0]["micro_batch"] if settled else None,
        "accumulation": settled[0]["accumulation"] if settled else None,
        "peak_fraction": statistics.median(fractions) if fractions else None,
        "peak_fraction_min": min(fractions, default=None),
        "peak_fraction_max": max(fractions, default=None),
    }
    base, one = fit
    if base is not None and one is not None and one > base and settled:
        slope = one - base
        out["slope_bytes_per_sample"] = slope
        out["base_bytes"] = base
        # the largest size the target allows, before the pieces are evened out
        out["cap"] = int((target_fraction * budget - base) // slope)
        # a budget that would put the settled size's peak at 88%, for a rerun
        out["budget_gib_for_88pct"] = (base + slope * out["micro_batch"]) / 0.88 / GIB
    problems = []
    if error and len(steps) < take_at:  # a later failure is the next part's
        problems.append(f"run stopped: {error}")
    if not settled:
        problems.append(f"the size still changed at step {settle - 1} of {take_at}")
    else:
        if settle > SETTLE_STEPS:
            problems.append(f"settled after {settle} steps (> {SETTLE_STEPS})")
        if out["accumulation"] < 2:
            problems.append("the effective batch fits at once: lower --budget-gib")
        lo, hi = PEAK_RANGE
        if out["peak_fraction"] is None or not lo <= out["peak_fraction"] <= hi:
            problems.append(
                f"settled peak {fmt(out['peak_fraction'], '.1%')} of the budget, outside "
                f"{lo:.0%}-{hi:.0%} (largest size allowed {out.get('cap')}, evened out to "
                f"{out['micro_batch']})"
            )
    if any(not s["each_sample_once"] for s in steps if s["step"] < take_at):
        problems.append("a step did not run each sample exactly once")
    return {**out, "status": "fail" if problems else "ok", "note": "; ".join(problems) or None}


def shrink_grow_summary(
    steps: list[dict[str, Any]],
    events: list[dict[str, Any]],
    take_at: int,
    release_at: int,
    error: str | None,
) -> dict[str, Any]:
    """Shrink and grow steps around the competing allocation, and sample exactness."""
    shrinks = [e for e in events if take_at <= e["step"] < release_at and e["new"] < e["old"]]
    grows = [e for e in events if e["step"] >= release_at and e["reason"] == "grow"]
    before = next((s["micro_batch"] for s in steps if s["step"] == take_at - 1), None)
    held = [s["micro_batch"] for s in steps if take_at <= s["step"] < release_at]
    out: dict[str, Any] = {
        "shrink_steps": [e["step"] for e in shrinks],
        "shrink_reasons": [e["reason"] for e in shrinks],
        "grow_steps": [e["step"] for e in grows],
        "micro_batch_before": before,
        "micro_batch_held": min(held, default=None),
        "micro_batch_grown": grows[-1]["new"] if grows else None,
        "reruns": sum(s["reruns"] for s in steps),
        # each sample id once implies samples == the effective batch
        "every_step_exact": all(s["each_sample_once"] for s in steps),
    }
    problems = []
    if error:
        problems.append(f"run stopped: {error}")
    if not out["every_step_exact"]:
        problems.append("a step did not run each sample of its batch exactly once")
    if not shrinks:
        problems.append("no shrink while the competing allocation was held")
    if not grows:
        problems.append("no grow after the competing allocation was freed")
    remark = None
    if grows and before is not None and grows[-1]["new"] < before:
        # not a failure of this part: the controller does not propose a size that failed
        # until more memory is available than at the failure, and under a budget the
        # available memory never exceeds it
        remark = f"grew back to {grows[-1]['new']}, below the {before} before the allocation"
    note = "; ".join(problems + ([remark] if remark else [])) or None
    return {**out, "status": "fail" if problems else "ok", "note": note}


# -- part 3: auto_find_batch_size against the elastic trainer --------------------------------


class StepClock(TrainerCallback):
    """Wall time from ``train()`` to each optimizer step's end, the device synchronised
    first so that a step counts once its work is done; and the per-device batch of each
    training attempt (``auto_find_batch_size`` restarts training after an OOM, and the
    steps of a failed attempt are dropped with it).

    Args:
        device: the training device.
        controller: the elastic trainer's controller, read at each step end.
    """

    def __init__(self, device: torch.device, controller: ElasticBatchController | None) -> None:
        self.device = device
        self.controller = controller
        self.start = 0.0
        self.attempts: list[int] = []
        self.times: list[float] = []
        self.sizes: list[dict[str, int]] = []

    def on_train_begin(self, args, state, control, **kwargs):
        self.attempts.append(state.train_batch_size)
        self.times, self.sizes = [], []

    def on_step_end(self, args, state, control, **kwargs):
        synchronize(self.device)
        self.times.append(time.perf_counter() - self.start)
        if self.controller is not None:
            self.sizes.append(self.controller.metrics())


def trainer_run(
    mode: str, memory: Memory, dataset: DeviceBatches, device: torch.device, args: Any
) -> dict[str, Any]:
    """Trains ``--steps`` optimizer steps with one Trainer; a failure becomes the note.

    Args:
        mode: ``"auto_find_batch_size"`` (``transformers.Trainer``) or
            ``"elastic_batch"`` (``TriAccelTrainer``).
        memory: the budget (simulated: its hook is moved onto this run's model).
        dataset: the training data, shared by both trainers.
        device: the training device.
        args: the command-line options.

    Returns:
        A result row: attempts, samples per optimizer step, step times, events.
    """
    E = args.effective_batch
    auto = mode == "auto_find_batch_size"
    row: dict[str, Any] = {
        "trainer": "transformers.Trainer" if auto else "TriAccelTrainer",
        "mode": mode,
        "per_device_batch": E,
        "status": "ok",
        "note": None,
        # what an earlier part left allocated would shrink this run's room
        "allocated_at_start_bytes": torch.cuda.memory_allocated(device)
        if device.type == "cuda"
        else None,
    }
    trainer = model = None
    try:
        model = make_model(args.smoke)
        memory.attach(model)
        with tempfile.TemporaryDirectory() as tmp:
            common = dict(
                output_dir=tmp,
                per_device_train_batch_size=E,
                gradient_accumulation_steps=1,
                max_steps=args.steps,
                learning_rate=LR,
                weight_decay=WEIGHT_DECAY,
                optim="adamw_torch_fused",
                bf16=True,
                use_cpu=device.type == "cpu",
                seed=0,
                report_to=[],
                save_strategy="no",
                logging_strategy="no",
                # on in transformers, off in TriAccelArguments: the same for both here
                logging_nan_inf_filter=False,
                disable_tqdm=True,
                # batches are built on the device by the dataset itself
                dataloader_pin_memory=False,
                dataloader_drop_last=True,
                remove_unused_columns=False,
            )
            if auto:
                trainer = Trainer(
                    model=WithLoss(model),
                    args=TrainingArguments(**common, auto_find_batch_size=True),
                    train_dataset=dataset,
                    data_collator=whole_batch,
                )
                controller = None
            else:
                trainer = TriAccelTrainer(
                    model=model,
                    args=TriAccelArguments(**common, elastic_batch=True),
                    train_dataset=dataset,
                    data_collator=whole_batch,
                )
                controller = trainer.elastic.controller
                if isinstance(memory, SimulatedMemory):
                    controller.probe = memory  # a CPU has no device memory to read
            clock = StepClock(device, controller)
            trainer.add_callback(clock)
            synchronize(device)
            clock.start = time.perf_counter()
            trainer.train()
        # the batch the Trainer hands each optimizer step (no Trainer accumulation)
        batch = clock.attempts[-1]
        last = clock.sizes[-1] if clock.sizes else {"micro_batch": batch, "accumulation": 1}
        times = clock.times
        row.update(
            {
                "attempt_batches": clock.attempts,
                "oom_restarts": len(clock.attempts) - 1,
                "samples_per_step": batch,
                "micro_batch": last["micro_batch"],
                "accumulation": last["accumulation"],
                "steps": len(times),
                "first_step_s": times[0] if times else None,
                "total_s": times[-1] if times else None,
                # after the first step: the steady pace, without start-up and search
                "samples_per_s": (len(times) - 1) * batch / (times[-1] - times[0])
                if len(times) > 1
                else None,
                "step_end_s": times,
                "step_sizes": clock.sizes,
                "events": [asdict(e) for e in controller.events] if controller else [],
            }
        )
        if len(times) != args.steps:
            row["status"], row["note"] = "fail", f"{len(times)} steps of {args.steps}"
    except Exception as exc:  # one failing trainer must not hide the other's result
        row["status"], row["note"] = "error", report_error(exc)
    finally:
        trainer = model = None
        free_memory(device)
    return row


def trainers_summary(rows: list[dict[str, Any]], effective_batch: int) -> dict[str, Any]:
    """The comparison's status: both trainers ran, and the elastic one kept the batch."""
    problems = [f"{r['mode']}: {r['note']}" for r in rows if r["status"] != "ok"]
    elastic = next(r for r in rows if r["mode"] == "elastic_batch")
    if elastic["status"] == "ok" and elastic["samples_per_step"] != effective_batch:
        problems.append(f"elastic_batch ran {elastic['samples_per_step']} samples per step")
    return {"status": "fail" if problems else "ok", "note": "; ".join(problems) or None}


# -- report ------------------------------------------------------------------------------------


def _events_text(events: list[dict[str, Any]]) -> str:
    return "; ".join(f"{e['reason']} {e['old']}->{e['new']}" for e in events)


def steps_table(run: dict[str, Any]) -> str:
    """The controller run's sizing steps, steps with events and phase changes."""
    schedule = run["schedule"]
    marks = {schedule["competitor_at"], schedule["release_at"]}
    steps = run["steps"]
    shown = [
        s
        for s in steps
        if s["step"] < SIZING_STEPS or s["events"] or s["step"] in marks or s is steps[-1]
    ]
    headers = [
        "step",
        "phase",
        "micro-batch",
        "accumulation",
        "samples",
        "re-runs",
        "peak / budget",
        "predicted / budget",
        "step ms",
        "events",
    ]
    body = [
        [
            s["step"],
            s["phase"],
            s["micro_batch"],
            s["accumulation"],
            s["samples"] if s["each_sample_once"] else f"{s['samples']} (not each once)",
            s["reruns"],
            fmt(s["peak_fraction"], ".1%"),
            fmt(s["predicted_fraction"], ".1%"),
            fmt(s["step_ms"], ".1f"),
            _events_text(s["events"]),
        ]
        for s in shown
    ]
    return markdown_table(headers, body)


def summary_table(
    run: dict[str, Any], trainers: dict[str, Any], rows: list[dict[str, Any]], E: int
) -> str:
    """One row per part: status, the figures the acceptance reads, and the note."""
    sz, sg = run["sizing"], run["shrink_grow"]
    sizing = (
        f"{sz.get('micro_batch')} x {sz.get('accumulation')} after {sz.get('steps_to_settle')} "
        f"step(s); peak {fmt(sz.get('peak_fraction'), '.1%')} of the budget "
        f"(target {PEAK_RANGE[0]:.0%}-{PEAK_RANGE[1]:.0%})"
    )
    shrink = (
        f"shrink at steps {sg.get('shrink_steps')} ({', '.join(sg.get('shrink_reasons', []))}): "
        f"{sg.get('micro_batch_before')} -> {sg.get('micro_batch_held')}; grow at steps "
        f"{sg.get('grow_steps')} -> {sg.get('micro_batch_grown')}; {sg.get('reruns')} re-run(s); "
        f"every step {E} samples, each once: {'yes' if sg.get('every_step_exact') else 'NO'}"
    )
    compared = "; ".join(
        f"{r['mode']}: first step {fmt(r.get('first_step_s'), '.2f')} s, "
        f"{r.get('samples_per_step', 'n/a')} samples per step"
        for r in rows
    )
    body = [
        ["sizing", sz["status"], sizing, sz["note"] or ""],
        ["shrink and grow", sg["status"], shrink, sg["note"] or ""],
        ["auto_find vs elastic", trainers["status"], compared, trainers["note"] or ""],
    ]
    return markdown_table(["part", "status", "result", "note"], body)


def trainers_table(rows: list[dict[str, Any]], steps: int) -> str:
    """Time to the first optimizer step and to the last, per trainer."""
    headers = [
        "trainer",
        "mode",
        "batch asked",
        "samples / optimizer step",
        "micro-batch x accumulation",
        "OOM restarts",
        "first step s",
        f"{steps} steps s",
        "samples/s after step 1",
        "note",
    ]
    body = [
        [
            r["trainer"],
            r["mode"],
            r["per_device_batch"],
            r.get("samples_per_step", "n/a"),
            f"{r['micro_batch']} x {r['accumulation']}" if "micro_batch" in r else "n/a",
            r.get("oom_restarts", "n/a"),
            fmt(r.get("first_step_s"), ".2f"),
            fmt(r.get("total_s"), ".2f"),
            fmt(r.get("samples_per_s"), ".0f"),
            (r["note"] or "")[:200],
        ]
        for r in rows
    ]
    return markdown_table(headers, body)


SEMANTICS = (
    "auto_find_batch_size multiplies the per-device batch by 0.9 on each out-of-memory "
    "error and restarts training with it: its optimizer steps then see fewer samples "
    "(the effective batch changes, and with it the learning dynamics). elastic_batch keeps "
    "the asked batch per optimizer step and accumulates gradients over micro-batches, so "
    "its time per step covers more samples; compare samples/s, not step times."
)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the three parts, prints markdown tables and writes bench_elastic.json / .md.

    Args:
        argv: command-line arguments (default: ``sys.argv[1:]``).

    Returns:
        0, or 1 when a part failed (an error, or its acceptance check).
    """
    parser = base_parser(__doc__.split("\n\n")[0])
    parser.add_argument(
        "--budget-gib",
        type=float,
        default=None,
        help="memory cap of this process (default 3; smoke: 1, simulated)",
    )
    parser.add_argument(
        "--effective-batch",
        type=int,
        default=None,
        help="samples per step (default 4096; smoke: 32)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="optimizer steps of each Trainer run (default 20; smoke: 3)",
    )
    parser.add_argument(
        "--grow-after",
        type=int,
        default=None,
        help="controller's stable steps before growing (default: its own, 100; smoke: 10)",
    )
    args = parser.parse_args(argv)
    argv = list(argv) if argv is not None else sys.argv[1:]
    defaults = {"budget_gib": (1.0, 3.0), "effective_batch": (32, 4096), "steps": (3, 20)}
    for name, (smoke, full) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, smoke if args.smoke else full)
    if args.smoke:
        if args.grow_after is None:
            args.grow_after = 10
        # tiny tensors: waking a CPU thread pool costs more than the work
        torch.set_num_threads(1)
    device = torch.device(args.device or "cpu") if args.smoke else resolve_device(args.device)
    budget = int(args.budget_gib * GIB)
    if device.type == "cuda" and not args.smoke:
        if device.index is None:  # the memory-fraction calls need an indexed device
            device = torch.device("cuda", torch.cuda.current_device())
        memory: Memory = CudaBudget(device, budget)
    else:
        memory = SimulatedMemory(budget, args.effective_batch)
    data = load_data(args.smoke, args.effective_batch)
    dataset = DeviceBatches(data, args.effective_batch * args.steps, device)

    try:
        run = controller_run(memory, dataset, device, args)
    except Exception as exc:  # set-up failed: no step ran
        error = report_error(exc)
        failed = {"status": "error", "note": error}
        run = {"steps": [], "events": [], "error": error, "sizing": failed, "shrink_grow": failed}
        run["schedule"] = {"competitor_at": SIZING_STEPS, "release_at": None, "max_steps": None}
    free_memory(device)
    rows = [
        trainer_run(mode, memory, dataset, device, args)
        for mode in ("auto_find_batch_size", "elastic_batch")
    ]
    trainers = trainers_summary(rows, args.effective_batch)

    env = environment(__file__, argv, device)
    text = "\n\n".join(
        [
            summary_table(run, trainers, rows, args.effective_batch),
            steps_table(run),
            trainers_table(rows, args.steps),
            SEMANTICS,
        ]
    )
    kind = "CUDA budget" if isinstance(memory, CudaBudget) else "simulated device"
    print(f"device: {env['device']}; torch {env['torch']}, transformers {env['transformers']}")
    print(
        f"resnet18_cifar, bf16 autocast, AdamW(fused); effective batch {args.effective_batch}, "
        f"{kind} of {memory.budget / GIB:.2f} GiB; all steps in the JSON"
    )
    print(text)
    config = {
        "smoke": args.smoke,
        "memory": kind,
        "budget_bytes": memory.budget,
        "budget_gib": memory.budget / GIB,
        "device_total_bytes": getattr(memory, "total", None),
        "effective_batch": args.effective_batch,
        "trainer_steps": args.steps,
        "model": "resnet18_cifar" + (" (tiny)" if args.smoke else ""),
        "data": "random 16x16" if args.smoke else "embedded CIFAR-10 train slice",
        "image_size": data.images.shape[-1],
        "autocast": "bfloat16",
        "optimizer": "AdamW(fused)",
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "lr": LR,
        "weight_decay": WEIGHT_DECAY,
    }
    if isinstance(memory, SimulatedMemory):
        config["simulated"] = {"base_bytes": memory.base, "slope_bytes_per_sample": memory.slope}
    parts = {
        "sizing": run["sizing"],
        "shrink_grow": run["shrink_grow"],
        "auto_find_vs_elastic": trainers,
    }
    payload = {
        "env": env,
        "config": config,
        "parts": parts,
        "controller_run": run,
        "trainers": rows,
        "semantics": SEMANTICS,
    }
    path = write_results(out_dir(args.out), "bench_elastic", payload, text)
    print(f"wrote {path}")
    return 1 if any(p["status"] != "ok" for p in parts.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
