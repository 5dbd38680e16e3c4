"""Training throughput through ``TriAccelTrainer`` against a hand-written loop, and its scaling.

CIFAR ResNet-18 (timm ``resnet18_cifar``), per-device batch 512, bf16 autocast on CUDA,
fed from images held on the device with random crop and flip done per batch there, as
the recipes feed it. Variants (``--variants``, all by default):

- ``loop_adamw_fused``: a hand-written loop, ``torch.optim.AdamW(fused=True)`` over
  :class:`~hf_triaccel.data.images.GPUBatchLoader` batches;
- ``trainer_adamw_fused``: ``TriAccelTrainer`` with ``optim="adamw_torch_fused"``, the
  same optimizer: its gap to the loop is the Trainer's overhead;
- ``trainer_adafisherw``: ``TriAccelTrainer`` with ``optim="adafisherw"``, the product.

Every variant does the same work per step: forward under autocast, cross-entropy on
float logits with label smoothing 0.1, backward, gradient clipping at
``--max-grad-norm`` (the Trainer's default 1.0; 0 turns it off everywhere), optimizer
step, the Trainer's default linear learning-rate decay, and a read-back of the summed
loss every ``--logging-steps`` steps (the Trainer logs then). The Trainer otherwise runs
with its defaults (``TriAccelArguments``'), so that what it adds is measured: a gradient
norm on every step, its callbacks and its data loader. Turned off: evaluation,
checkpoints, reporting backends, the progress bar, and DDP's search for unused
parameters, which the Trainer turns on for a plain ``nn.Module`` although every
parameter here gets a gradient.

Timing: ``--warmup`` untimed steps (cuDNN autotuning, kernel compilation, the first
Fisher refresh), then ``--steps`` timed steps; the clock starts at the end of the last
warm-up step and stops at the end of the last timed step, with the device synchronised
only there (the Trainer's ``on_step_end`` callback for its variants). The data set is
cut to a whole number of global batches, so that every step of every variant carries
exactly the per-device batch (the Trainer's device loader keeps a partial last batch).
Reported per variant: samples/s (``world size x per-device batch x steps / seconds``),
step time, the peak memory allocated during the timed steps (weights, gradients,
optimizer state, activations and the data set) and the ratio to the hand-written loop.
AdaFisherW refreshes its Fisher factors every 100 steps, so use ``--steps`` of a few
hundred to weigh the refresh steps at their share.

Multi-GPU: under ``accelerate launch --num_processes N`` (or ``torchrun``) each process
trains with the per-device batch on its own GPU under DDP, and process 0 reports the
global samples/s. The hand-written loop runs on one process only and is reported as
skipped there. Scaling from 1 to N GPUs is the ratio of ``samples_per_second`` of the
same variant in the N-process record over the 1-process record (same ``--data``,
``--steps``, ``--warmup``); its efficiency is that ratio divided by N.

Usage:
    python benchmarks/bench_trainer.py --data /path/to/cifar10 --out "$OUT"
    accelerate launch --num_processes 1 benchmarks/bench_trainer.py \\
        --variants trainer_adafisherw --data /path/to/cifar10 --out "$OUT/gpu1"
    accelerate launch --multi_gpu --num_processes 2 benchmarks/bench_trainer.py \\
        --variants trainer_adafisherw --data /path/to/cifar10 --out "$OUT/gpu2"
    python benchmarks/bench_trainer.py --smoke --out /tmp/bench   # CPU, tiny model
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from accelerate import PartialState
from common import (
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
from transformers import PrinterCallback, TrainerCallback, get_scheduler

from hf_triaccel.data.images import GPUBatchLoader, ImageTensors, load_image_dataset
from hf_triaccel.integrations.timm_models import create_cifar_model
from hf_triaccel.integrations.trainer import TriAccelArguments, TriAccelTrainer
from hf_triaccel.quickstart import DEFAULT_HYPERPARAMETERS

MODEL = "resnet18_cifar"
LABEL_SMOOTHING = 0.1  # the recipes' value
# one block per stage and narrow stages: a model a CPU trains in milliseconds per step
SMOKE_MODEL_ARGS = {"layers": (1, 1, 1, 1), "channels": (8, 16, 32, 64)}
# the Trainer's default schedule, which the hand-written loop runs too
LR_SCHEDULE = "linear"


@dataclass(frozen=True)
class Variant:
    """One measured configuration.

    Attributes:
        optimizer: the optimizer's display name.
        runner: ``"loop"`` (hand-written) or ``"trainer"`` (``TriAccelTrainer``).
        optim: the Trainer's ``optim`` name (``None`` for the loop).
        hyperparameters: key of :data:`DEFAULT_HYPERPARAMETERS` (learning rate, weight decay).
    """

    optimizer: str
    runner: str
    optim: str | None
    hyperparameters: str


VARIANTS = {
    "loop_adamw_fused": Variant("AdamW(fused)", "loop", None, "adamw"),
    "trainer_adamw_fused": Variant("AdamW(fused)", "trainer", "adamw_torch_fused", "adamw"),
    "trainer_adafisherw": Variant("AdaFisherW", "trainer", "adafisherw", "adafisherw"),
}
BASELINE = "loop_adamw_fused"


class SteadyClock:
    """Times the steps that follow a warm-up, synchronising the device only at the two ends.

    Call :meth:`step_end` once at the end of every optimizer step, from the first one.

    Args:
        device: where the steps run.
        warmup: untimed steps first (>= 1: the clock starts at the end of a step).
        steps: timed steps.
    """

    def __init__(self, device: torch.device, warmup: int, steps: int) -> None:
        self.device, self.warmup, self.steps = device, warmup, steps
        self.count = 0
        self.seconds: float | None = None
        self.peak_bytes: int | None = None
        self._start = 0.0

    def step_end(self) -> None:
        """Counts a finished step; starts or stops the clock at the window's edges."""
        self.count += 1
        if self.count == self.warmup:
            synchronize(self.device)
            if self.device.type == "cuda":
                # the peak of the steady state, not of the warm-up's autotuning workspaces
                torch.cuda.reset_peak_memory_stats(self.device)
            self._start = time.perf_counter()
        elif self.count == self.warmup + self.steps:
            synchronize(self.device)
            self.seconds = time.perf_counter() - self._start
            if self.device.type == "cuda":
                self.peak_bytes = torch.cuda.max_memory_allocated(self.device)

    @property
    def timed_steps(self) -> int:
        """Steps finished inside the timed window so far."""
        return min(max(self.count - self.warmup, 0), self.steps)


