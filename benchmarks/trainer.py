"""Training throughput through ``TriAccelTrainer`` against a hand-written loop, and its scaling.

The CIFAR ResNet-18, per-device batch 512, bf16, images held and augmented on the
device, model and batches in ``--layout`` (default channels_last, what the Trainer
picks): ``loop_adamw_fused`` (a hand-written loop), ``trainer_adamw_fused`` (the Trainer
with the same optimizer: the Trainer's overhead) and ``trainer_adafisherw``, the same
work per step; ``*_compiled`` variants under ``torch.compile`` (the loop) or
``torch_compile=True`` (the Trainer), their compilation time apart. Ratios are against
the fastest hand-written loop of the run. README.md: the step, the timing, multi-GPU
scaling.

Usage:
    python -m benchmarks trainer --data /path/to/cifar10 --out "$OUT"
    python -m benchmarks trainer --data /path/to/cifar10 --out "$OUT/compile" \\
        --variants loop_adamw_fused_compiled,trainer_adafisherw,trainer_adafisherw_compiled
    accelerate launch --multi_gpu --num_processes 2 -m benchmarks trainer \\
        --variants trainer_adafisherw --data /path/to/cifar10 --out "$OUT/gpu2"
"""

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from accelerate import PartialState
from torch import nn
from transformers import get_scheduler

from benchmarks import harness
from hf_triaccel.data.images import ImageTensors
from hf_triaccel.integrations.compiled import CompileClock, eager_module
from hf_triaccel.integrations.layout import to_channels_last
from hf_triaccel.integrations.trainer import TriAccelArguments, TriAccelTrainer

NAME = "trainer"
HELP = "TriAccelTrainer against a hand-written loop: samples/s, eager and compiled"

MODEL = "resnet18_cifar"
LABEL_SMOOTHING = 0.1  # the recipes' value
LR_SCHEDULE = "linear"  # the Trainer's default schedule, which the loop runs too
# variant -> (optimizer shown, the Trainer's optim name or None for the loop, hyperparameters);
# a variant named "<variant>_compiled" is the same under torch.compile
VARIANTS = {
    "loop_adamw_fused": ("AdamW(fused)", None, "adamw"),
    "trainer_adamw_fused": ("AdamW(fused)", "adamw_torch_fused", "adamw"),
    "trainer_adafisherw": ("AdaFisherW", "adafisherw", "adafisherw"),
}
VARIANTS.update({f"{name}_compiled": spec for name, spec in list(VARIANTS.items())})
DEFAULT_VARIANTS = ("loop_adamw_fused", "trainer_adamw_fused", "trainer_adafisherw")


def compiled(name: str) -> bool:
    """Whether variant ``name`` runs under torch.compile."""
    return name.endswith("_compiled")


def run_loop(
    name: str, data: ImageTensors, device: torch.device, args: Any, record: Callable | None = None
) -> dict[str, Any]:
    """The hand-written AdamW(fused) loop, in ``--layout``, compiled for a ``_compiled``
    variant; returns its clock and compilation time. ``record`` is the clock's (called at
    each step end)."""
    lr, weight_decay = harness.HYPERPARAMETERS[VARIANTS[name][2]]
    model = harness.build_model(MODEL, args.size, num_classes=data.num_classes).to(device)
    channels_last = args.layout == "channels_last" and to_channels_last(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, fused=True)
    forward = model
    if compiled(name):
        forward = torch.compile(model, backend=args.compile_backend, mode=args.compile_mode)
    compile_clock = CompileClock(device) if compiled(name) else None
    total = args.warmup + args.steps
    scheduler = get_scheduler(LR_SCHEDULE, optimizer, num_warmup_steps=0, num_training_steps=total)
    loader = harness.image_batches(
        data, args.batch_size, seed=args.seed, channels_last=channels_last
    )
    clock = harness.StepClock(device, warmup=args.warmup, steps=args.steps, record=record)
    loss_sum = torch.zeros((), device=device)

    def forward_backward(images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):
            logits = forward(images)
        loss = F.cross_entropy(logits.float(), labels, label_smoothing=LABEL_SMOOTHING)
        loss.backward()
        return loss

    for step, (images, labels) in enumerate(harness.endless(loader), start=1):
        if compile_clock is None:
            loss = forward_backward(images, labels)
        else:
            loss = compile_clock.time(lambda: forward_backward(images, labels))  # noqa: B023
        if args.max_grad_norm > 0:
            nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        loss_sum += loss.detach()
        clock.step_end(args.batch_size)
        # what a Trainer log costs (it waits for the device), after the clock as the
        # Trainer logs after its on_step_end callbacks
        if args.logging_steps and step % args.logging_steps == 0:
            loss_sum.item()
            loss_sum.zero_()
        if step == total:
            break
    seconds = None if compile_clock is None else compile_clock.seconds
    return {"clock": clock, "global_step": step, "compile_seconds": seconds}


