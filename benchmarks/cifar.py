"""CIFAR-10 accuracy and training time of one optimizer: timm ``resnet18_cifar``, batch 512.

The acceptance comparison: one run per optimizer on the same GPU, their JSON lines
compared. One-cycle schedule, label smoothing 0.1 (the loop and the evaluation are the
quickstart's: ``hf_triaccel.quickstart.train_loop``), data decoded once and augmented on the
GPU; model and batches in ``--layout`` (default ``channels_last``, as ``TriAccelTrainer``
puts a convolutional model, for every optimizer; ``nchw``: torch's default);
``--precision``: ``bf16`` autocast (default), ``fp32`` (no autocast), or
``adaptive`` (bf16 autocast with per-module precision from the ``PrecisionController``,
built as ``TriAccelTrainer`` builds it; AdaFisher or AdaFisherW only). The record (one
JSON line on stdout and in ``--out FILE``) is described in README.md. ``--smoke``: a
narrow model of the same structure, random 16x16 images, on the CPU.

Usage:
    python -m benchmarks cifar --data /path/to/cifar10 --optimizer adamw --out adamw.json
    python -m benchmarks cifar --smoke --batch_size 8 --max_steps 5   # CPU
"""

import argparse
import json
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks import harness, records
from hf_triaccel.data.images import GPUBatchLoader, ImageTensors
from hf_triaccel.integrations.layout import to_channels_last
from hf_triaccel.integrations.plugin import TriAccelPlugin
from hf_triaccel.optim.adafisher import AdaFisher
from hf_triaccel.precision import PRECISIONS, plot_precision_map
from hf_triaccel.quickstart import evaluate, train_loop

NAME = "cifar"
HELP = "one CIFAR training run of the hand-written loop: accuracy and time"