class ClockCallback(TrainerCallback):
    """Feeds the Trainer's step ends to a :class:`SteadyClock`."""

    def __init__(self, clock: SteadyClock) -> None:
        self.clock = clock

    def on_step_end(self, args, state, control, **kwargs):
        self.clock.step_end()


def load_data(source: str, global_batch: int, device: torch.device, progress: bool) -> ImageTensors:
    """The training split on ``device``, cut to a whole number of global batches.

    Args:
        source: ``"embedded"`` or a local folder of parquet files (``load_image_dataset``).
        global_batch: samples of one step over all processes.
        device: where every variant reads the images from (loaded there once, shared).
        progress: show the decoding progress bar.

    Returns:
        The first ``len // global_batch * global_batch`` images and their labels.
    """
    data = load_image_dataset(source, "train", progress=progress)
    keep = len(data) // global_batch * global_batch
    if keep == 0:
        raise ValueError(f"{len(data)} training images hold no global batch of {global_batch}")
    return ImageTensors(data.images[:keep], data.labels[:keep], data.class_names).to(device)


def build_model(num_classes: int, smoke: bool) -> nn.Module:
    """A freshly seeded ``resnet18_cifar`` (shrunk for smoke runs), the same in every variant."""
    torch.manual_seed(0)
    return create_cifar_model(MODEL, num_classes=num_classes, **(SMOKE_MODEL_ARGS if smoke else {}))


