"""CIFAR-10 accuracy and training time of one optimizer: timm ``resnet18_cifar``, batch 512.

The acceptance comparison: run it once per optimizer, on the same GPU, and compare the
JSON lines. Every run trains under bf16 autocast with a one-cycle learning-rate schedule
and label smoothing 0.1, from data decoded once and kept on the GPU
(:class:`~hf_triaccel.data.images.GPUBatchLoader`: random crop with 4-pixel zero padding
and horizontal flip, done per batch on the GPU).

Reported, as one JSON line on stdout (and in ``--out FILE``):

- ``train_seconds``: wall time of all training steps, the GPU synchronised before the
  clock starts and before it stops; data decoding (``decode_seconds``) and the test pass
  (``eval_seconds``) are timed separately;
- ``epoch_seconds``: per epoch (the loss is read back once per epoch); the first epoch
  includes cuDNN autotuning, so ``images_per_second`` is taken over the other epochs;
- ``test_accuracy`` after the last epoch, ``peak_memory_gib`` of the whole run
  (``torch.cuda.max_memory_allocated``, the data set on the GPU included).

Default hyperparameters per optimizer (``--lr`` / ``--weight_decay`` override them):
AdamW (fused) lr 3e-3, weight decay 0.05; AdaFisher lr 3e-3 and AdaFisherW lr 1e-2, both
weight decay 5e-4, gamma 0.8, factors refreshed every 100 steps. The published AdaFisher
lr of 1e-3 underfits in this 30-epoch one-cycle setting (BENCHMARKS.md has the sweep).

Usage:
    python benchmarks/train_cifar.py --data /path/to/cifar10 --optimizer adamw --out adamw.json
    python benchmarks/train_cifar.py --data /path/to/cifar10 --optimizer adafisherw
    python benchmarks/train_cifar.py --epochs 2 --optimizer adafisher   # embedded slice
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch

from hf_triaccel.data.images import GPUBatchLoader, load_image_dataset
from hf_triaccel.integrations.timm_models import create_cifar_model
from hf_triaccel.quickstart import (
    DEFAULT_HYPERPARAMETERS,
    OPTIMIZERS,
    build_optimizer,
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
    default_lr, default_wd = DEFAULT_HYPERPARAMETERS[args.optimizer]
    args.lr = default_lr if args.lr is None else args.lr
    args.weight_decay = default_wd if args.weight_decay is None else args.weight_decay
    args.device = torch.device(args.device)
    return args


def synchronize(device: torch.device) -> None:
    """Waits for queued GPU work (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
        bf16=cuda,
        label_smoothing=args.label_smoothing,
        log=lambda line: print(line, file=sys.stderr),
    )
    synchronize(device)
    train_seconds = time.perf_counter() - train_start

    eval_start = time.perf_counter()
    test_accuracy = evaluate(model, test_loader, bf16=cuda)
    eval_seconds = time.perf_counter() - eval_start

    # the first epoch carries cuDNN autotuning and warm-up: leave it out when there are more
    timed = epochs[1:] if len(epochs) > 1 else epochs
    images_per_second = sum(e["samples"] for e in timed) / sum(e["seconds"] for e in timed)
    return {
        "optimizer": args.optimizer,
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