def run_trainer(
    name: str, data: ImageTensors, device: torch.device, args: Any, record: Callable | None = None
) -> dict[str, Any]:
    """``TriAccelTrainer`` on the device-resident data; returns its clock. ``record`` is
    the clock's (called at each step end)."""
    lr, weight_decay = harness.HYPERPARAMETERS[VARIANTS[name][2]]
    model = harness.build_model(MODEL, args.size, num_classes=data.num_classes)
    clock = harness.StepClock(device, warmup=args.warmup, steps=args.steps, record=record)
    kwargs = dict(optim=VARIANTS[name][1], learning_rate=lr, weight_decay=weight_decay)
    kwargs.update(lr_scheduler_type=LR_SCHEDULE, seed=args.seed, bf16=args.bf16)
    kwargs.update(per_device_train_batch_size=args.batch_size, triaccel_impl=args.impl)
    kwargs.update(max_steps=args.warmup + args.steps, max_grad_norm=args.max_grad_norm)
    kwargs.update(label_smoothing_factor=LABEL_SMOOTHING, device_data_augment=True)
    # the efficiency report is all the Trainer writes here
    kwargs.update(eval_strategy="no", logging_strategy="steps" if args.logging_steps else "no")
    # on for a plain nn.Module, although every parameter here gets a gradient
    kwargs.update(logging_steps=args.logging_steps, ddp_find_unused_parameters=False)
    kwargs.update(triaccel_channels_last=args.layout == "channels_last")
    if compiled(name):
        kwargs.update(torch_compile=True, torch_compile_backend=args.compile_backend)
        kwargs.update(torch_compile_mode=args.compile_mode)
    trainer = harness.train(TriAccelTrainer, TriAccelArguments, model, data, clock, **kwargs)
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    update_every = getattr(optimizer, "update_every", None)
    seconds = None if trainer.compile_clock is None else trainer.compile_clock.seconds
    return {
        "clock": clock,
        "global_step": trainer.state.global_step,
        "update_every": update_every,
        "channels_last": trainer.channels_last,
        "compile_seconds": seconds,
        # what ran, whatever was asked: an Accelerator state left by an earlier variant
        # must not compile this one, nor leave it uncompiled
        "compiled": eager_module(trainer.model_wrapped) is not None,
    }


def measure(name: str, data: ImageTensors, device: torch.device, world: int, args: Any) -> dict:
    """Runs one variant; returns its row (samples/s, step time, peak memory, ...)."""
    shown, optim, _ = VARIANTS[name]
    row = {"variant": name, "optimizer": shown, "optim": optim, "status": "ok", "note": None}
    row.update(runner="loop" if optim is None else "trainer", warmup_steps=args.warmup)
    row.update(compiled=compiled(name), layout=args.layout, compile_seconds=None)
    row.update(dict.fromkeys(("steps", "global_step", "seconds", "samples_per_second")))
    row.update(step_ms=None, peak_bytes=None, update_every=None)
    if optim is None and world > 1:
        row["status"] = "skipped"
        row["note"] = f"the hand-written loop runs on one process only ({world} here)"
        return row
    with harness.variant(row):
        result = (run_loop if optim is None else run_trainer)(name, data, device, args)
        clock: harness.StepClock = result["clock"]
        row.update(
            steps=min(max(clock.count - args.warmup, 0), args.steps),
            global_step=result["global_step"],
        )
        row.update(update_every=result.get("update_every"), peak_bytes=clock.peak_bytes)
        row["compile_seconds"] = result["compile_seconds"]
        if result.get("compiled", row["compiled"]) != row["compiled"]:
            raise RuntimeError(f"{name}: the Trainer's model compiled={result['compiled']}")
        if result.get("channels_last") is False and args.layout == "channels_last":
            row["layout"] = "nchw"  # the Trainer keeps the layout of a model it cannot convert
        if clock.window is None:
            raise RuntimeError(
                f"training stopped after {clock.count} steps, before the {args.warmup} warm-up "
                f"and {args.steps} timed steps were done"
            )
        row["seconds"] = clock.window["timed_runtime"]
        row["step_ms"] = 1e3 * row["seconds"] / args.steps
        row["samples_per_second"] = clock.window["timed_samples_per_second"]
    harness.free_memory(device)  # this variant's model, optimizer and activations
    return row


OPTIONS = {
    "batch_size": (int, 8, 512, "per-device batch"),
    "warmup": (int, 2, 20, "untimed steps, >= 1"),
    "steps": (int, 3, 200, "timed steps"),
}