def run_loop(
    variant: Variant, data: ImageTensors, device: torch.device, args: argparse.Namespace
) -> dict[str, Any]:
    """The hand-written AdamW(fused) loop; returns its clock readings."""
    lr, weight_decay = DEFAULT_HYPERPARAMETERS[variant.hyperparameters]
    model = build_model(data.num_classes, args.smoke).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, fused=True)
    total = args.warmup + args.steps
    scheduler = get_scheduler(LR_SCHEDULE, optimizer, num_warmup_steps=0, num_training_steps=total)
    mean, std = data.channel_stats()
    loader = GPUBatchLoader(
        data,
        args.batch_size,
        shuffle=True,
        augment=True,
        drop_last=True,
        seed=args.seed,
        mean=mean,
        std=std,
    )
    clock = SteadyClock(device, args.warmup, args.steps)
    loss_sum = torch.zeros((), device=device)
    for step, (images, labels) in enumerate(_endless(loader), start=1):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):
            logits = model(images)
        loss = F.cross_entropy(logits.float(), labels, label_smoothing=LABEL_SMOOTHING)
        loss.backward()
        if args.max_grad_norm > 0:
            nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        loss_sum += loss.detach()
        clock.step_end()
        # what a Trainer log costs (it waits for the device), after the clock as the
        # Trainer logs after its on_step_end callbacks
        if args.logging_steps and step % args.logging_steps == 0:
            loss_sum.item()
            loss_sum.zero_()
        if step == total:
            break
    return {"clock": clock, "global_step": clock.count}


def _endless(loader: GPUBatchLoader) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Batches epoch after epoch (each ``iter`` of the loader starts the next epoch)."""
    while True:
        yield from loader


def run_trainer(
    variant: Variant, data: ImageTensors, device: torch.device, args: argparse.Namespace
) -> dict[str, Any]:
    """``TriAccelTrainer`` on the device-resident data; returns its clock readings."""
    lr, weight_decay = DEFAULT_HYPERPARAMETERS[variant.hyperparameters]
    model = build_model(data.num_classes, args.smoke)
    clock = SteadyClock(device, args.warmup, args.steps)
    with tempfile.TemporaryDirectory() as output_dir:
        # save_strategy "no": the efficiency report is all the Trainer writes here
        trainer_args = TriAccelArguments(
            output_dir=output_dir,
            optim=variant.optim,
            learning_rate=lr,
            weight_decay=weight_decay,
            lr_scheduler_type=LR_SCHEDULE,
            per_device_train_batch_size=args.batch_size,
            max_steps=args.warmup + args.steps,
            max_grad_norm=args.max_grad_norm,
            label_smoothing_factor=LABEL_SMOOTHING,
            bf16=args.bf16,
            use_cpu=device.type == "cpu",
            triaccel_impl=args.impl,
            device_data_augment=True,
            eval_strategy="no",
            save_strategy="no",
            logging_strategy="steps" if args.logging_steps else "no",
            logging_steps=args.logging_steps,
            report_to="none",
            disable_tqdm=True,
            ddp_find_unused_parameters=False,
            seed=args.seed,
        )
        trainer = TriAccelTrainer(
            model=model, args=trainer_args, train_dataset=data, callbacks=[ClockCallback(clock)]
        )
        # with the progress bar off the Trainer prints every log: keep stdout for the table
        trainer.remove_callback(PrinterCallback)
        trainer.train()
        optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
        return {
            "clock": clock,
            "global_step": trainer.state.global_step,
            "update_every": getattr(optimizer, "update_every", None),
        }


def measure(
    name: str,
    data: ImageTensors,
    device: torch.device,
    world_size: int,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """Runs one variant; a failure becomes the row's note instead of ending the benchmark.

    Returns:
        A result row: variant, optimizer, runner, status, steps, seconds, samples/s,
        step time, peak memory and a note.
    """
    variant = VARIANTS[name]
    row: dict[str, Any] = {
        "variant": name,
        "optimizer": variant.optimizer,
        "runner": variant.runner,
        "optim": variant.optim,
        "status": "ok",
        "warmup_steps": args.warmup,
        "steps": None,
        "global_step": None,
        "seconds": None,
        "samples_per_second": None,
        "step_ms": None,
        "peak_bytes": None,
        "update_every": None,
        "note": None,
    }
    if variant.runner == "loop" and world_size > 1:
        row["status"] = "skipped"
        row["note"] = (
            f"the hand-written loop runs on one process only ({world_size} here): compare "
            "with a 1-process run"
        )
        return row
    try:
        run = run_loop if variant.runner == "loop" else run_trainer
        result = run(variant, data, device, args)
        clock: SteadyClock = result["clock"]
        row.update(
            steps=clock.timed_steps,
            global_step=result["global_step"],
            update_every=result.get("update_every"),
            peak_bytes=clock.peak_bytes,
        )
        if clock.seconds is None:
            raise RuntimeError(
                f"training stopped after {clock.count} steps, before the {args.warmup} warm-up "
                f"and {args.steps} timed steps were done"
            )
        row["seconds"] = clock.seconds
        row["step_ms"] = 1e3 * clock.seconds / args.steps
        row["samples_per_second"] = world_size * args.batch_size * args.steps / clock.seconds
    except Exception as exc:  # a failing variant must not hide the others' results
        row["status"] = "error"
        row["note"] = report_error(exc)
    finally:
        # free this variant's model, optimizer and activations before the next one
        free_memory(device)
    return row


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Adds ``vs_loop``: samples/s over the hand-written loop's, when it was measured."""
    base = next((r for r in rows if r["variant"] == BASELINE and r["samples_per_second"]), None)
    for r in rows:
        ok = base is not None and r["samples_per_second"]
        r["vs_loop"] = r["samples_per_second"] / base["samples_per_second"] if ok else None