# flag -> (type, default, help)
OPTIONS = {
    "data": (str, "embedded", "folder of train/test parquet files, or 'embedded'"),
    "epochs": (int, 30, "epochs"),
    "batch_size": (int, 512, "batch"),
    "lr": (float, None, "peak learning rate (default: the optimizer's)"),
    "weight_decay": (float, None, "weight decay (default: the optimizer's)"),
    "label_smoothing": (float, 0.1, "label smoothing"),
    "max_grad_norm": (
        float,
        None,
        "clip the gradients' global norm to this (default: no clipping)",
    ),
    "signals_every": (int, None, "adaptive precision: steps between two rankings"),
    "precision_map": (Path, None, "adaptive precision: write the map to this PNG"),
    "model": (str, "resnet18_cifar", "timm model"),
    "ema": (str, None, "AdaFisher's fold rule, reference or paper (default: the optimizer's)"),
    "update_every": (int, None, "AdaFisher: steps between refreshes (default: the rule's)"),
    "normalise": (
        str,
        None,
        "AdaFisher's normalisation, absolute (published) or relative (ours; default: "
        "the optimizer's)",
    ),
    "factor_init": (
        str,
        None,
        "AdaFisher's factor seed, ones (published) or zeros (ours; default: the optimizer's)",
    ),
    "seed": (int, 0, "seed"),
    "device": (str, None, "default: cuda (smoke: cpu)"),
    "max_steps": (int, None, "stop early"),
    "out": (Path, None, "also write the JSON line to this file"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The run's flags (:data:`OPTIONS`, the optimizer, precision, layout...)."""
    for name, (kind, default, help_) in OPTIONS.items():
        parser.add_argument(f"--{name}", type=kind, default=default, help=help_)
    parser.add_argument("--optimizer", choices=tuple(harness.HYPERPARAMETERS), default="adafisherw")
    parser.add_argument("--precision", choices=("bf16", "fp32", "adaptive"), default="bf16")
    parser.add_argument("--impl", choices=("triton", "foreach", "reference"))
    parser.add_argument(
        "--decay",
        choices=harness.DECAY_CHOICES,
        default="all",
        help="AdamW / SGD: decay every parameter, or exempt biases and normalisation weights "
        "as AdaFisher's groups do (AdaFisher always exempts them)",
    )
    parser.add_argument(
        "--layout", choices=("channels_last", "nchw"), default="channels_last", help="model/data"
    )
    parser.add_argument("--lr_steering", action="store_true", help="StepSizeSteering (AdaFisher)")
    parser.add_argument("--smoke", action="store_true", help="narrow model, random 16x16 images")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """The flags of ``argv``, checked, with the optimizer's defaults filled in."""
    parser = argparse.ArgumentParser(prog=f"python -m benchmarks {NAME}")
    add_arguments(parser)
    args = parser.parse_args(argv)
    args.argv = [NAME, *argv]
    return check(args)


def check(args: argparse.Namespace) -> argparse.Namespace:
    """Refuses contradictory flags and fills in the optimizer's defaults."""
    if args.precision_map is not None and args.precision != "adaptive":
        raise SystemExit("error: --precision_map needs --precision adaptive")
    fisher_flags = (args.ema, args.update_every, args.normalise, args.factor_init)
    uses_fisher = args.lr_steering or any(f is not None for f in fisher_flags)
    if uses_fisher and not args.optimizer.startswith("adafisher"):
        raise SystemExit(
            "error: --ema, --update_every, --normalise, --factor_init and --lr_steering need "
            "adafisher or adafisherw"
        )
    default_lr, default_wd = harness.HYPERPARAMETERS[args.optimizer]
    args.lr = default_lr if args.lr is None else args.lr
    args.weight_decay = default_wd if args.weight_decay is None else args.weight_decay
    args.device = torch.device(args.device or ("cpu" if args.smoke else "cuda"))
    return args


def adaptive_record(controllers: tuple | None, precision_map: Path | None) -> dict | None:
    """The ``adaptive_precision`` field of the record (``None`` for a static precision)."""
    if controllers is None:
        return None
    signals, controller = controllers
    counts, policy = controller.counts(), controller.policy
    names = ("fp32_fraction", "fp16_fraction", "margin", "patience")
    return {
        "counts": {p: counts[f"precision_{p}"] for p in PRECISIONS},
        "changes": counts["precision_changes"],
        "changes_by_reason": dict(Counter(e.reason for e in controller.events)),
        "rankings": controller.evaluations,
        "decisions": dict(controller.decisions),
        "compute_shares": controller.compute_shares(),
        "policy": {"signals_every": signals.every, **{n: getattr(policy, n) for n in names}},
        "map": None if precision_map is None else str(precision_map),
    }


def preconditioner_spread(optimizer: torch.optim.Optimizer) -> dict[str, float] | None:
    """How much AdaFisher's preconditioner ``F = g a^T + damping`` varies inside a layer
    at the end of a run: per Fisher layer max F / min F (the factors are non-negative, so
    the extremes are the products of the factors' extremes), its median and maximum over
    the layers. ``None`` for another optimizer."""
    if not isinstance(optimizer, AdaFisher) or optimizer.collector is None:
        return None
    damping = optimizer.defaults["damping"]
    spreads = sorted(
        float((ly.g.max() * ly.a.max() + damping) / (ly.g.min() * ly.a.min() + damping))
        for ly in optimizer.collector.layers.values()
    )
    return {"median": spreads[len(spreads) // 2], "max": spreads[-1], "layers": len(spreads)}


def load_data(args: argparse.Namespace) -> tuple[ImageTensors, ImageTensors, float]:
    """The training and test images of ``args.data`` (random ones for a smoke run) and
    the seconds their decoding took."""
    start = time.perf_counter()
    n = max(256, 2 * args.batch_size)  # smoke: images for two batches at least
    train_data = harness.load_images(args.data, "train", smoke=args.smoke, n=n)
    test_data = harness.load_images(args.data, "test", smoke=args.smoke, n=64)
    return train_data, test_data, time.perf_counter() - start


def train(
    args: argparse.Namespace, data: tuple[ImageTensors, ImageTensors, float] | None = None
) -> dict[str, Any]:
    """Decodes the data (unless ``data`` holds :func:`load_data`'s result), trains,
    evaluates; returns the result record."""
    device, cuda = args.device, args.device.type == "cuda"
    torch.backends.cudnn.benchmark = True
    if cuda:  # this run's peak, when several share a process
        torch.cuda.reset_peak_memory_stats(device)
    train_data, test_data, decode_seconds = load_data(args) if data is None else data
    mean, std = train_data.channel_stats()
    size, classes = "narrow" if args.smoke else "full", train_data.num_classes
    model = harness.build_model(args.model, size, seed=args.seed, num_classes=classes).to(device)
    # as TriAccelTrainer does: channels-last for a model with 2-D convolutions
    args.channels_last = args.layout == "channels_last" and to_channels_last(model)
    common = dict(device=device, mean=mean, std=std, channels_last=args.channels_last)
    train_loader = harness.image_batches(train_data, args.batch_size, seed=args.seed, **common)
    test_loader = GPUBatchLoader(test_data, 1024, **common)
    fisher = {"impl": args.impl, "update_every": args.update_every}
    chosen = {k: getattr(args, k) for k in ("ema", "normalise", "factor_init")}
    fisher.update({k: v for k, v in chosen.items() if v is not None})  # else the optimizer's
    optimizer = harness.make_optimizer(
        args.optimizer,
        model,
        lr=args.lr,
        weight_decay=args.weight_decay,
        decay=args.decay,
        **fisher,
    )
    every = {} if args.signals_every is None else {"signals_every": args.signals_every}
    plugin = TriAccelPlugin(
        precision=args.precision == "adaptive", lr_steering=args.lr_steering, **every
    )
    controllers = None
    if args.precision == "adaptive":
        if not isinstance(optimizer, AdaFisher):
            raise ValueError("--precision adaptive needs --optimizer adafisher or adafisherw")
        # as TriAccelTrainer builds them under bf16 mixed precision: no fp16 modules
        controllers = plugin.build_precision(model, optimizer, fp16=False)
    steering = plugin.build_steering(optimizer, None if controllers is None else controllers[0])
    args.total_steps = args.epochs * len(train_loader)
    if args.max_steps is not None:
        args.total_steps = min(args.total_steps, args.max_steps)
    bf16 = args.precision != "fp32"
    harness.synchronize(device)
    train_start = time.perf_counter()
    # the adaptive controller's hooks open each decided module's own region inside autocast
    epochs = train_loop(
        model,
        optimizer,
        train_loader,
        total_steps=args.total_steps,
        lr=args.lr,
        bf16=bf16,
        label_smoothing=args.label_smoothing,
        max_grad_norm=args.max_grad_norm,
        log=lambda line: print(line, file=sys.stderr),
        desc=args.optimizer,
        progress=False,
    )
    harness.synchronize(device)
    train_seconds = time.perf_counter() - train_start

    eval_start = time.perf_counter()
    test_accuracy = evaluate(model, test_loader, bf16)
    eval_seconds = time.perf_counter() - eval_start
    if args.precision_map is not None:  # parse_args allows it for adaptive runs only
        args.precision_map.parent.mkdir(parents=True, exist_ok=True)
        plot_precision_map(controllers[1].events, args.precision_map, last_step=args.total_steps)

    # the first epoch carries cuDNN autotuning and warm-up: leave it out when there are more
    timed = epochs[1:] if len(epochs) > 1 else epochs
    images_per_second = sum(e["samples"] for e in timed) / sum(e["seconds"] for e in timed)
    names = ("optimizer", "precision", "model", "lr", "weight_decay", "label_smoothing", "impl")
    names += ("ema", "update_every", "normalise", "factor_init", "decay", "max_grad_norm")
    names += ("batch_size", "layout", "channels_last", "seed", "data", "smoke")
    record = {name: getattr(args, name) for name in names}
    record.update(epochs=len(epochs), steps=args.total_steps, train_images=len(train_data))
    record.update(test_images=len(test_data), test_accuracy=test_accuracy)
    record.update(final_train_loss=epochs[-1]["train_loss"], train_seconds=train_seconds)
    record.update(final_train_accuracy=epochs[-1]["train_accuracy"])
    record.update(epoch_seconds=[e["seconds"] for e in epochs], images_per_second=images_per_second)
    record.update(decode_seconds=decode_seconds, eval_seconds=eval_seconds)
    record["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None
    record["adaptive_precision"] = adaptive_record(controllers, args.precision_map)
    record["preconditioner_spread"] = preconditioner_spread(optimizer)
    record["lr_steering_scales"] = None if steering is None else steering.scales
    # fp32 matmuls and convolutions run in TF32 where these are on (torch's defaults are
    # left as they are: off for matmuls, on for cuDNN convolutions)
    record["tf32_matmul"] = torch.backends.cuda.matmul.allow_tf32
    record["tf32_cudnn"] = torch.backends.cudnn.allow_tf32
    return {**record, "env": harness.environment(args.argv, device)}


def run(args: argparse.Namespace) -> int:
    """Trains once; prints its JSON line, writes it to ``--out`` and appends its record."""
    result = train(check(args))
    line = json.dumps(result)
    print(line)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(line + "\n")
    out = Path(args.out).parent if args.out is not None else Path(".")
    records.append(records.destination(args, out), records.from_payload(NAME, result))
    return 0
