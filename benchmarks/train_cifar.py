r"""CIFAR-10 accuracy and training time of one optimizer: timm ``resnet18_cifar``, batch 512.

The acceptance comparison: run it once per optimizer, on the same GPU, and compare the
JSON lines. Every run trains with a one-cycle learning-rate schedule and label smoothing
0.1, from data decoded once and kept on the GPU
(:class:`~hf_triaccel.data.images.GPUBatchLoader`: random crop with 4-pixel zero padding
and horizontal flip, done per batch on the GPU), in the compute precision ``--precision``
chooses; the test pass runs in the same precision:

- ``bf16`` (default): the whole model under bf16 autocast;
- ``fp32``: no autocast. TF32 is left as torch sets it (by default off for matmuls, on
  for cuDNN convolutions, so most of a ResNet computes in TF32); the record says which;
- ``adaptive``: bf16 autocast with per-module precision from
  :class:`~hf_triaccel.precision.PrecisionController`, built as ``TriAccelTrainer`` builds
  it: normalisation layers in fp32 from the start; every 200 steps (``--signals_every``)
  the other modules are ranked by sensitivity per multiply-add, the most sensitive ones
  computing in fp32 up to 3% of the compute (``PrecisionPolicy.fp32_fraction``) and the
  rest in bf16. It needs AdaFisher or AdaFisherW, whose Fisher factors the signals come
  from.

Reported, as one JSON line on stdout (and in ``--out FILE``):

- ``train_seconds``: wall time of all training steps, the GPU synchronised before the
  clock starts and before it stops; data decoding (``decode_seconds``) and the test pass
  (``eval_seconds``) are timed separately;
- ``epoch_seconds``: per epoch (the loss is read back once per epoch); the first epoch
  includes cuDNN autotuning, so ``images_per_second`` is taken over the other epochs;
- ``test_accuracy`` after the last epoch, ``peak_memory_gib`` of the whole run
  (``torch.cuda.max_memory_allocated``, the data set on the GPU included);
- ``precision``, ``tf32_matmul`` and ``tf32_cudnn`` (torch's TF32 flags during the run);
- ``adaptive_precision`` (``None`` for bf16 and fp32): the number of modules per precision
  at the end (``counts``), the number of logged precision changes (``changes``, the
  initial assignments included) and their count per reason, the number of rankings, the
  final decision per module, the share of the compute per precision (``compute_shares``),
  the policy, and the path of the precision map
  (``--precision_map FILE.png``: each module's precision over the training steps);
- ``lr_steering_scales``: with ``--lr_steering`` (each module's step scaled by a factor
  from its curvature, re-decided with the signals, see
  :class:`~hf_triaccel.optim.steering.StepSizeSteering`), the final scale per module;
  else ``None``.

Default hyperparameters per optimizer (``--lr`` / ``--weight_decay`` override them):
AdamW (fused) lr 3e-3, weight decay 0.05; AdaFisher lr 3e-3 and AdaFisherW lr 1e-2, both
weight decay 5e-4, gamma 0.8, factors refreshed every 100 steps. The published AdaFisher
lr of 1e-3 underfits in this 30-epoch one-cycle setting (BENCHMARKS.md has the sweep).

Usage:
    python benchmarks/train_cifar.py --data /path/to/cifar10 --optimizer adamw --out adamw.json
    python benchmarks/train_cifar.py --data /path/to/cifar10 --optimizer adafisherw
    python benchmarks/train_cifar.py --epochs 2 --optimizer adafisher   # embedded slice

The precision comparison, three seeds of each precision on one GPU (the precisions
interleaved, so that a drift of the GPU's speed does not favour one of them)::

    for seed in 0 1 2; do
      for precision in bf16 fp32 adaptive; do
        python benchmarks/train_cifar.py --data /path/to/cifar10 --optimizer adafisher \
            --precision $precision --seed $seed --out precision/$precision-$seed.json \
            $([ $precision = adaptive ] && echo --precision_map precision/map-$seed.png)
      done
    done
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from collections.abc import Sequence
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch

from hf_triaccel.curvature.signals import SignalTracker
from hf_triaccel.data.images import GPUBatchLoader, load_image_dataset
from hf_triaccel.integrations.plugin import TriAccelPlugin
from hf_triaccel.integrations.timm_models import create_cifar_model
from hf_triaccel.precision import PRECISIONS, PrecisionController, plot_precision_map
from hf_triaccel.quickstart import (
    DEFAULT_HYPERPARAMETERS,
    OPTIMIZERS,
    PRECISION_MODES,
    build_optimizer,
    build_precision,
    evaluate,
    train_loop,
)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command-line flags, with the optimizer's defaults filled in."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--data",
        default="embedded",
        help="folder with train.parquet and test.parquet (Hub layout), or 'embedded'",
    )
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="adafisherw")
    parser.add_argument(
        "--precision",
        choices=PRECISION_MODES,
        default="bf16",
        help="bf16 autocast, fp32 (no autocast), or adaptive per-module precision",
    )
    parser.add_argument(
        "--precision_map",
        type=Path,
        default=None,
        help="write the adaptive precision map over training steps to this PNG",
    )
    parser.add_argument(
        "--signals_every",
        type=int,
        default=None,
        help="adaptive precision: optimizer steps between two rankings (default 200)",
    )
    parser.add_argument(
        "--lr_steering",
        action="store_true",
        help="scale each module's step by its curvature (StepSizeSteering; AdaFisher only)",
    )
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch_size", type=int, default=512)
    parser.add_argument("--lr", type=float, default=None, help="peak learning rate")
    parser.add_argument("--weight_decay", type=float, default=None)
    parser.add_argument("--label_smoothing", type=float, default=0.1)
    parser.add_argument(
        "--impl",
        default=None,
        choices=("triton", "foreach", "reference"),
        help="AdaFisher implementation (default: automatic)",
    )
    parser.add_argument("--channels_last", action="store_true", help="channels-last model/data")
    parser.add_argument("--model", default="resnet18_cifar")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda")
    parser.add_argument(
        "--max_steps", type=int, default=None, help="stop early (for quick checks of the script)"
    )
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON line here")
    args = parser.parse_args(argv)
    if args.precision_map is not None and args.precision != "adaptive":
        parser.error("--precision_map needs --precision adaptive")
    if args.lr_steering and args.optimizer == "adamw":
        parser.error("--lr_steering needs --optimizer adafisher or adafisherw")
    default_lr, default_wd = DEFAULT_HYPERPARAMETERS[args.optimizer]
    args.lr = default_lr if args.lr is None else args.lr
    args.weight_decay = default_wd if args.weight_decay is None else args.weight_decay
    args.device = torch.device(args.device)
    return args


def synchronize(device: torch.device) -> None:
    """Waits for queued GPU work (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def adaptive_record(
    controllers: tuple[SignalTracker, PrecisionController] | None, precision_map: Path | None
) -> dict[str, Any] | None:
    """The ``adaptive_precision`` field of the record (``None`` for a static precision)."""
    if controllers is None:
        return None
    signals, controller = controllers
    counts = controller.counts()
    return {
        "counts": {p: counts[f"precision_{p}"] for p in PRECISIONS},
        "changes": counts["precision_changes"],
        "changes_by_reason": dict(Counter(e.reason for e in controller.events)),
        "rankings": controller.evaluations,
        "decisions": dict(controller.decisions),
        "compute_shares": controller.compute_shares(),
        "policy": {
            "signals_every": signals.every,
            "fp32_fraction": controller.policy.fp32_fraction,
            "fp16_fraction": controller.policy.fp16_fraction,
            "margin": controller.policy.margin,
            "patience": controller.policy.patience,
        },
        "map": None if precision_map is None else str(precision_map),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Decodes the data, trains, evaluates; returns the result record."""
    device = args.device
    cuda = device.type == "cuda"
    torch.backends.cudnn.benchmark = True
    torch.manual_seed(args.seed)

    start = time.perf_counter()
    train_data = load_image_dataset(args.data, "train")
    test_data = load_image_dataset(args.data, "test")
    decode_seconds = time.perf_counter() - start
    mean, std = train_data.channel_stats()
    loader_args = dict(device=device, mean=mean, std=std, channels_last=args.channels_last)
    train_loader = GPUBatchLoader(
        train_data,
        args.batch_size,
        shuffle=True,
        augment=True,
        drop_last=True,
        seed=args.seed,
        **loader_args,
    )
    test_loader = GPUBatchLoader(test_data, 1024, **loader_args)

    model = create_cifar_model(args.model, num_classes=train_data.num_classes).to(device)
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    optimizer = build_optimizer(args.optimizer, model, args.lr, args.weight_decay, impl=args.impl)
    controllers = build_precision(args.precision, model, optimizer, args.signals_every)
    steering = TriAccelPlugin(
        lr_steering=args.lr_steering, signals_every=args.signals_every
    ).build_steering(optimizer, None if controllers is None else controllers[0])
    total_steps = args.epochs * len(train_loader)
    if args.max_steps is not None:
        total_steps = min(total_steps, args.max_steps)
    synchronize(device)
    train_start = time.perf_counter()
    step, epochs = train_loop(
        model,
        optimizer,
        train_loader,
        total_steps=total_steps,
        lr=args.lr,
        precision=args.precision,
        label_smoothing=args.label_smoothing,
        log=lambda line: print(line, file=sys.stderr),
    )
    synchronize(device)
    train_seconds = time.perf_counter() - train_start

    eval_start = time.perf_counter()
    test_accuracy = evaluate(model, test_loader, args.precision)
    eval_seconds = time.perf_counter() - eval_start
    if args.precision_map is not None:  # parse_args allows it for adaptive runs only
        args.precision_map.parent.mkdir(parents=True, exist_ok=True)
        plot_precision_map(controllers[1].events, args.precision_map, last_step=step)

    # the first epoch carries cuDNN autotuning and warm-up: leave it out when there are more
    timed = epochs[1:] if len(epochs) > 1 else epochs
    images_per_second = sum(e["samples"] for e in timed) / sum(e["seconds"] for e in timed)
    return {
        "optimizer": args.optimizer,
        "precision": args.precision,
        "model": args.model,
        "lr": args.lr,
        "weight_decay": args.weight_decay,
        "label_smoothing": args.label_smoothing,
        "impl": args.impl,
        "epochs": len(epochs),
        "steps": step,
        "batch_size": args.batch_size,
        "channels_last": args.channels_last,
        "seed": args.seed,
        "data": args.data,
        "train_images": len(train_data),
        "test_images": len(test_data),
        "test_accuracy": test_accuracy,
        "final_train_loss": epochs[-1]["train_loss"],
        "final_train_accuracy": epochs[-1]["train_accuracy"],
        "train_seconds": train_seconds,
        "epoch_seconds": [e["seconds"] for e in epochs],
        "images_per_second": images_per_second,
        "decode_seconds": decode_seconds,
        "eval_seconds": eval_seconds,
        "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
        "adaptive_precision": adaptive_record(controllers, args.precision_map),
        "lr_steering_scales": None if steering is None else steering.scales,
        # fp32 matmuls and convolutions run in TF32 where these are on (torch's defaults
        # are left as they are: off for matmuls, on for cuDNN convolutions)
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "tf32_cudnn": torch.backends.cudnn.allow_tf32,
        "device": torch.cuda.get_device_name(device) if cuda else str(device),
        "torch": torch.__version__,
        "timm": version("timm"),
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Runs one training and prints (and optionally writes) its JSON line.

    Example:
        >>> main(["--optimizer", "adamw", "--epochs", "1"])  # doctest: +SKIP
    """
    args = parse_args(argv)
    result = run(args)
    line = json.dumps(result)
    print(line)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(line + "\n")
    return result


if __name__ == "__main__":
    main()