def table(rows: list[dict[str, Any]]) -> str:
    """The results as a markdown table."""
    headers = [
        "variant",
        "optimizer",
        "timed steps",
        "samples/s",
        "step ms",
        "x hand-written loop",
        "peak GiB",
        "status",
        "note",
    ]
    body = [
        [
            r["variant"],
            r["optimizer"],
            fmt(r["steps"], "d"),
            fmt(r["samples_per_second"], ".1f"),
            fmt(r["step_ms"], ".2f"),
            fmt(r["vs_loop"], ".3f", "x"),
            fmt(r["peak_bytes"] / 2**30 if r["peak_bytes"] else None, ".2f"),
            r["status"],
            (r["note"] or "")[:200],
        ]
        for r in rows
    ]
    return markdown_table(headers, body)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command-line flags, with full-size or smoke defaults filled in."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help=f"comma-separated variants to measure, in order (default: all of {list(VARIANTS)})",
    )
    parser.add_argument(
        "--data",
        default="embedded",
        help="'embedded' (the 5,000-image CIFAR-10 slice in the package) or a local folder "
        "of train.parquet / Hub shards",
    )
    parser.add_argument(
        "--batch-size", type=int, default=None, help="per-device batch (default 512; smoke: 8)"
    )
    parser.add_argument(
        "--warmup", type=int, default=None, help="untimed steps, >= 1 (default 20; smoke: 2)"
    )
    parser.add_argument(
        "--steps", type=int, default=None, help="timed steps (default 200; smoke: 3)"
    )
    parser.add_argument(
        "--logging-steps",
        type=int,
        default=20,
        help="read the loss back (the Trainer: log) every N steps, as the recipes do; 0: never",
    )
    parser.add_argument(
        "--max-grad-norm",
        type=float,
        default=1.0,
        help="gradient clipping in every variant (the Trainer's default); 0: off",
    )
    parser.add_argument(
        "--impl",
        default=None,
        choices=("triton", "foreach", "reference"),
        help="AdaFisher implementation (default: automatic)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--out",
        default=None,
        help="directory for the JSON and markdown results (default: $OUT, else the "
        "current directory)",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny model, batch and step counts, fp32, to check the script end to end on CPU",
    )
    parser.add_argument(
        "--device",
        default=None,
        choices=("cpu", "cuda"),
        help="default: cuda when available; each process of a launcher takes its own GPU",
    )
    args = parser.parse_args(argv)
    defaults = {"batch_size": (8, 512), "warmup": (2, 20), "steps": (3, 200)}
    for name, (smoke, full) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, smoke if args.smoke else full)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(args.variants) - set(VARIANTS))
    if unknown or not args.variants:
        parser.error(f"--variants: unknown {unknown}; choose from {list(VARIANTS)}")
    if args.warmup < 1 or args.steps < 1 or args.batch_size < 1 or args.logging_steps < 0:
        parser.error("--warmup, --steps and --batch-size need >= 1, --logging-steps >= 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the benchmark; process 0 prints a markdown table and writes bench_trainer.json.

    Args:
        argv: command-line arguments (default: ``sys.argv[1:]``).

    Returns:
        0, or 1 when a variant failed.
    """
    args = parse_args(argv)
    argv = list(argv) if argv is not None else sys.argv[1:]
    # under accelerate launch / torchrun: the process group, this process's rank and GPU
    state = PartialState(cpu=resolve_device(args.device).type == "cpu")
    device, world_size = state.device, state.num_processes
    args.bf16 = device.type == "cuda"
    if args.smoke:
        # tiny tensors: waking a CPU thread pool costs more than the work, and on two
        # shared cores sometimes stalled a smoke step for over a second
        torch.set_num_threads(1)
    if device.type == "cuda":
        # same autotuned convolutions for every variant
        torch.backends.cudnn.benchmark = True

    data = load_data(args.data, world_size * args.batch_size, device, state.is_main_process)
    rows = [measure(name, data, device, world_size, args) for name in args.variants]
    add_ratios(rows)
    status = 1 if any(r["status"] == "error" for r in rows) else 0
    if not state.is_main_process:
        return status

    env = environment(__file__, argv, device)
    env["processes"] = world_size
    if world_size > 1:
        # the launcher's own command line is not visible from inside the process
        env["command"] = f"{world_size} processes: {env['command']}"
    text = table(rows)
    print(f"device: {env['device']} x {world_size}; torch {env['torch']}")
    print(
        f"{MODEL}{' (smoke size)' if args.smoke else ''}, per-device batch {args.batch_size}, "
        f"{'bf16 autocast' if args.bf16 else 'fp32'}, {len(data)} training images on the "
        f"device, {args.steps} timed steps after {args.warmup} warm-up steps"
    )
    print(text)
    payload = {
        "env": env,
        "config": {
            "smoke": args.smoke,
            "model": MODEL,
            "data": args.data,
            "train_images": len(data),
            "world_size": world_size,
            "per_device_batch_size": args.batch_size,
            "global_batch_size": world_size * args.batch_size,
            "warmup_steps": args.warmup,
            "timed_steps": args.steps,
            "precision": "bf16 autocast" if args.bf16 else "fp32",
            "augmentation": "random crop (4-pixel zero padding) and horizontal flip, on the device",
            "label_smoothing": LABEL_SMOOTHING,
            "max_grad_norm": args.max_grad_norm,
            "logging_steps": args.logging_steps,
            "lr_scheduler": LR_SCHEDULE,
            "hyperparameters": {
                name: {"lr": lr, "weight_decay": weight_decay}
                for name in args.variants
                for lr, weight_decay in [DEFAULT_HYPERPARAMETERS[VARIANTS[name].hyperparameters]]
            },
            "impl": args.impl,
            "cudnn_benchmark": device.type == "cuda",
            "seed": args.seed,
        },
        "results": rows,
    }
    path = write_results(out_dir(args.out), "bench_trainer", payload, text)
    print(f"wrote {path}")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