def add_arguments(parser: Any) -> None:
    """The variants, layout, compilation, data and training settings."""
    harness.add_common(parser, OPTIONS, impls=False)
    parser.add_argument(
        "--variants", default=",".join(DEFAULT_VARIANTS), help=f"of {list(VARIANTS)}"
    )
    parser.add_argument(
        "--layout", choices=("channels_last", "nchw"), default="channels_last", help="all variants"
    )
    parser.add_argument("--compile-backend", default="inductor", help="of the _compiled variants")
    parser.add_argument(
        "--compile-mode",
        help="of the _compiled variants: torch.compile's mode (reduce-overhead: CUDA graphs)",
    )
    parser.add_argument("--data", default="embedded", help="'embedded' or a parquet folder")
    parser.add_argument("--logging-steps", type=int, default=20, help="loss read-back; 0: never")
    parser.add_argument("--max-grad-norm", type=float, default=1.0, help="clipping; 0: off")
    parser.add_argument("--impl", choices=("triton", "foreach", "reference"))
    parser.add_argument("--seed", type=int, default=0)


def load(args: Any) -> tuple[ImageTensors, int]:
    """The arguments, checked; this process's device (``args.device``; under accelerate
    launch or torchrun, the process group is set up); the training images on it, a whole
    number of global batches. Returns ``(data, world size)``."""
    harness.resolve(args)
    args.variants = harness.split(args.variants, tuple(VARIANTS), "--variants")
    if min(args.warmup, args.steps, args.batch_size) < 1 or args.logging_steps < 0:
        raise SystemExit("error: --warmup, --steps, --batch-size need >= 1, --logging-steps >= 0")
    if args.warmup < 3 and any(map(compiled, args.variants)):
        # step 1 of AdaFisher refreshes (eagerly), step 2 compiles: neither is timed
        raise SystemExit("error: --warmup: the _compiled variants need >= 3")
    # under accelerate launch / torchrun: the process group, this process's rank and GPU
    state = PartialState(cpu=args.device.type == "cpu")
    device = args.device = state.device
    world, args.bf16 = state.num_processes, device.type == "cuda"
    torch.backends.cudnn.benchmark = args.bf16  # same autotuned convolutions for every variant
    n, main_process = 4 * world * args.batch_size, state.is_main_process
    data = harness.load_images(args.data, "train", smoke=args.smoke, n=n, progress=main_process)
    # every step of every variant carries exactly the per-device batch
    keep = len(data) // (world * args.batch_size) * world * args.batch_size
    if keep == 0:
        raise ValueError(f"{len(data)} training images hold no global batch")
    data = ImageTensors(data.images[:keep], data.labels[:keep], data.class_names).to(device)
    return data, world


def run(args: Any) -> int:
    """Runs the benchmark; process 0 writes trainer.json. Returns 1 on a failure."""
    data, world = load(args)
    device, main_process = args.device, PartialState().is_main_process
    rows = [measure(name, data, device, world, args) for name in args.variants]
    loops = [r for r in rows if r["runner"] == "loop" and r["samples_per_second"]]
    fastest = max(loops, key=lambda r: r["samples_per_second"], default=None)
    harness.add_ratio(rows, "samples_per_second", "vs_loop", lambda r: r is fastest)
    status = 1 if any(r["status"] == "error" for r in rows) else 0
    if not main_process:
        return status
    base = "none" if fastest is None else f"{fastest['variant']} ({fastest['layout']})"
    print(
        f"{MODEL} ({args.size}) x {world} processes, per-device batch {args.batch_size}, "
        f"{'bf16 autocast' if args.bf16 else 'fp32'}, {len(data)} training images on the "
        f"device, layout {args.layout}, {args.steps} timed steps after {args.warmup} warm-up "
        f"steps; baseline of the ratios: {base}, the fastest hand-written loop"
    )
    columns = {
        "variant": lambda r: r["variant"],
        "optimizer": lambda r: r["optimizer"],
        "layout": lambda r: r["layout"],
        "timed steps": lambda r: harness.fmt(r["steps"], "d"),
        "samples/s": lambda r: harness.fmt(r["samples_per_second"], ".1f"),
        "step ms": lambda r: harness.fmt(r["step_ms"], ".2f"),
        "x fastest loop": lambda r: harness.fmt(r["vs_loop"], ".3f", "x"),
        "compile s": lambda r: harness.fmt(r["compile_seconds"], ".1f"),
        "peak GiB": lambda r: harness.gib(r["peak_bytes"]),
        "status": lambda r: r["status"],
        "note": harness.note,
    }
    config = dict(model=MODEL, train_images=len(data), world_size=world, autocast=args.bf16)
    config.update(global_batch_size=world * args.batch_size, lr_scheduler=LR_SCHEDULE)
    config.update(label_smoothing=LABEL_SMOOTHING, cudnn_benchmark=args.bf16)
    config.update(compile_backend=args.compile_backend, compile_mode=args.compile_mode)
    config["baseline"] = None if fastest is None else fastest["variant"]
    config["augmentation"] = "random crop (4-pixel zero padding) and flip, on the device"
    config["hyperparameters"] = {k: harness.HYPERPARAMETERS[v[2]] for k, v in VARIANTS.items()}
    payload, text = {"config": config, "results": rows}, harness.table(rows, columns)
    harness.finish("trainer", args, payload, text, processes=world)
    return status
